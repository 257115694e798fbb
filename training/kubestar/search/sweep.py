"""Accuracy against generated tokens: several modes at several budgets on the same problems
and the same services, each (mode, budget) with its accuracy, a 95% bootstrap interval over
the problems, and the tokens the policy generated per problem. What `kubestar eval --search`
prints and plots, and what bench/search_bench.py measures.

A budget b means, per mode:

* `mcts`: b rollouts (each rollout selects, expands and evaluates until it reaches a terminal
  step, as `MCTS.search` does);
* `beam`: b beams (B1 = b), each sampling B2 = `SearchSettings.beam_samples` steps;
* `majority`, `best-of-n`, `ppm-vote`: b chains, and then, when the sweep has a tree search
  to match (mcts, else beam), more chains until the policy has generated as many tokens on
  each problem as that search did on the same problem at budget b. The chain modes are then
  compared with the search at equal generated tokens per problem (they end at most about one
  chain past it: `baselines._waves`); without a tree search in the sweep, b chains;
* `greedy`: one chain whatever b (one point).

Search spends its tokens differently from the baselines (an MCTS expansion samples
`children` steps at once, a chain one step at a time), so only tokens put them on one axis:
each point reports the tokens it actually generated, and the plot draws accuracy against
them. The tree searches run first, so that the chain modes know the tokens to match.

What it costs. MCTS is anytime (`MCTS.grow`): with `anytime` (the default) the sweep runs
one search per problem at the largest rollout budget and reads each smaller budget r off the
tree after r rollouts (`Solver.solve_rollouts`): the answer the search's own vote gives
then, and the tokens and requests spent so far: what a search of r rollouts returns on the
same random stream. Budgets 2,4,8 cost 8 rollouts per problem, not 2 + 4 + 8 = 14. Every
other point solves every problem afresh: beam search cannot be read off a wider one (its
width decides which candidates survive at every depth), and each chain mode's budget sets
how many chains it draws from the start. So the cost is the largest MCTS budget, plus the
sum of the beam budgets, plus the chain modes' points, each matched to the search's tokens.

The runs go one after another on the same `SolverStack`, so that what a `Meter` counts on the
services (e.g. the engines' prefill tokens) between two reads belongs to one run: a point's
own, or for the rollout budgets of one MCTS search, the largest budget's point (the smaller
ones, read off that search, get no counters, and a share of its wall time in proportion to
the time their problems took to reach them).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from kubestar.common.stats import mean_interval
from kubestar.search.adapters import StepSampling
from kubestar.search.solve import (
    BEAM,
    CHAIN_MODES,
    GREEDY,
    MCTS_MODE,
    MODES,
    Solved,
    SolverStack,
    SolveSettings,
)
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem

# The tree searches the chain modes match tokens with, in order of preference.
TREE_MODES = (MCTS_MODE, BEAM)


class Meter(Protocol):
    """Counters of the services, read around each point (e.g. an engine's prompt tokens)."""

    async def reset(self) -> None:
        """Called before each point: e.g. empty the engines' prefix caches, so that a point
        does not find the prompts of the one before cached."""
        ...

    async def read(self) -> dict[str, float]:
        """Cumulative counters by name; a point gets the difference of two reads."""
        ...


@dataclass(frozen=True)
class SweepSettings:
    """The modes and budgets of a sweep and what every point shares (see the module
    docstring for what a budget means per mode)."""

    modes: tuple[str, ...]
    budgets: tuple[int, ...]
    search: SearchSettings = field(default_factory=SearchSettings)
    sampling: StepSampling = field(default_factory=StepSampling)
    match_tokens: bool = True  # chain modes: top up to the tree search's tokens
    concurrency: int = 4  # problems solved at once
    max_context: int = 0  # the engines' context length (0: unknown)
    affinity: bool = True  # a tree's requests share one affinity key
    anytime: bool = True  # mcts: read every budget off one search of the largest per problem

    def __post_init__(self) -> None:
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown:
            raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError("give each mode once, and at least one")
        if not self.budgets or len(set(self.budgets)) != len(self.budgets):
            raise ValueError("give each budget once, and at least one")
        if min(self.budgets) < 1:
            raise ValueError("a budget is at least 1")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    @property
    def reference(self) -> str | None:
        """The tree search whose tokens the chain modes match (None: they draw b chains)."""
        if not self.match_tokens:
            return None
        return next((mode for mode in TREE_MODES if mode in self.modes), None)

    def points(self) -> list[tuple[str, int]]:
        """(mode, budget) in the order they run: tree searches first, greedy once (budget
        0), then the chain modes; budgets ascending within a mode."""
        order = sorted(self.modes, key=lambda mode: (mode not in TREE_MODES, mode != GREEDY))
        budgets = sorted(self.budgets)
        return [(mode, budget) for mode in order for budget in ([0] if mode == GREEDY else budgets)]

    def runs(self) -> list[tuple[str, tuple[int, ...]]]:
        """The points grouped by the searches that make them, in order: mcts's budgets
        together when `anytime` (one search at the largest), every other point alone."""
        runs: list[tuple[str, tuple[int, ...]]] = []
        for mode, budget in self.points():
            if self.anytime and mode == MCTS_MODE and runs and runs[-1][0] == mode:
                runs[-1] = (mode, (*runs[-1][1], budget))
            else:
                runs.append((mode, (budget,)))
        return runs

    def solve_settings(self, mode: str, budget: int, token_budget: int = 0) -> SolveSettings:
        """The settings of one point; `token_budget` for a chain mode matching a search."""
        search, samples = self.search, 1
        if mode == MCTS_MODE:
            search = replace(search, rollouts=budget)
        elif mode == BEAM:
            search = replace(search, beam_width=budget)
        elif mode in CHAIN_MODES:
            samples = budget
        return SolveSettings(
            mode=mode,
            search=search,
            sampling=self.sampling,
            samples=samples,
            token_budget=token_budget if mode in CHAIN_MODES else 0,
            concurrency=self.concurrency,
            max_context=self.max_context,
            affinity=self.affinity,
        )

    def budget_text(self, mode: str, budget: int) -> str:
        """The budget in the mode's own unit, for tables."""
        if mode == MCTS_MODE:
            return f"{budget} rollouts"
        if mode == BEAM:
            return f"{budget}x{self.search.beam_samples} beams"
        if mode == GREEDY:
            return "1 chain"
        reference = self.reference
        return f"{budget} chains" + (f", {reference}'s tokens" if reference else "")


@dataclass
class SweepPoint:
    """One (mode, budget): every problem's outcome, in the problems' order."""

    mode: str
    budget: int  # 0 for greedy
    budget_text: str
    solved: list[Solved]
    seconds: float
    matched: str = ""  # the tree search whose tokens a chain mode matched
    read_from: int = 0  # mcts: the rollouts of the search it was read off (0: its own)
    counters: dict[str, float] = field(default_factory=dict)  # a Meter's differences

    @property
    def correct(self) -> list[float]:
        """1.0 per problem solved, 0.0 otherwise (what the interval resamples)."""
        return [1.0 if outcome.correct else 0.0 for outcome in self.solved]

    @property
    def accuracy(self) -> float:
        return statistics.fmean(self.correct) if self.solved else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        """95% percentile bootstrap interval of the accuracy over the problems."""
        return mean_interval(self.correct)

    @property
    def tokens_per_problem(self) -> float:
        if not self.solved:
            return math.nan
        return statistics.fmean(outcome.generated_tokens for outcome in self.solved)

    def figures(self) -> dict[str, Any]:
        low, high = self.interval
        count = len(self.solved)
        figures: dict[str, Any] = {
            "mode": self.mode,
            "budget": self.budget,
            "budget_text": self.budget_text,
            "problems": count,
            "correct": sum(outcome.correct for outcome in self.solved),
            "accuracy": self.accuracy,
            "accuracy_low": low,
            "accuracy_high": high,
            "generated_tokens_per_problem": self.tokens_per_problem,
            "requests_per_problem": (
                statistics.fmean(outcome.requests for outcome in self.solved) if count else math.nan
            ),
            "seconds": self.seconds,
            "seconds_per_problem": self.seconds / count if count else math.nan,
        }
        if self.mode in CHAIN_MODES:
            figures["chains_per_problem"] = (
                statistics.fmean(len(outcome.root.children) for outcome in self.solved)
                if count
                else math.nan
            )
            figures["matched"] = self.matched
        if self.read_from:
            figures["read_from"] = self.read_from
        if self.counters:
            figures["counters"] = dict(self.counters)
        return figures


# (mode, budget, the outcome of one problem) after each problem.
OnDone = Callable[[str, int, Solved], None]


async def sweep(
    problems: Sequence[Problem],
    settings: SweepSettings,
    stack: SolverStack,
    on_done: OnDone | None = None,
    meter: Meter | None = None,
) -> list[SweepPoint]:
    """Every (mode, budget) of `settings` on every problem, on one stack (see the module
    docstring); the points in the order they ran."""
    reference = settings.reference
    spent: dict[int, dict[str, int]] = {}  # budget -> problem id -> the reference's tokens
    points: list[SweepPoint] = []
    for mode, budgets in settings.runs():
        before: dict[str, float] = {}
        if meter is not None:
            await meter.reset()
            before = await meter.read()
        started = time.monotonic()
        if len(budgets) > 1:
            by_budget = await _solve_rollouts(problems, settings, stack, budgets, on_done)
        else:
            (budget,) = budgets
            tokens: Mapping[str, int] = spent.get(budget, {}) if mode in CHAIN_MODES else {}
            solved = await _solve_point(problems, settings, stack, mode, budget, tokens, on_done)
            by_budget = {budget: solved}
        seconds = time.monotonic() - started
        counters: dict[str, float] = {}
        if meter is not None:
            after = await meter.read()
            counters = {name: after[name] - before.get(name, 0.0) for name in after}
        largest = by_budget[budgets[-1]]
        for budget in budgets:
            solved = by_budget[budget]
            if mode == reference:
                spent[budget] = {o.problem.id: o.generated_tokens for o in solved}
            shared = budget != budgets[-1]
            points.append(
                SweepPoint(
                    mode=mode,
                    budget=budget,
                    budget_text=settings.budget_text(mode, budget),
                    solved=solved,
                    seconds=seconds * _share(solved, largest) if shared else seconds,
                    matched=(reference or "") if mode in CHAIN_MODES else "",
                    counters={} if shared else counters,
                    read_from=budgets[-1] if len(budgets) > 1 else 0,
                )
            )
    return points


def _share(part: Sequence[Solved], whole: Sequence[Solved]) -> float:
    """The share of a run's time a budget read off it took: its problems' seconds to the
    read over their seconds to the end."""
    total = sum(outcome.seconds for outcome in whole)
    return sum(outcome.seconds for outcome in part) / total if total > 0 else 1.0


async def _solve_point(
    problems: Sequence[Problem],
    settings: SweepSettings,
    stack: SolverStack,
    mode: str,
    budget: int,
    token_budgets: Mapping[str, int],
    on_done: OnDone | None,
) -> list[Solved]:
    """One point: each problem with its own token budget (a chain mode matching a search
    gets what the search spent on that problem), `concurrency` problems at once."""
    gate = asyncio.Semaphore(settings.concurrency)

    async def one(problem: Problem) -> Solved:
        solve_settings = settings.solve_settings(mode, budget, token_budgets.get(problem.id, 0))
        async with gate:
            solved = await stack.solver(solve_settings).solve(problem)
        if on_done is not None:
            on_done(mode, budget, solved)
        return solved

    return list(await asyncio.gather(*(one(problem) for problem in problems)))


async def _solve_rollouts(
    problems: Sequence[Problem],
    settings: SweepSettings,
    stack: SolverStack,
    budgets: Sequence[int],
    on_done: OnDone | None,
) -> dict[int, list[Solved]]:
    """MCTS at every rollout budget from one search per problem at the largest
    (`Solver.solve_rollouts`), `concurrency` problems at once; budget -> outcomes in the
    problems' order. `on_done` hears of each budget of a problem when its search ends."""
    gate = asyncio.Semaphore(settings.concurrency)
    solver = stack.solver(settings.solve_settings(MCTS_MODE, max(budgets)))

    async def one(problem: Problem) -> list[Solved]:
        async with gate:
            outcomes = await solver.solve_rollouts(problem, budgets)
        if on_done is not None:
            for budget, solved in zip(budgets, outcomes, strict=True):
                on_done(MCTS_MODE, budget, solved)
        return outcomes

    rows = await asyncio.gather(*(one(problem) for problem in problems))
    return {budget: [row[index] for row in rows] for index, budget in enumerate(budgets)}


def format_table(points: Sequence[SweepPoint]) -> str:
    """The sweep as a table: mode, budget, generated tokens per problem, accuracy with its
    95% interval, and seconds per problem."""
    header = ("mode", "budget", "tokens/problem", "accuracy (95% CI)", "s/problem")
    rows = [header]
    for point in points:
        figures = point.figures()
        rows.append(
            (
                point.mode,
                point.budget_text,
                f"{figures['generated_tokens_per_problem']:.0f}",
                f"{figures['accuracy']:.3f} "
                f"({figures['accuracy_low']:.3f}-{figures['accuracy_high']:.3f})",
                f"{figures['seconds_per_problem']:.1f}",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def plot_sweep(points: Sequence[SweepPoint], path: str | Path, title: str = "") -> bool:
    """Accuracy against generated tokens per problem as a PNG: a line per mode through its
    budgets, each point with its 95% interval as an error bar and its budget written beside
    it (greedy is one point). A log token axis (base 2) when the tokens span 8x or more.
    False when there is no point to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    by_mode: dict[str, list[SweepPoint]] = {}
    for point in points:
        if point.solved:
            by_mode.setdefault(point.mode, []).append(point)
    if not by_mode:
        return False
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for mode, drawn in by_mode.items():
            drawn = sorted(drawn, key=lambda point: point.tokens_per_problem)
            xs = [point.tokens_per_problem for point in drawn]
            ys = [point.accuracy for point in drawn]
            intervals = [point.interval for point in drawn]
            errors = [
                [max(0.0, y - low) for y, (low, _) in zip(ys, intervals, strict=True)],
                [max(0.0, high - y) for y, (_, high) in zip(ys, intervals, strict=True)],
            ]
            axes.errorbar(
                xs,
                ys,
                yerr=errors,
                marker="o",
                markersize=3,
                linewidth=1.5,
                capsize=3,
                label=mode,
            )
            for point, x, y in zip(drawn, xs, ys, strict=True):
                if point.budget:
                    axes.annotate(
                        str(point.budget),
                        xy=(x, y),
                        xytext=(3, 3),
                        textcoords="offset points",
                        fontsize=7,
                        color="grey",
                    )
        tokens = [point.tokens_per_problem for drawn in by_mode.values() for point in drawn]
        if min(tokens) > 0 and max(tokens) >= 8 * min(tokens):
            # Base 2: each doubling of the budget is one step; tokens written out in full.
            axes.set_xscale("log", base=2)
            axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
            axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_ylim(0, 1.05)
        axes.set_title(title or "accuracy against generated tokens (95% intervals)")
        axes.set_xlabel("generated tokens per problem")
        axes.set_ylabel("accuracy")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(path)
        return True
    finally:
        plt.close(figure)
