"""`kubestar eval --search` end to end on this machine, against a running stack
(`--scheduler`, `--sandbox`; tests/search/conftest.py): it serves a PPM in its own process,
sweeps every mode at two budgets, prints the figures and draws the PNG. The model writes
noise, so the figures are checked for shape and for the budgets' effect on the tokens, not
for accuracy.

Slow; needs a python with vLLM, and torch for the in-process PPM (tests/real_parts.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_parts import require_modules, tiny_model
from tests.training.rollout_support import REPO

pytestmark = pytest.mark.slow

PROBLEMS = [
    {"question": "Calculate 2 + 3.", "answer": "5"},
    {"question": "Calculate 7 * 6.", "answer": "42"},
]


def test_real_engine_sweep_of_every_mode(tmp_path: Path, stack: list[str]) -> None:
    """A plain model folder as the PPM (a fresh head: every score about 0)."""
    require_modules("torch", "transformers", "safetensors", "matplotlib")
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    model = tiny_model()
    png, trees = tmp_path / "search.png", tmp_path / "trees.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kubestar.cli.main", "eval", "--model", str(model), *stack,
         "--problems", str(problems), "--search", "mcts,beam,greedy,majority,best-of-n,ppm-vote",
         "--budgets", "1,2", "--children", "2", "--beam-samples", "2",
         "--ppm", str(model), "--ppm-device", "cpu", "--max-step-tokens", "16",
         "--max-depth", "2", "--plot", str(png), "--output", str(trees), "--json",
         "--no-progress"],
        capture_output=True, text=True, cwd=REPO, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    points = {(p["mode"], p["budget"]): p for p in figures["points"]}
    assert list(points) == [
        ("mcts", 1), ("mcts", 2), ("beam", 1), ("beam", 2), ("greedy", 0),
        ("majority", 1), ("majority", 2), ("best-of-n", 1), ("best-of-n", 2),
        ("ppm-vote", 1), ("ppm-vote", 2),
    ]  # fmt: skip
    # Both mcts budgets come from one search per problem of 2 rollouts.
    assert points[("mcts", 1)]["read_from"] == points[("mcts", 2)]["read_from"] == 2
    assert "read_from" not in points[("beam", 1)]
    for point in points.values():
        assert point["problems"] == 2 and point["generated_tokens_per_problem"] > 0
        assert 0.0 <= point["accuracy_low"] <= point["accuracy"] <= point["accuracy_high"] <= 1.0
    for mode in ("majority", "best-of-n", "ppm-vote"):
        for budget in (1, 2):
            matched = points[(mode, budget)]
            assert matched["matched"] == "mcts"
            # At least MCTS's tokens (each problem is topped up to what MCTS spent on it).
            spent = points[("mcts", budget)]["generated_tokens_per_problem"]
            assert matched["generated_tokens_per_problem"] >= spent
    assert figures["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(line) for line in trees.read_text().splitlines()]
    assert len(lines) == 2 * len(points)
