"""Resample-on-Correct on constructed groups."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from kubestar.training.roc import TraceQuality, penalty, resample_on_correct
from kubestar.training.trainer import kept_metrics


def q(reward: float, calls: int = 1, errors: int = 0, answers: int = 1) -> TraceQuality:
    return TraceQuality(reward=reward, tool_calls=calls, tool_errors=errors, answers=answers)


def test_penalty_terms() -> None:
    assert penalty(q(1, calls=4, errors=1)) == pytest.approx(0.25)
    assert penalty(q(1, calls=0)) == pytest.approx(0.5)  # never used the tool
    assert penalty(q(0, calls=2, errors=0, answers=0)) == pytest.approx(1.0)
    assert penalty(TraceQuality(1, 1, 0, answers=3, turns=4)) == pytest.approx(0.5)


def test_uniform_groups_are_dropped() -> None:
    group = [q(1.0) for _ in range(8)]
    assert resample_on_correct(group, lambda t: t, keep=4, rng=random.Random(0)) is None


def test_keeps_proportions_and_the_cleanest_positives() -> None:
    clean = [q(1, calls=2, errors=0) for _ in range(2)]
    noisy = [q(1, calls=2, errors=2) for _ in range(2)]
    negatives = [q(0, calls=1, errors=1) for _ in range(4)]
    kept = resample_on_correct(
        clean + noisy + negatives,
        lambda t: t,
        keep=4,
        rng=random.Random(0),
        positive_selection="lowest-penalty",
    )
    assert kept is not None and len(kept) == 4
    positives = [t for t in kept if t.reward > 0]
    assert len(positives) == 2  # 4 of 8 positive -> 2 of 4
    assert all(t.tool_errors == 0 for t in positives)


def test_inverse_penalty_sampling_prefers_clean_traces() -> None:
    clean = q(1, calls=2, errors=0)
    noisy = q(1, calls=2, errors=2)
    group = [clean, noisy, q(0), q(0)]
    picks: Counter[bool] = Counter()
    rng = random.Random(1)
    for _ in range(2000):
        kept = resample_on_correct(group, lambda t: t, keep=2, rng=rng)
        assert kept is not None
        picks[any(t is clean for t in kept)] += 1
    # weights 1/0.1 vs 1/1.1: the clean trace wins about 92% of the draws
    assert picks[True] / 2000 == pytest.approx(10 / (10 + 1 / 1.1), abs=0.03)


def test_at_least_one_of_each_sign_is_kept() -> None:
    group = [q(1)] + [q(0) for _ in range(7)]
    kept = resample_on_correct(group, lambda t: t, keep=4, rng=random.Random(0))
    assert kept is not None
    assert sum(t.reward for t in kept) == 1 and len(kept) == 4


def test_rejects_groups_that_are_not_oversampled() -> None:
    with pytest.raises(ValueError, match="oversampled"):
        resample_on_correct([q(1), q(0)], lambda t: t, keep=2, rng=random.Random(0))


def test_a_step_that_kept_nothing_reports_no_reward() -> None:
    # Every group answered alike: nothing to learn from, and no reward of 0 on the dashboard.
    assert kept_metrics([]) == {"kept": 0.0}
