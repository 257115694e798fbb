"""Fixtures of the sandbox tests: real gRPC servers on 127.0.0.1, real executor processes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox.client import SandboxClient
from kubestar.sandbox.server import ServerConfig

from tests.sandbox.support import ThreadedServer, executor_config, scratch_dir


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    """A worker with two executors in this process, shared by the tests of one module."""
    threaded = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", executors=2, executor=executor_config())
    ).start()
    yield threaded
    threaded.stop()


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[SandboxClient]:
    with SandboxClient(server.endpoint, timeout=60) as sandbox:
        yield sandbox


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A world-writable directory on the host that calls can see (outside the private /tmp)."""
    path = scratch_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)
