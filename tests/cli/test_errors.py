"""Errors a person can act on: each command, given something that is down, taken, missing or
invalid, exits non-zero with one line on stderr naming it, and no traceback unless asked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_parts import REPO
from tests.training.rollout_support import start_sandbox

VALID_HEAD = """\
apiVersion: kubestar.dev/v1alpha1
kind: SandboxPool
metadata: {name: pool}
---
"""


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def refusing_port() -> int:
    """A port nothing listens on (bound, not listening: connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port: int = holder.getsockname()[1]
    return port


def kubestar(
    *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "KUBESTAR_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "kubestar.cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**environment, **(env or {})},
    )


def one_line_error(done: subprocess.CompletedProcess[str], *names: str) -> str:
    """The single stderr line of a failed command; it names each of `names`."""
    assert done.returncode != 0, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kubestar: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def test_an_endpoint_that_refuses(refusing_port: int) -> None:
    endpoint = f"127.0.0.1:{refusing_port}"
    line = one_line_error(
        kubestar("sandbox", "exec", "--endpoint", endpoint, stdin="print(1)"), endpoint
    )
    assert "nothing is serving there" in line
    one_line_error(kubestar("scheduler", "status", "--endpoint", endpoint), endpoint)


def test_debug_shows_the_traceback(refusing_port: int) -> None:
    endpoint = f"127.0.0.1:{refusing_port}"
    for done in (
        kubestar("--debug", "sandbox", "exec", "--endpoint", endpoint, stdin="print(1)"),
        kubestar(
            "sandbox",
            "exec",
            "--endpoint",
            endpoint,
            stdin="print(1)",
            env={"KUBESTAR_DEBUG": "1"},
        ),
    ):
        assert done.returncode != 0
        assert "Traceback (most recent call last)" in done.stderr


def test_rollouts_name_the_service_that_is_down(refusing_port: int) -> None:
    """Checked before any work: a wrong address is one error, not every trajectory failing."""
    down = f"127.0.0.1:{refusing_port}"
    problems = {"rollout": ("-n", "1"), "eval": ("--problems", "basic_arithmetic", "-n", "1")}
    for command, limit in problems.items():
        done = kubestar(command, "--engine", f"http://{down}", "--sandbox", down, *limit)
        one_line_error(done, f"--sandbox {down}", "nothing answers")
    sandbox = start_sandbox(executors=1)
    try:
        for command, limit in problems.items():
            args = ("--engine", f"http://{down}", "--sandbox", sandbox.endpoint, *limit)
            one_line_error(kubestar(command, *args), f"--engine http://{down}")
        args = ("--scheduler", down, "--sandbox", sandbox.endpoint, "-n", "1")
        one_line_error(kubestar("rollout", *args), f"--scheduler {down}")
    finally:
        sandbox.stop()


@pytest.mark.parametrize("service", ["sandbox", "scheduler"])
def test_a_port_already_in_use(service: str, taken_port: int) -> None:
    address = f"127.0.0.1:{taken_port}"
    one_line_error(kubestar(service, "serve", "--listen", address), "--listen", address)
    done = kubestar(
        service,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        str(taken_port),
        "--metrics-address",
        "127.0.0.1",
    )
    one_line_error(done, "--metrics-port", address)


def test_a_missing_model_or_file(tmp_path: Path) -> None:
    missing_model = str(tmp_path / "no-model")
    one_line_error(kubestar("engine", "serve", "--model", missing_model), missing_model)
    one_line_error(kubestar("model", "prepare", missing_model), missing_model)
    missing_file = str(tmp_path / "run.yaml")
    one_line_error(kubestar("train", "-f", missing_file), missing_file)
    missing_code = str(tmp_path / "code.py")
    one_line_error(kubestar("sandbox", "exec", missing_code), missing_code)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("kind: [\n", ["not valid YAML", "line 2"]),
        ("- just\n- a list\n", ["document 1", "not a mapping"]),
        (VALID_HEAD + "kind: Deployment\n", ["document 2", "kind", "Deployment"]),
        (
            VALID_HEAD + "apiVersion: kubestar.dev/v1alpha1\nkind: TrainingRun\n"
            "metadata: {name: run}\nspec:\n  rolloutFleetRef: {name: f}\n"
            "  sandboxPoolRef: {name: pool}\n  stages: [{name: s, steps: 1}]\n"
            "  algorithm: {clipHihg: 0.3}\n",
            ["document 2", "TrainingRun 'run'", "spec.algorithm.clipHihg: unknown field"],
        ),
    ],
    ids=["syntax", "not-a-mapping", "unknown-kind", "unknown-field"],
)
def test_an_invalid_manifest(tmp_path: Path, text: str, names: list[str]) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(text)
    one_line_error(kubestar("train", "-f", str(manifest)), str(manifest), *names)


def test_a_local_run_cannot_mount_a_models_claim(tmp_path: Path) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        "apiVersion: kubestar.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: run}\nspec:\n"
        "  rolloutFleetRef: {name: f}\n  sandboxPoolRef: {name: pool}\n"
        "  model: {pvcClaimName: models, pvcSubPath: Qwen3-14B}\n"
        "  stages: [{name: s, steps: 1, maxResponseTokens: 64, dataset: {generator: gcd}}]\n"
    )
    done = kubestar("train", "-f", str(manifest), "--run-dir", str(tmp_path / "run"))
    one_line_error(done, "spec.model.pvcClaimName", "'models'", "spec.model.path")


def test_a_local_run_refuses_an_autoscaled_fleet(tmp_path: Path) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        "apiVersion: kubestar.dev/v1alpha1\nkind: RolloutFleet\nmetadata: {name: f}\nspec:\n"
        "  autoscaling: {maxReplicas: 4, target: 8}\n---\n"
        "apiVersion: kubestar.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: run}\nspec:\n"
        "  rolloutFleetRef: {name: f}\n  sandboxPoolRef: {name: pool}\n"
        "  stages: [{name: s, steps: 1, maxResponseTokens: 64, dataset: {generator: gcd}}]\n"
    )
    done = kubestar("train", "-f", str(manifest), "--run-dir", str(tmp_path / "run"))
    one_line_error(done, "RolloutFleet f spec.autoscaling", "spec.replicas", "remove it")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
