"""Solving problems by each mode on the fake services (a real scheduler before fake engines,
an in-process sandbox): answers, the tokens each mode spent, the token budget of the
baselines, and the trees written as JSONL and read back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from kubestar.search.adapters import SandboxExecutor
from kubestar.search.solve import (
    BEAM,
    BEST_OF_N,
    GREEDY,
    MAJORITY,
    MCTS_MODE,
    PPM_VOTE,
    Solved,
    Solver,
    SolveSettings,
    format_summary,
    summary,
    write_trees,
)
from kubestar.search.steps import RStarFormat
from kubestar.search.tree import Node, SearchSettings, Terminal, tree_from_records
from kubestar.training.datasets import Problem

from tests.search.service_fakes import FakeSandbox, encode, scheduler

PROBLEM = Problem(id="p1", question="What is 6 * 7?", answer="42")


class AnswerScorer:
    """Values a node by the answer it leads to: +1 for 42 (and the steps towards it), -1
    otherwise; `sign` -1 makes it adversarial."""

    def __init__(self, sign: float = 1.0) -> None:
        self.sign = sign

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        def good(node: Node) -> bool:
            if node.terminal is Terminal.ANSWER:
                return node.answer == "42"
            return "print(y)" not in node.text

        return [self.sign * (1.0 if good(node) else -1.0) for node in nodes]


async def judge(answer: str | None, reference: str) -> float:
    return 1.0 if answer == reference else 0.0


async def solve(mode: str, scorer: AnswerScorer | None = None, **settings: object) -> Solved:
    search = SearchSettings(children=3, rollouts=4, beam_width=2, beam_samples=3)
    async with scheduler() as (client, _):
        solver = Solver(
            client,
            SandboxExecutor(FakeSandbox()),
            RStarFormat(),
            encode,
            SolveSettings(mode, search=search, **settings),  # type: ignore[arg-type]
            judge,
            scorer,
        )
        (solved,) = await solver.solve_all([PROBLEM])
    return solved


async def test_greedy_follows_the_first_sample_to_its_answer() -> None:
    solved = await solve(GREEDY)
    assert (solved.answer, solved.correct, solved.requests) == ("42", True, 3)
    steps = [node.text for node in solved.root.walk()][1:]
    assert len(steps) == 3 and solved.generated_tokens == sum(len(t) for t in steps)


async def test_majority_counts_equal_samples_apart() -> None:
    solved = await solve(MAJORITY, samples=3)
    answers = [str(n.answer) for n in solved.root.walk() if n.terminal is Terminal.ANSWER]
    assert sorted(answers) == ["41", "42", "42"]  # two equal chains both vote
    assert (solved.answer, solved.correct) == ("42", True)


async def test_a_token_budget_draws_waves_of_chains_until_it_is_spent() -> None:
    solved = await solve(MAJORITY, samples=1, token_budget=200)
    chains = len(solved.root.children)
    per_chain = solved.generated_tokens / chains  # the chains are alike
    assert chains >= 2 and (chains - 1) * per_chain < 200 <= solved.generated_tokens


async def test_best_of_n_takes_the_scorers_favourite() -> None:
    assert (await solve(BEST_OF_N, AnswerScorer(), samples=3)).answer == "42"
    fooled = await solve(BEST_OF_N, AnswerScorer(sign=-1.0), samples=3)
    assert (fooled.answer, fooled.correct) == ("41", False)


async def test_ppm_vote_weighs_the_chains_by_the_scorer() -> None:
    weighted = await solve(PPM_VOTE, AnswerScorer(), samples=3)
    assert (weighted.answer, weighted.correct) == ("42", True)
    assert sorted(node.value or 0.0 for node in weighted.root.walk() if node.answer) == [-1, 1, 1]
    # Values the two chains to 42 at -1 (weight 0) and the one to 41 at +1 (weight 1).
    fooled = await solve(PPM_VOTE, AnswerScorer(sign=-1.0), samples=3)
    assert (fooled.answer, fooled.correct) == ("41", False)


async def test_mcts_and_beam_find_the_correct_answer() -> None:
    truth = await solve(MCTS_MODE, ground_truth=True)
    assert (truth.answer, truth.correct) == ("42", True)
    assert truth.root.N > 0 and truth.root.children[0].Q > truth.root.children[1].Q
    by_ppm = await solve(MCTS_MODE, AnswerScorer())
    assert by_ppm.correct
    beam = await solve(BEAM, AnswerScorer())
    assert (beam.answer, beam.correct) == ("42", True)


def test_modes_that_need_values_refuse_to_run_without_them() -> None:
    with pytest.raises(ValueError, match="ppm-vote needs a scorer"):
        Solver(object(), FakeSandbox(), RStarFormat(), encode, SolveSettings(PPM_VOTE), judge)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beam needs a scorer"):
        Solver(object(), FakeSandbox(), RStarFormat(), encode, SolveSettings(BEAM), judge)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for mcts"):
        SolveSettings(BEAM, ground_truth=True)
    with pytest.raises(ValueError, match="unknown mode"):
        SolveSettings("sampling")


async def test_trees_are_written_as_jsonl_and_read_back(tmp_path: Path) -> None:
    solved = await solve(MCTS_MODE, ground_truth=True)
    path = write_trees(tmp_path / "trees.jsonl", [solved])
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("problem", "reference", "mode", "answer", "correct")} == {
        "problem": "p1",
        "reference": "42",
        "mode": "mcts",
        "answer": "42",
        "correct": True,
    }
    assert record["generated_tokens"] == solved.generated_tokens
    first = record["nodes"][0]
    assert first["id"] == "0" and first["parent"] is None and first["text"].endswith("code.")
    for node in record["nodes"]:
        assert {"id", "parent", "text", "N", "W", "Q", "terminal", "answer"} <= node.keys()
    root = tree_from_records(record["nodes"])
    original = list(solved.root.walk())
    restored = list(root.walk())
    assert [(n.id, n.N, n.W, n.terminal, n.answer) for n in restored] == [
        (n.id, n.N, n.W, n.terminal, n.answer) for n in original
    ]
    assert [n.token_ids for n in restored] == [n.token_ids for n in original]
    assert Solved.from_record(record, PROBLEM).record() == record
    figures = summary([solved])
    assert (figures["accuracy"], figures["problems"]) == (1.0, 1)
    assert "accuracy              1.000 (1/1 problems)" in format_summary("mcts", figures)


def test_records_that_are_no_tree_are_refused() -> None:
    with pytest.raises(ValueError, match=r"parent '0\.1' comes later"):
        tree_from_records([{"id": "0", "parent": None}, {"id": "0.1.1", "parent": "0.1"}])
    with pytest.raises(ValueError, match="a second root"):
        tree_from_records([{"id": "0", "parent": None}, {"id": "1", "parent": None}])
