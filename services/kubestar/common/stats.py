"""Confidence intervals over problems: the percentile bootstrap that benchmarks and
evaluations report accuracies with.

An accuracy measured on a few dozen problems moves by several points from one problem set to
the next; the interval says how far. Resampling the problems (not the samples within one)
measures exactly that variation, and resampling the same problems for two policies or modes
gives a paired interval of their difference, far narrower than two separate intervals when
both succeed and fail on the same problems.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

ROUNDS = 2000


def mean(values: Sequence[float]) -> float:
    """The mean, NaN for no values."""
    return math.fsum(values) / len(values) if values else float("nan")


def bootstrap_interval(
    statistic: Callable[[list[int]], float], n: int, rounds: int = ROUNDS, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of `statistic` over resamples of the n problems'
    indices. The resamples depend only on n, rounds and seed, so that a statistic comparing
    several policies sees the same resample for each of them (paired)."""
    if n == 0:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(range(n), k=n)) for _ in range(rounds))
    return values[int(0.025 * rounds)], values[int(0.975 * rounds) - 1]


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """95% bootstrap interval of the mean of per-problem values (1/0 for accuracy)."""
    return bootstrap_interval(lambda rows: mean([values[i] for i in rows]), len(values))


def difference_interval(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """Paired 95% bootstrap interval of mean(values) - mean(baseline), per problem alike."""
    if len(values) != len(baseline):
        raise ValueError(f"{len(values)} values against {len(baseline)} baseline values")
    return bootstrap_interval(
        lambda rows: mean([values[i] - baseline[i] for i in rows]), len(values)
    )


def interval_text(values: Sequence[float]) -> str:
    """`0.450 (0.300-0.600)`: the mean and its 95% interval."""
    low, high = mean_interval(values)
    return f"{mean(values):.3f} ({low:.3f}-{high:.3f})"


def difference_text(values: Sequence[float], baseline: Sequence[float]) -> str:
    """`+0.120 (+0.040 to +0.200; above)`: the difference, its paired interval, and whether
    the interval lies above 0, below it, or around it (within noise)."""
    low, high = difference_interval(values, baseline)
    verdict = "above" if low > 0 else "below" if high < 0 else "within noise"
    return f"{mean(values) - mean(baseline):+.3f} ({low:+.3f} to {high:+.3f}; {verdict})"
