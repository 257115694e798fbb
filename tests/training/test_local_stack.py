"""The local stack's waits: a scheduler that never serves because its engine died after it
was found ready (something else answered the engine's port) fails naming the engine and the
end of its log, not only the scheduler's timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kubestar.engine.launch import EngineProcess, EngineSettings
from kubestar.training.local import LocalStack, ServiceFailed


def test_a_scheduler_that_never_serves_names_the_engine_that_exited(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path)
    engine_log = tmp_path / "engine-0.log"
    engine_log.write_text("OSError: [Errno 98] Address already in use\n")
    engine = EngineProcess(EngineSettings(model="m", port=1), log_path=engine_log)
    engine.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    engine.process.wait()
    stack.engines.append(engine)
    scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ServiceFailed) as failed:
            stack._wait_serving("scheduler", "127.0.0.1:1", scheduler, timeout=0.5)
    finally:
        scheduler.kill()
        scheduler.wait()
    message = str(failed.value)
    assert "scheduler at 127.0.0.1:1 not serving" in message
    assert f"engine 0 exited with 1; see {engine_log}" in message
    assert "Address already in use" in message
