"""Rollouts ahead of training, as far as algorithm.maxStaleness allows.

With maxStaleness k = 0 (the paper's loop) a step's rollouts start when the step does and the
engines idle while the trainer trains. With k > 0, once step S's rollouts are collected the
rollouts of steps S+1 .. S+k are started, so the engines roll them out while the trainer
trains on S and pushes its weights. A rollout started before the push of weights vS samples
its first turns from older weights; UpdateWeights lets the turns in flight finish, so a turn
never spans a push but a trajectory can (each segment records its version). Step S trains on
weights S-1; a token sampled from version v is S-1-v steps stale, at most k by construction:
`stale_trajectories` is the guard that drops any older (a rollout tried again after a
failure, say), and the truncated importance sampling of the loss (algorithm.tisCap,
mandatory here) corrects each token by the logprobs of the weights that sampled it.

`RolloutsAhead` only orders starts and collections; the session gives it the calls that
start a step's rollouts (on the Ray worker) and collect them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kubestar.training.trajectory import MODEL, Trajectory

Handle = TypeVar("Handle")
Result = TypeVar("Result")


@dataclass
class Launched(Generic[Handle]):
    handle: Handle
    started: float  # the clock when it was started


@dataclass
class RolloutsAhead(Generic[Handle, Result]):
    """The rollouts of steps 0 .. `steps`-1 of a stage (stage-local indices), each started
    once, at most `depth` beyond the step being collected."""

    depth: int
    steps: int
    start: Callable[[int], Handle]
    collect: Callable[[Handle], Result]
    clock: Callable[[], float] = time.monotonic
    launched: dict[int, Launched[Handle]] = field(default_factory=dict)
    taken: set[int] = field(default_factory=set)

    def take(self, step: int) -> tuple[Result, float]:
        """Step `step`'s rollouts (started now unless started ahead) and when they were
        started; then the next `depth` steps' are started."""
        launched = self.launched.pop(step, None) or self._launch(step)
        self.taken.add(step)
        result = self.collect(launched.handle)
        for ahead in range(step + 1, min(step + 1 + self.depth, self.steps)):
            if ahead not in self.launched:
                self.launched[ahead] = self._launch(ahead)
        return result, launched.started

    def again(self, step: int) -> tuple[Result, float]:
        """Step `step`'s rollouts started anew and collected (an attempt after a failure);
        no step is started ahead."""
        launched = self._launch(step)
        return self.collect(launched.handle), launched.started

    def _launch(self, step: int) -> Launched[Handle]:
        return Launched(self.start(step), self.clock())


def token_staleness(trajectory: Trajectory, trained_on: int) -> list[tuple[int, int]]:
    """(staleness, model tokens) per model segment of `trajectory`, for a step that trains
    weights `trained_on` (step S trains weights S-1)."""
    return [
        (trained_on - segment.weights_version, segment.end - segment.start)
        for segment in trajectory.segments
        if segment.owner == MODEL
    ]


def stale_trajectories(
    trajectories: Sequence[Trajectory], trained_on: int, bound: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """(kept, dropped): a trajectory with a token sampled more than `bound` versions before
    `trained_on` is dropped."""
    kept: list[Trajectory] = []
    dropped: list[Trajectory] = []
    for trajectory in trajectories:
        ages = [age for age, _ in token_staleness(trajectory, trained_on)]
        (dropped if ages and max(ages) > bound else kept).append(trajectory)
    return kept, dropped


def staleness_metrics(trajectories: Sequence[Trajectory], trained_on: int) -> dict[str, float]:
    """staleness_max and staleness_mean (over model tokens), and off_policy_token_fraction:
    the share of model tokens sampled from weights older than `trained_on`, which the
    importance weights correct."""
    ages = [pair for t in trajectories for pair in token_staleness(t, trained_on)]
    tokens = sum(count for _, count in ages)
    stale = sum(count for age, count in ages if age > 0)
    return {
        "staleness_max": float(max((age for age, _ in ages), default=0)),
        "staleness_mean": sum(age * count for age, count in ages) / tokens if tokens else 0.0,
        "off_policy_token_fraction": stale / tokens if tokens else 0.0,
    }


def idle_seconds(window: tuple[float, float], busy: Sequence[tuple[float, float]]) -> float:
    """Seconds of `window` (start, end) covered by none of the `busy` intervals."""
    start, end = window
    covered, cursor = 0.0, start
    for begin, finish in sorted(busy):
        begin, finish = max(begin, cursor), min(finish, end)
        if finish > begin:
            covered += finish - begin
            cursor = finish
    return max(end - start - covered, 0.0)
