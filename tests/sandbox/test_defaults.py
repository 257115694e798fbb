"""The production configuration: numpy and sympy pre-imported and warmed up in each executor."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.executor import ExecutorConfig
from kubestar.sandbox.limits import MiB
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ThreadedServer, next_uid_base

pytest.importorskip("numpy")
pytest.importorskip("sympy")


@pytest.fixture(scope="module")
def default_server() -> Iterator[ThreadedServer]:
    config = replace(ExecutorConfig(), uid_base=next_uid_base())  # default preload and warm-up
    threaded = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", executors=1, executor=config)
    ).start()
    yield threaded
    threaded.stop()


@pytest.fixture
def default_client(default_server: ThreadedServer) -> Iterator[SandboxClient]:
    with SandboxClient(default_server.endpoint, timeout=60) as sandbox:
        yield sandbox


def test_preloaded_modules_work(default_client: SandboxClient) -> None:
    code = (
        "import numpy as np, sympy as sp\n"
        "x = sp.symbols('x')\n"
        "print(sp.solve(x**2 - 5*x + 6, x))\n"
        "print(int(np.arange(10).sum()))\n"
    )
    result = default_client.execute(code)
    assert result.status == pb.EXECUTION_STATUS_OK, result
    assert result.stdout == "[2, 3]\n45\n"


def test_memory_limit_is_on_top_of_the_preloaded_modules(default_client: SandboxClient) -> None:
    fits = default_client.execute(
        Call(
            code="import numpy as np\nprint(np.ones(4 * 1024 * 1024).nbytes)", memory_bytes=64 * MiB
        )
    )
    assert (fits.status, fits.stdout) == (pb.EXECUTION_STATUS_OK, f"{32 * MiB}\n"), fits
    too_big = default_client.execute(
        Call(code="import numpy as np\nx = np.ones(32 * 1024 * 1024)", memory_bytes=64 * MiB)
    )
    assert too_big.status == pb.EXECUTION_STATUS_MEMORY, too_big
