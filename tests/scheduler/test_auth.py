"""The scheduler with the installation's token: every RPC (the control ones first among them)
refuses a caller without it, or with another, as UNAUTHENTICATED; health stays open; the
scheduler sends the token to engines that require it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.server import SERVICE_NAME, SchedulerServer, ServerConfig

from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine

TOKEN = "kubestar-test-token-0123456789abcdef"
PROMPT = list(range(1, 21))

Call = Callable[[SchedulerClient], Awaitable[Any]]
CONTROL: dict[str, Call] = {
    "AddEngine": lambda c: c.add_engine("extra", "http://127.0.0.1:9"),
    "RemoveEngine": lambda c: c.remove_engine("e0"),
    "UpdateWeights": lambda c: c.update_weights("/weights/step-1"),
}
OTHERS: dict[str, Call] = {
    "Generate": lambda c: c.generate("t", PROMPT, 4),
    "GetSchedulerStatus": lambda c: c.status(),
    "EndTrajectory": lambda c: c.end_trajectory("t"),
}


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Two fake engines that, like kubestar's engines, require the token."""
    started = [await FakeEngine(token=TOKEN).start(), await FakeEngine(token=TOKEN).start()]
    yield started
    for engine in started:
        await engine.stop()


@pytest.fixture
async def server(engines: list[FakeEngine]) -> AsyncIterator[SchedulerServer]:
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", e.url) for i, e in enumerate(engines)],
        scheduler=fast_config(engine_token=TOKEN),
        drain_seconds=2.0,
        auth_token=TOKEN,
    )
    started = SchedulerServer(config)
    await started.start()
    yield started
    await started.stop(grace_seconds=2.0)


async def refused(server: SchedulerServer, token: str, call: Call) -> grpc.aio.AioRpcError:
    async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=10, token=token) as client:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(client)
    return error.value


@pytest.mark.parametrize("name", [*CONTROL, *OTHERS])
async def test_a_call_without_the_token_is_refused(server: SchedulerServer, name: str) -> None:
    call = {**CONTROL, **OTHERS}[name]
    error = await refused(server, "", call)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    details = error.details() or ""
    assert ENV_TOKEN_FILE in details and ENV_TOKEN in details and "\n" not in details


@pytest.mark.parametrize("name", list(CONTROL))
async def test_a_control_call_with_another_token_is_refused(
    server: SchedulerServer, engines: list[FakeEngine], name: str
) -> None:
    error = await refused(server, TOKEN[:-1] + "0", CONTROL[name])
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not this server's" in (error.details() or "")
    # Nothing happened: both engines are still there, no weights were loaded.
    async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=10, token=TOKEN) as client:
        status = await client.status()
    assert sorted(e.name for e in status.engines) == ["e0", "e1"]
    assert all(not engine.reloads for engine in engines)


async def test_control_calls_with_the_token_are_served(
    server: SchedulerServer, engines: list[FakeEngine]
) -> None:
    async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30, token=TOKEN) as client:
        # The scheduler reaches its engines with the token: turns and weight pushes work.
        response = await client.generate("t", PROMPT, 4)
        assert len(response.token_ids) == 4
        update = await client.update_weights("/weights/step-1")
        assert update.version == 1
        assert all(engine.reloads == ["/weights/step-1"] for engine in engines)
        await client.remove_engine("e1")
        await client.add_engine("e1", engines[1].url)
        status = await client.status()
    assert sorted(e.name for e in status.engines) == ["e0", "e1"]
    assert all(engine.refused == 0 for engine in engines)


async def test_the_client_takes_the_token_from_the_environment(
    server: SchedulerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv(ENV_TOKEN_FILE, str(token_file))
    async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        status = await client.status()
    assert len(status.engines) == 2


async def test_health_needs_no_token(server: SchedulerServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_without_a_token_the_scheduler_serves_anyone(engines: list[FakeEngine]) -> None:
    for engine in engines:
        engine.token = ""
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", e.url) for i, e in enumerate(engines)],
        scheduler=fast_config(),
    )
    server = SchedulerServer(config)
    await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=10, token="") as client:
            await client.update_weights("/weights/step-1")
            assert len((await client.status()).engines) == 2
    finally:
        await server.stop(grace_seconds=1.0)


async def test_a_refused_request_is_not_parsed(server: SchedulerServer) -> None:
    """Bytes that are no UpdateWeightsRequest, sent without the token: refused as
    UNAUTHENTICATED, not as a request that failed to parse (the refusal comes first)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/UpdateWeights",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(b"\xff\xff\xff not a protobuf message", timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
