"""`kubestar eval --search`: every flag that does not apply is refused in one line naming it
(nothing is started), and the sweep's run against services (a real scheduler before fake
engines, a fake sandbox over gRPC): points, figures, trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubestar.search.entrypoints import SolverEndpoints, run_search_sweep, write_sweep_trees
from kubestar.search.scorer import PpmSource
from kubestar.search.sweep import SweepSettings, format_table
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem

from tests.cli.test_errors import kubestar, one_line_error
from tests.search.service_fakes import QUESTION, FakeSandbox, encode, sandbox_server, scheduler


@pytest.fixture
def problems_file(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"question": "What is 6 * 7?", "answer": "42"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--search", "mcts,majority"], ["--ppm", "mcts needs a process preference model"]),
        (["--search", "beam,ppm-vote"], ["--ppm", "beam, ppm-vote need"]),
        (["--search", "majority", "--children", "4"], ["--children", "for mcts"]),
        (["--search", "majority", "--ppm", "."], ["--ppm", "no mode of --search uses it"]),
        (["--search", "mcts", "--ppm", ".", "--beam-samples", "2"], ["--beam-samples", "beam"]),
        (["--search", "greedy", "--budgets", "2"], ["--budgets", "greedy"]),
        (["--search", "majority", "--max-turns", "3"], ["--max-turns", "agent loop"]),
        (["--search", "majority", "-g", "4"], ["--samples", "agent loop"]),
        (["--search", "majority", "--engine", "http://x:1"], ["--engine", "agent loop"]),
        (["--children", "4"], ["--children", "for --search"]),
        (["--plot", "x.png"], ["--plot", "for --search"]),
        (["--budgets", "2,4"], ["--budgets", "for --search"]),
        (["--search", "sampling"], ["--search", "unknown mode 'sampling'"]),
        (["--search", "majority,majority"], ["--search", "once"]),
        (["--search", ","], ["--search", "no mode"]),
        (["--search", "majority", "--budgets", "2,x"], ["--budgets", "2,x"]),
        (["--search", "majority", "--budgets", "0,2"], ["--budgets", "at least 1"]),
        (["--search", "beam", "--ppm", ".", "--ppm-endpoint", "x:1"], ["--ppm", "once"]),
        (["--search", "majority"], ["--search needs --model"]),
    ],
)
def test_flag_mistakes_are_one_line_naming_the_flag(
    flags: list[str], names: list[str], problems_file: Path
) -> None:
    done = kubestar("eval", "--problems", str(problems_file), *flags)
    one_line_error(done, *names)


async def test_sweep_against_the_services_writes_points_and_trees(tmp_path: Path) -> None:
    problems = [Problem("p1", QUESTION, "42"), Problem("p2", QUESTION, "41")]
    settings = SweepSettings(
        modes=("greedy", "majority"), budgets=(1, 3), search=SearchSettings(), concurrency=2
    )
    sandbox = FakeSandbox()
    async with scheduler() as (client, fakes), sandbox_server(sandbox) as sandbox_address:
        where = SolverEndpoints(
            client.endpoint, sandbox_address, encode, "rstar", PpmSource(), tool_timeout=5.0
        )
        points = await run_search_sweep(problems, settings, where, progress=False)
    assert [(p.mode, p.budget) for p in points] == [("greedy", 0), ("majority", 1), ("majority", 3)]
    for point in points:
        figures = point.figures()
        assert (figures["problems"], figures["correct"]) == (2, 1)  # p2's reference is 41
        assert figures["generated_tokens_per_problem"] > 0
    # No tree search to match: majority draws b solutions.
    assert [p.figures()["chains_per_problem"] for p in points[1:]] == [1, 3]
    assert points[2].tokens_per_problem > points[1].tokens_per_problem
    assert sandbox.batches
    assert any(body.get("n") == 3 for fake in fakes for body in fake.bodies)
    table = format_table(points)
    assert "majority  3 chains" in table
    path = write_sweep_trees(tmp_path / "trees.jsonl", points)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["mode"], line["budget"], line["problem"]) for line in lines] == [
        ("greedy", 0, "p1"),
        ("greedy", 0, "p2"),
        ("majority", 1, "p1"),
        ("majority", 1, "p2"),
        ("majority", 3, "p1"),
        ("majority", 3, "p2"),
    ]
    assert all(line["nodes"][0]["id"] == "0" for line in lines)
