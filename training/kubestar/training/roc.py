"""Resample-on-Correct (RoC): roll out 2G per problem, keep G.

Groups whose rewards are all equal carry no signal and are dropped. Of the rest, positives
and negatives are kept in proportion to their counts; the positives kept are those with the
fewest tool errors and format problems, the negatives are drawn uniformly at random (so
failures stay diverse). The penalty of a trajectory is

    tool-error share (errors / tool calls; 0.5 when it called no tool)
  + format penalty (1 with no answer; with several answers, (answers - 1) / turns, at most 1)

Two ways to pick positives: `inverse-penalty` samples without replacement with probability
proportional to 1 / (penalty + 0.1), as the paper describes; `lowest-penalty` takes the lowest
penalties first, as the authors' released code does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

T = TypeVar("T")
PositiveSelection = Literal["inverse-penalty", "lowest-penalty"]
PENALTY_FLOOR = 0.1  # keeps 1/penalty finite for flawless traces


@dataclass(frozen=True)
class TraceQuality:
    reward: float
    tool_calls: int
    tool_errors: int
    answers: int  # \boxed{} answers given
    turns: int = 1


def penalty(quality: TraceQuality) -> float:
    error_share = quality.tool_errors / quality.tool_calls if quality.tool_calls else 0.5
    if quality.answers == 0:
        format_penalty = 1.0
    else:
        format_penalty = min(1.0, (quality.answers - 1) / max(quality.turns, 1))
    return error_share + format_penalty


def resample_on_correct(
    group: Sequence[T],
    quality: Callable[[T], TraceQuality],
    keep: int,
    rng: random.Random,
    positive_selection: PositiveSelection = "inverse-penalty",
) -> list[T] | None:
    """Down-sample one problem's oversampled group to `keep` trajectories, or None to drop it."""
    if len(group) <= keep:
        raise ValueError(f"RoC needs an oversampled group: got {len(group)} for keep={keep}")
    qualities = [quality(item) for item in group]
    if len({q.reward for q in qualities}) == 1:
        return None
    positives = [(item, q) for item, q in zip(group, qualities, strict=True) if q.reward > 0]
    negatives = [item for item, q in zip(group, qualities, strict=True) if q.reward <= 0]
    keep_positive = round(len(positives) * keep / len(group))
    keep_positive = min(max(keep_positive, 1), keep - 1, len(positives))
    keep_negative = min(keep - keep_positive, len(negatives))
    keep_positive = keep - keep_negative

    if positive_selection == "lowest-penalty":
        ranked = sorted(positives, key=lambda pair: penalty(pair[1]))
        kept_positives = [item for item, _ in ranked[:keep_positive]]
    else:
        # Weighted sampling without replacement (Efraimidis-Spirakis keys u^(1/w)).
        keyed = [(rng.random() ** (penalty(q) + PENALTY_FLOOR), item) for item, q in positives]
        keyed.sort(key=lambda pair: pair[0], reverse=True)
        kept_positives = [item for _, item in keyed[:keep_positive]]
    return kept_positives + rng.sample(negatives, keep_negative)
