"""A sandbox with the installation's token: a worker or dispatcher refuses every call without
it, or with another, as UNAUTHENTICATED, before any code runs; health stays open; a
dispatcher reaches its workers with the token; `kubestar sandbox serve` reads it from a file."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.cli.sandbox import serve_command
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE, AuthConfigError
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.retries import SandboxRetries
from kubestar.sandbox.server import SERVICE_NAME, ServerConfig
from kubestar.training.executors import SandboxStreamExecutor
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ThreadedServer, executor_config, scratch_dir

TOKEN = "kubestar-test-token-0123456789abcdef"
OK = pb.EXECUTION_STATUS_OK


def config(**overrides: object) -> ServerConfig:
    # Auth is checked before a call reaches an executor: unisolated executors suffice.
    executor = dataclasses.replace(executor_config(), isolation=False)
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "executors": 1,
        "executor": executor,
        "auth_token": TOKEN,
        "drain_seconds": 1.0,
    }
    values.update(overrides)
    return ServerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def worker() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(config()).start()
    yield threaded
    threaded.stop()


@pytest.fixture
def marker() -> Iterator[Path]:
    """A file a call would create if it ran."""
    directory = scratch_dir()
    path = directory / "ran"
    yield path
    path.unlink(missing_ok=True)
    directory.rmdir()


def touch(path: Path) -> str:
    return f"open({str(path)!r}, 'w').close()\nprint(6 * 7)"


@pytest.mark.parametrize("token", ["", TOKEN[:-1] + "0", "Bearer"])
def test_a_call_without_the_right_token_is_refused_and_runs_nothing(
    worker: ThreadedServer, marker: Path, token: str
) -> None:
    with SandboxClient(worker.endpoint, timeout=30, token=token) as client:
        for call in (
            lambda: client.execute(touch(marker)),
            lambda: client.execute_batch([touch(marker)]),
            client.capacity,
        ):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            details = error.value.details() or ""  # type: ignore[attr-defined]
            assert ENV_TOKEN_FILE in details and "\n" not in details
    assert not marker.exists()


async def test_a_stream_without_the_token_is_refused(worker: ThreadedServer, marker: Path) -> None:
    client = SandboxClient(worker.endpoint, timeout=30, token="")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.aexecute_stream([touch(marker)])
        # grpc.aio reports INTERNAL instead of the server's status when the refusal arrives
        # while the client is still writing the request: refused either way, nothing ran.
        assert error.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.aexecute(touch(marker))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await client.aclose()
    assert not await asyncio.to_thread(marker.exists)


async def test_calls_with_the_token_are_served(worker: ThreadedServer) -> None:
    with SandboxClient(worker.endpoint, timeout=30, token=TOKEN) as client:
        assert client.execute("print(6 * 7)").stdout == "42\n"
        assert client.capacity().capacity == 1
    client = SandboxClient(worker.endpoint, timeout=30, token=TOKEN)
    try:
        (result,) = await client.aexecute_stream(["print(6 * 7)"])
        assert result.status == OK and result.stdout == "42\n"
    finally:
        await client.aclose()


def test_the_client_takes_the_token_from_the_environment(
    worker: ThreadedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    with SandboxClient(worker.endpoint, timeout=30) as client:
        assert client.execute("print(1)").status == OK
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv(ENV_TOKEN_FILE, str(token_file))  # the file wins over the variable
    monkeypatch.setenv(ENV_TOKEN, "something-else")
    with SandboxClient(worker.endpoint, timeout=30) as client:
        assert client.execute("print(1)").status == OK


def test_health_needs_no_token(worker: ThreadedServer) -> None:
    with grpc.insecure_channel(worker.endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_dispatcher_requires_the_token_and_sends_it_to_its_workers(
    worker: ThreadedServer,
) -> None:
    dispatcher = ThreadedServer(config(workers=[worker.endpoint], queue_timeout=10.0)).start()
    try:
        with SandboxClient(dispatcher.endpoint, timeout=30, token="") as client:
            with pytest.raises(grpc.RpcError) as error:
                client.execute("print(1)")
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with SandboxClient(dispatcher.endpoint, timeout=30, token=TOKEN) as client:
            result = client.execute("print(6 * 7)")
            assert result.status == OK and result.stdout == "42\n"
    finally:
        dispatcher.stop()


def test_a_dispatcher_with_another_token_reaches_no_worker(
    worker: ThreadedServer, caplog: pytest.LogCaptureFixture
) -> None:
    other = "another-installation-token"
    dispatcher = ThreadedServer(
        config(workers=[worker.endpoint], queue_timeout=1.0, auth_token=other)
    ).start()
    try:
        deadline = time.monotonic() + 10
        while "refused the dispatcher's token" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        with SandboxClient(dispatcher.endpoint, timeout=30, token=other) as client:
            result = client.execute("print(1)")
        assert result.status == pb.EXECUTION_STATUS_INTERNAL
        assert "no sandbox worker is reachable" in result.message
    finally:
        dispatcher.stop()
    # Said once, not at every reconnect.
    assert caplog.text.count("refused the dispatcher's token") == 1


def test_serve_refuses_an_unreadable_or_empty_token_file(tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    missing = tmp_path / "absent"
    runner = CliRunner()
    result = runner.invoke(
        serve_command,
        ["--auth-token-file", str(missing), "--termination-log", str(termination)],
    )
    assert isinstance(result.exception, AuthConfigError)
    line = termination.read_text()
    assert line.startswith(f"cannot read the auth token file {missing}") and line.count("\n") == 1
    empty = tmp_path / "empty"
    empty.write_text("\n")
    result = runner.invoke(serve_command, [], env={ENV_TOKEN_FILE: str(empty)})
    assert isinstance(result.exception, AuthConfigError)
    assert f"the auth token file {empty} is empty" in str(result.exception)


async def test_the_trainers_stream_executor_sends_the_token(
    worker: ThreadedServer, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's tool calls travel on SandboxStreamExecutor's long-lived stream: with
    the token (given, or from the environment as in a trainer pod) they run; without it
    they are answered `internal` naming the refusal, and nothing ran."""
    given = SandboxStreamExecutor(worker.endpoint, token=TOKEN, deadline=30)
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    from_environment = SandboxStreamExecutor(worker.endpoint, deadline=30)
    without = SandboxStreamExecutor(
        worker.endpoint, token="", deadline=30, retries=SandboxRetries(attempts=1)
    )
    try:
        for tools in (given, from_environment):
            result = await tools.execute(Call(code="print(6 * 7)"))
            assert (result.status, result.stdout) == (OK, "42\n")
        refused = await without.execute(Call(code=touch(marker)))
        assert refused.status == pb.EXECUTION_STATUS_INTERNAL
        # UNAUTHENTICATED, or INTERNAL when grpc.aio's write races the refusal (see above).
        assert "UNAUTHENTICATED" in refused.message or "INTERNAL" in refused.message
    finally:
        for tools in (given, from_environment, without):
            await tools.close()
    assert not await asyncio.to_thread(marker.exists)
