"""A sweep of modes and budgets on the fake services (a real scheduler before fake engines, an
in-process sandbox): the order the points run in, the chain modes matching the tree search's
tokens problem by problem, intervals, a meter's counters per run, the table and the PNG
(tests/search/test_sweep_anytime.py: the rollout budgets read off one search)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from kubestar.search.adapters import SandboxExecutor
from kubestar.search.solve import SolverStack
from kubestar.search.steps import RStarFormat
from kubestar.search.sweep import SweepPoint, SweepSettings, format_table, plot_sweep, sweep
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem

from tests.scheduler.fake_engine import FakeEngine
from tests.search.service_fakes import QUESTION, FakeSandbox, encode, scheduler
from tests.search.test_solve import AnswerScorer, judge

# The same question twice; the second's reference is wrong on purpose (41), so that no
# mode can solve it.
PROBLEMS = [Problem("p1", QUESTION, "42"), Problem("p2", QUESTION, "41")]
SEARCH = SearchSettings(children=3, beam_samples=3)


@asynccontextmanager
async def stack() -> AsyncIterator[tuple[SolverStack, list[FakeEngine]]]:
    async with scheduler() as (client, fakes):
        yield (
            SolverStack(
                client, SandboxExecutor(FakeSandbox()), RStarFormat(), encode, judge, AnswerScorer()
            ),
            fakes,
        )


class RequestMeter:
    """Counts the requests the fake engines answered; records when it was reset."""

    def __init__(self, fakes: list[FakeEngine]) -> None:
        self.fakes = fakes
        self.resets = 0

    async def reset(self) -> None:
        self.resets += 1

    async def read(self) -> dict[str, float]:
        return {"engine_requests": float(sum(len(fake.bodies) for fake in self.fakes))}


async def test_chain_modes_spend_what_mcts_spent_on_each_problem() -> None:
    settings = SweepSettings(
        modes=("majority", "mcts", "ppm-vote", "greedy"), budgets=(2, 1), search=SEARCH
    )
    done: list[tuple[str, int, str]] = []
    async with stack() as (solver_stack, fakes):
        meter = RequestMeter(fakes)
        points = await sweep(
            PROBLEMS,
            settings,
            solver_stack,
            on_done=lambda mode, budget, solved: done.append((mode, budget, solved.problem.id)),
            meter=meter,
        )
    order = [(p.mode, p.budget) for p in points]
    assert order == [
        ("mcts", 1),
        ("mcts", 2),
        ("greedy", 0),
        ("majority", 1),
        ("majority", 2),
        ("ppm-vote", 1),
        ("ppm-vote", 2),
    ]
    assert sorted(done) == sorted((m, b, p.id) for m, b in order for p in PROBLEMS)
    # One search per problem makes both mcts points (read off it at 1 and 2 rollouts).
    assert settings.runs()[0] == ("mcts", (1, 2))
    assert meter.resets == len(points) - 1 == len(settings.runs())
    # Every engine request is counted once, by the point that sent it: the search's by its
    # largest budget.
    total = sum(len(fake.bodies) for fake in fakes)
    assert sum(point.counters.get("engine_requests", 0) for point in points) == total
    mcts = {p.budget: p for p in points if p.mode == "mcts"}
    assert mcts[1].counters == {} and (mcts[1].read_from, mcts[2].read_from) == (2, 2)
    for point in points:
        assert [s.problem.id for s in point.solved] == ["p1", "p2"]
        # The scheduler may split a request (segments), never merge two.
        sent = point.counters.get("engine_requests", mcts[2].counters["engine_requests"])
        assert sent >= sum(s.requests for s in point.solved) > 0
        if point.mode in ("majority", "ppm-vote"):
            assert point.matched == "mcts"
            assert point.figures()["chains_per_problem"] >= point.budget
            for solved, searched in zip(point.solved, mcts[point.budget].solved, strict=True):
                assert solved.generated_tokens >= searched.generated_tokens
    rollouts = [len(p.solved[0].root.children) for p in mcts.values()]
    assert all(count >= 1 for count in rollouts)
    for point in points:
        # p2's reference is wrong: no mode solves it; every mode answers p1 with 42.
        assert [s.correct for s in point.solved] == [True, False], point.mode
        assert point.accuracy == 0.5
        low, high = point.interval
        assert 0.0 <= low <= 0.5 <= high <= 1.0
    greedy = next(p for p in points if p.mode == "greedy")
    assert greedy.budget_text == "1 chain" and greedy.solved[0].requests == 3


async def test_without_token_matching_chain_modes_draw_budget_chains() -> None:
    settings = SweepSettings(
        modes=("mcts", "majority"), budgets=(3,), search=SEARCH, match_tokens=False
    )
    async with stack() as (solver_stack, _):
        points = await sweep(PROBLEMS[:1], settings, solver_stack)
    majority = points[1]
    assert (majority.mode, majority.matched) == ("majority", "")
    assert len(majority.solved[0].root.children) == 3
    assert majority.budget_text == "3 chains"
    assert settings.budget_text("mcts", 3) == "3 rollouts"
    assert settings.budget_text("beam", 3) == "3x3 beams"


async def test_beam_budget_is_the_number_of_beams() -> None:
    settings = SweepSettings(modes=("beam", "best-of-n"), budgets=(1, 2), search=SEARCH)
    assert settings.reference == "beam"
    assert settings.solve_settings("beam", 2).search.beam_width == 2
    assert settings.solve_settings("beam", 2).search.beam_samples == 3
    assert settings.solve_settings("best-of-n", 2, token_budget=900).token_budget == 900
    assert settings.solve_settings("mcts", 5).search.rollouts == 5
    async with stack() as (solver_stack, _):
        points = await sweep(PROBLEMS[:1], settings, solver_stack)
    assert [(p.mode, p.budget, p.matched) for p in points] == [
        ("beam", 1, ""),
        ("beam", 2, ""),
        ("best-of-n", 1, "beam"),
        ("best-of-n", 2, "beam"),
    ]
    assert all(p.solved[0].correct for p in points)


def test_table_and_plot(tmp_path: Path) -> None:
    from kubestar.search.solve import Solved
    from kubestar.search.tree import Node

    def point(mode: str, budget: int, tokens: int, correct: list[bool]) -> SweepPoint:
        solved = [
            Solved(Problem(f"p{i}", "q", "1"), mode, "1", ok, tokens, 1, 1.0, Node.root())
            for i, ok in enumerate(correct)
        ]
        return SweepPoint(mode, budget, f"{budget}", solved, seconds=2.0 * len(solved))

    points = [
        point("mcts", 2, 300, [True, False, True, True]),
        point("mcts", 4, 650, [True, True, True, True]),
        point("majority", 2, 320, [True, False, False, True]),
        point("greedy", 0, 60, [False, False, True, False]),
    ]
    table = format_table(points).splitlines()
    assert table[0].split() == [
        "mode",
        "budget",
        "tokens/problem",
        "accuracy",
        "(95%",
        "CI)",
        "s/problem",
    ]
    assert table[1].split()[:4] == ["mcts", "2", "300", "0.750"]
    assert table[2].split()[:5] == ["mcts", "4", "650", "1.000", "(1.000-1.000)"]
    assert table[4].split()[-1] == "2.0"
    png = tmp_path / "sweep.png"
    assert plot_sweep(points, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not plot_sweep([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize(
    ("modes", "budgets", "message"),
    [
        (("mcts", "search"), (2,), "unknown mode 'search'"),
        (("mcts", "mcts"), (2,), "each mode once"),
        ((), (2,), "each mode once"),
        (("mcts",), (2, 2), "each budget once"),
        (("mcts",), (0, 2), "at least 1"),
    ],
)
def test_settings_refuse_what_makes_no_sweep(
    modes: tuple[str, ...], budgets: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SweepSettings(modes=modes, budgets=budgets)
