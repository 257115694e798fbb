"""`kubestar solve` end to end on this machine, against a running stack (`--scheduler`,
`--sandbox`; tests/search/conftest.py). It searches and writes the trees; the model writes
noise, so the figures are checked for shape, not accuracy. (A stack that the command starts
and stops itself: `kubestar evolve`'s, tests/search/test_evolve_real.py.)

Slow; needs a python with vLLM, and torch for the in-process PPM (tests/real_parts.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.real_parts import require_modules, tiny_model
from tests.training.rollout_support import REPO

pytestmark = pytest.mark.slow

PROBLEMS = [
    {"question": "Calculate 2 + 3.", "answer": "5"},
    {"question": "Calculate 7 * 6.", "answer": "42"},
]


def solve(
    tmp_path: Path, stack: list[str], *flags: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    trees = tmp_path / "trees.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kubestar.cli.main", "solve", "--model", str(tiny_model()),
         *stack, "--problems", str(problems), "--max-step-tokens", "24", "--max-depth", "3",
         "--output", str(trees), "--json", "--no-progress", *flags],
        capture_output=True, text=True, cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in trees.read_text().splitlines()]
    return json.loads(done.stdout), lines


def test_real_engine_mcts_with_ground_truth_values(tmp_path: Path, stack: list[str]) -> None:
    figures, trees = solve(
        tmp_path, stack, "--mode", "mcts", "--ground-truth", "--rollouts", "2", "--children", "4"
    )
    assert figures["mode"] == "mcts" and figures["problems"] == 2
    assert isinstance(figures["generated_tokens"], int) and figures["generated_tokens"] > 0
    assert [tree["problem"] for tree in trees] == ["problems-0", "problems-1"]
    for tree in trees:
        nodes = tree["nodes"]
        assert isinstance(nodes, list) and nodes[0]["parent"] is None
        # Each expansion drew at most --children distinct steps.
        for node in nodes:
            children = [n for n in nodes if n["parent"] == node["id"]]
            assert len(children) <= 4
        assert tree["requests"] >= 1


def test_real_engine_beam_search_with_an_in_process_ppm(tmp_path: Path, stack: list[str]) -> None:
    """A plain model folder as the PPM (a fresh head: every score about 0)."""
    require_modules("torch", "transformers", "safetensors")
    figures, trees = solve(
        tmp_path, stack, "--mode", "beam", "--ppm", str(tiny_model()), "--ppm-device", "cpu",
        "--beams", "2", "--beam-samples", "2",
    )  # fmt: skip
    assert figures["mode"] == "beam" and figures["problems"] == 2
    assert len(trees) == 2 and all(tree["mode"] == "beam" for tree in trees)
