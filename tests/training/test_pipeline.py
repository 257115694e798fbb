"""Rollouts ahead of training (kubestar.training.pipeline): the order of starts and
collections for each algorithm.maxStaleness, the staleness bound, and the figures of a step.
The session's wiring runs for real in tests/training/test_train_session.py."""

from __future__ import annotations

import pytest
from kubestar.api.v1alpha1 import AlgorithmSpec
from kubestar.training.pipeline import (
    RolloutsAhead,
    idle_seconds,
    stale_trajectories,
    staleness_metrics,
)
from kubestar.training.trajectory import MODEL, TOOL, Segment, Trajectory
from pydantic import ValidationError


def trajectory(name: str, *versions: int, tokens: int = 10) -> Trajectory:
    """Model turns sampled from `versions`, a tool response between each two."""
    segments, cursor = [], 0
    for turn, version in enumerate(versions):
        segments.append(Segment(MODEL, turn, cursor, cursor + tokens, "x", weights_version=version))
        cursor += tokens
        segments.append(Segment(TOOL, turn, cursor, cursor + 3, "out"))
        cursor += 3
    return Trajectory(id=name, problem_id="p", sample_index=0, question="q", reference="7",
                      segments=segments)  # fmt: skip


class Engines:
    """Stands in for the Ray worker and the fleet: a started rollout samples its first turn
    from the weights served when it starts and its second from those served when it is
    collected (a turn never spans a push; a trajectory can)."""

    def __init__(self) -> None:
        self.version = 0
        self.events: list[str] = []

    def start(self, step: int) -> tuple[int, int]:
        self.events.append(f"start {step}")
        return step, self.version

    def collect(self, handle: tuple[int, int]) -> list[Trajectory]:
        step, first = handle
        self.events.append(f"collect {step}")
        return [trajectory(f"s{step}", first, self.version)]


def run(depth: int, steps: int) -> tuple[Engines, list[dict[str, float]]]:
    """A stage's loop as the session runs it: take the step's rollouts, train on them, push
    the new weights (the engines serve version S after step S)."""
    engines = Engines()
    ahead = RolloutsAhead(depth=depth, steps=steps, start=engines.start, collect=engines.collect)
    figures = []
    for step in range(steps):
        trajectories, _ = ahead.take(step)
        trained_on = step  # step S+1 trains the weights pushed after step S (version S)
        kept, dropped = stale_trajectories(trajectories, trained_on, depth)
        figures.append({**staleness_metrics(kept, trained_on), "dropped": float(len(dropped))})
        engines.events.append(f"push {step + 1}")
        engines.version = step + 1
    return engines, figures


def test_in_step_each_rollout_starts_after_the_previous_push() -> None:
    engines, figures = run(depth=0, steps=3)
    assert engines.events == [
        "start 0", "collect 0", "push 1",
        "start 1", "collect 1", "push 2",
        "start 2", "collect 2", "push 3",
    ]  # fmt: skip
    assert all(f["staleness_max"] == 0 and f["off_policy_token_fraction"] == 0 for f in figures)


@pytest.mark.parametrize("depth", [1, 2])
def test_rollouts_run_ahead_within_the_bound(depth: int) -> None:
    engines, figures = run(depth=depth, steps=6)
    starts = [e for e in engines.events if e.startswith("start")]
    assert starts == [f"start {s}" for s in range(6)]  # each step once, in order
    # While step S trains (its push not yet made), the next `depth` steps roll out.
    in_flight, during_training = 0, []
    for event in engines.events:
        in_flight += {"start": 1, "collect": -1, "push": 0}[event.split()[0]]
        if event.startswith("push"):
            during_training.append(in_flight)
    assert during_training == [min(depth, 6 - step - 1) for step in range(6)]
    # A step's first turns lag by as many versions as it was started ahead: never more
    # than the bound, so none is dropped.
    assert [f["staleness_max"] for f in figures] == [min(step, depth) for step in range(6)]
    assert all(f["dropped"] == 0 for f in figures)
    assert [f["off_policy_token_fraction"] for f in figures] == [0.0] + [0.5] * 5


def test_nothing_is_started_past_the_stage() -> None:
    engines = Engines()
    ahead = RolloutsAhead(depth=3, steps=2, start=engines.start, collect=engines.collect)
    ahead.take(0)
    ahead.take(1)
    assert [e for e in engines.events if e.startswith("start")] == ["start 0", "start 1"]


def test_an_attempt_after_a_failure_rolls_out_again_without_starting_more() -> None:
    engines = Engines()
    ahead = RolloutsAhead(depth=1, steps=3, start=engines.start, collect=engines.collect)
    ahead.take(0)
    ahead.again(0)
    assert engines.events == ["start 0", "collect 0", "start 1", "start 0", "collect 0"]
    assert 0 in ahead.taken and list(ahead.launched) == [1]


def test_trajectories_older_than_the_bound_are_dropped() -> None:
    fresh, lagging, old = trajectory("a", 4, 5), trajectory("b", 3, 5), trajectory("c", 2, 5)
    kept, dropped = stale_trajectories([fresh, lagging, old], trained_on=5, bound=2)
    assert [t.id for t in kept] == ["a", "b"] and [t.id for t in dropped] == ["c"]
    figures = staleness_metrics([fresh, lagging], trained_on=5)
    # Tokens: a's 10 at age 1 and 10 at 0; b's 10 at age 2 and 10 at 0.
    assert figures == {
        "staleness_max": 2.0,
        "staleness_mean": pytest.approx(0.75),
        "off_policy_token_fraction": 0.5,
    }


def test_engine_idle_seconds_are_the_window_no_rollout_covers() -> None:
    assert idle_seconds((0.0, 10.0), []) == 10.0
    assert idle_seconds((0.0, 10.0), [(0.0, 4.0)]) == 6.0  # in step: idle while training
    assert idle_seconds((0.0, 10.0), [(0.0, 4.0), (4.1, 10.0)]) == pytest.approx(0.1)
    assert idle_seconds((5.0, 10.0), [(0.0, 6.0), (5.5, 7.0), (9.0, 12.0)]) == 2.0  # 7 to 9


def test_max_staleness_needs_the_importance_correction() -> None:
    with pytest.raises(ValidationError, match=r"maxStaleness \(1\) needs tisCap"):
        AlgorithmSpec.model_validate({"maxStaleness": 1})
    assert AlgorithmSpec.model_validate({"maxStaleness": 2, "tisCap": 2}).max_staleness == 2
    with pytest.raises(ValidationError, match="maxStaleness"):
        AlgorithmSpec.model_validate({"maxStaleness": 9, "tisCap": 2})
