"""The bootstrap intervals over problems: where they lie, that they are reproducible, and that
a paired difference sees what two separate intervals cannot."""

from __future__ import annotations

import math

import pytest
from kubestar.common.stats import (
    bootstrap_interval,
    difference_interval,
    difference_text,
    interval_text,
    mean,
    mean_interval,
)


def test_an_interval_holds_the_mean_and_narrows_with_more_problems() -> None:
    few = [1.0, 0.0] * 10  # 20 problems, half solved
    many = [1.0, 0.0] * 200
    low, high = mean_interval(few)
    assert 0.2 <= low < 0.5 < high <= 0.8
    wide, narrow = high - low, mean_interval(many)[1] - mean_interval(many)[0]
    assert narrow < wide / 3  # about sqrt(20) times narrower
    assert mean_interval(few) == mean_interval(few)  # seeded: the same every time


def test_all_solved_or_none_is_a_point() -> None:
    assert mean_interval([1.0] * 12) == (1.0, 1.0)
    assert interval_text([0.0] * 12) == "0.000 (0.000-0.000)"
    assert all(math.isnan(x) for x in mean_interval([]))
    assert math.isnan(mean([]))


def test_a_paired_difference_is_above_zero_where_separate_intervals_overlap() -> None:
    """B solves what A solves plus 8 more of 40 problems: their own intervals overlap, the
    paired difference lies above 0."""
    a = [1.0] * 16 + [0.0] * 24
    b = [1.0] * 24 + [0.0] * 16
    a_high = mean_interval(a)[1]
    b_low = mean_interval(b)[0]
    assert b_low < a_high  # separately, within each other's noise
    low, high = difference_interval(b, a)
    assert 0 < low <= 0.2 <= high
    assert difference_text(b, a).startswith("+0.200 (") and difference_text(b, a).endswith(
        "; above)"
    )
    assert difference_text(a, b).endswith("; below)")
    assert difference_text(a, a) == "+0.000 (+0.000 to +0.000; within noise)"


def test_the_statistic_sees_resampled_indices() -> None:
    seen: list[list[int]] = []

    def statistic(rows: list[int]) -> float:
        seen.append(rows)
        return float(len(rows))

    assert bootstrap_interval(statistic, 5, rounds=40) == (5.0, 5.0)
    assert len(seen) == 40 and all(len(rows) == 5 and set(rows) <= set(range(5)) for rows in seen)


def test_unequal_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="3 values against 2"):
        difference_interval([1.0, 0.0, 1.0], [1.0, 0.0])
