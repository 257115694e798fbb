"""`kubestar solve`: every flag mistake is one line naming the flag (nothing is started), and
the command's run against services (here a real scheduler before fake engines and a fake
sandbox over gRPC): accuracy, tokens, trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubestar.search.entrypoints import SolverEndpoints, run_solve
from kubestar.search.scorer import PpmSource
from kubestar.search.solve import GREEDY, MAJORITY, SolveSettings, summary, write_trees
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem

from tests.cli.test_errors import kubestar, one_line_error
from tests.search.service_fakes import FakeSandbox, encode, sandbox_server, scheduler


@pytest.fixture
def problems_file(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"question": "What is 6 * 7?", "answer": "42"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--mode", "beam"], ["--ppm", "beam needs a process preference model"]),
        (["--mode", "best-of-n"], ["--ppm", "--ppm-endpoint"]),
        (["--mode", "ppm-vote"], ["--ppm", "ppm-vote needs a process preference model"]),
        (["--mode", "ppm-vote", "--ppm", ".", "--children", "4"], ["--children", "for mcts"]),
        (["--mode", "mcts"], ["--ppm", "--ground-truth"]),
        (["--mode", "majority", "--ground-truth"], ["--ground-truth", "for mcts"]),
        (["--mode", "mcts", "--ground-truth", "--ppm-endpoint", "x:1"], ["--ground-truth"]),
        (["--mode", "beam", "--ppm", ".", "--ppm-endpoint", "x:1"], ["--ppm", "once"]),
        (["--mode", "mcts", "--ground-truth", "--children", "0"], ["--children"]),
        (["--mode", "greedy", "--max-step-tokens", "0"], ["--max-step-tokens"]),
        (["--mode", "search"], ["--mode", "search"]),
        (["--mode", "greedy", "--model", "/no/such/model"], ["--model", "/no/such/model"]),
        (["--mode", "beam", "--ppm", "/no/such/ppm"], ["--ppm", "/no/such/ppm"]),
        (["--mode", "mcts", "--ground-truth", "--beams", "4"], ["--beams", "for beam"]),
        (["--mode", "greedy", "--samples", "8"], ["--samples", "best-of-n, majority, ppm-vote"]),
        (["--mode", "majority", "--rollouts", "8"], ["--rollouts", "for mcts"]),
        (["--mode", "beam", "--ppm", ".", "--token-budget", "9"], ["--token-budget"]),
    ],
)
def test_flag_mistakes_are_one_line_naming_the_flag(
    flags: list[str], names: list[str], problems_file: Path
) -> None:
    done = kubestar("solve", "--problems", str(problems_file), *flags)
    one_line_error(done, *names)


def test_a_problem_file_that_is_not_there(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    done = kubestar("solve", "--mode", "greedy", "--problems", str(missing))
    one_line_error(done, "--problems", str(missing))


async def test_run_against_the_services_writes_trees(tmp_path: Path) -> None:
    problems = [Problem("p1", "What is 6 * 7?", "42"), Problem("p2", "What is 6 * 7?", "41")]
    sandbox = FakeSandbox()
    async with scheduler() as (client, fakes), sandbox_server(sandbox) as sandbox_address:
        endpoint = client.endpoint
        results = {}
        for mode, samples in ((GREEDY, 1), (MAJORITY, 3)):
            results[mode] = await run_solve(
                problems,
                SolveSettings(mode, search=SearchSettings(), samples=samples),
                SolverEndpoints(endpoint, sandbox_address, encode, "rstar", PpmSource(), 5.0),
                progress=False,
            )
    for mode in (GREEDY, MAJORITY):
        figures = summary(results[mode])
        assert (figures["problems"], figures["correct"]) == (2, 1), mode  # p2's reference is 41
        assert figures["generated_tokens_per_problem"] > 0
    assert all(s.answer == "42" for s in results[MAJORITY])
    assert sandbox.batches  # code ran in the sandbox
    path = write_trees(tmp_path / "trees.jsonl", results[MAJORITY])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["problem"] for line in lines] == ["p1", "p2"]
    assert all(line["mode"] == "majority" and line["nodes"][0]["id"] == "0" for line in lines)
    assert any(body.get("n") == 3 for fake in fakes for body in fake.bodies)
