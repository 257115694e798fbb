"""Real services shared by the training tests that need an engine: one vLLM engine for the
whole session (tests that load weights into it load the model's own), a sandbox per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.common.net import free_port
from kubestar.engine.launch import EngineProcess, EngineSettings

from tests.real_parts import engine_python, tiny_model
from tests.sandbox.support import ThreadedServer
from tests.training.rollout_support import start_sandbox

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def python() -> str:
    return engine_python()


@pytest.fixture(scope="session")
def model(python: str) -> Path:
    return tiny_model()


@pytest.fixture(scope="session")
def engine(
    python: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    settings = EngineSettings(
        model=str(model), port=free_port(), python=python, max_model_len=MAX_MODEL_LEN
    )
    process = EngineProcess(settings, log_path=log)
    try:
        process.start(timeout=600)
    except (RuntimeError, TimeoutError) as exc:
        process.stop()
        raise RuntimeError(f"{exc}\n{log.read_text()[-3000:]}") from exc
    yield process
    process.stop()


@pytest.fixture(scope="module")
def sandbox() -> Iterator[ThreadedServer]:
    server = start_sandbox(executors=2)
    yield server
    server.stop()
