"""The gRPC server and client, health, Prometheus metrics, and the `kubestar scheduler` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.cli.scheduler import parse_engine
from kubestar.common.net import free_port
from kubestar.scheduler.client import SchedulerClient, sampling_params
from kubestar.scheduler.server import SERVICE_NAME, SchedulerServer, ServerConfig
from kubestar.v1 import rollout_pb2 as pb

from tests.scheduler.conftest import fast_config, wait_for
from tests.scheduler.engines import REPO
from tests.scheduler.fake_engine import FakeEngine

PROMPT = list(range(1, 21))


@pytest.fixture
async def server(fakes: list[FakeEngine]) -> AsyncIterator[SchedulerServer]:
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", f.url) for i, f in enumerate(fakes)],
        scheduler=fast_config(),
        drain_seconds=5.0,
    )
    started = SchedulerServer(config)
    await started.start()
    yield started
    await started.stop(grace_seconds=2.0)


@pytest.fixture
async def client(server: SchedulerServer) -> AsyncIterator[SchedulerClient]:
    async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30) as scheduler:
        yield scheduler


async def health_status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        status: int = response.status
        return status


async def test_generate_status_and_trajectories_over_grpc(
    client: SchedulerClient, server: SchedulerServer
) -> None:
    first = await client.generate("t", PROMPT, 8, {"temperature": 0.0, "logprobs": True})
    assert len(first.token_ids) == 8 and len(first.logprobs) == 8
    assert first.finish_reason == pb.FINISH_REASON_LENGTH
    assert first.engine in ("e0", "e1") and first.attempts == 1 and first.weights_version == 0
    second = await client.generate("t", [*PROMPT, *first.token_ids], 8)
    assert second.engine == first.engine
    await client.end_trajectory("t")
    status = await client.status()
    assert status.policy == pb.SCHEDULING_POLICY_KV_AWARE
    assert status.admitted == 2 and status.queued == 0
    assert [e.name for e in status.engines] == ["e0", "e1"]
    assert all(e.healthy and e.capacity_tokens == 272 for e in status.engines)
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.SERVING


async def test_error_codes(client: SchedulerClient, fakes: list[FakeEngine]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as too_large:
        await client.generate("t", PROMPT, 1000)
    assert too_large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "largest engine holds" in (too_large.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await client.remove_engine("nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    for fake in fakes:
        await fake.crash()
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.generate("t", PROMPT, 8)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy engine left" in (gone.value.details() or "")


async def test_health_follows_the_engines(
    client: SchedulerClient, server: SchedulerServer, fakes: list[FakeEngine]
) -> None:
    await client.remove_engine("e0")
    await fakes[1].crash()
    await wait_for(lambda: not server.scheduler.status().engines[0].healthy)
    await asyncio.sleep(0.1)
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    await client.add_engine("again", fakes[0].url)
    await asyncio.sleep(0.1)
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.SERVING
    assert [e.name for e in (await client.status()).engines] == ["e1", "again"]


async def test_update_weights_over_grpc(client: SchedulerClient, fakes: list[FakeEngine]) -> None:
    before = await client.generate("t", PROMPT, 8)
    answer = await client.update_weights("/weights/step-3", 3)
    assert answer.version == 3 and sorted(answer.engines) == ["e0", "e1"]
    after = await client.generate("t", PROMPT, 8)
    assert after.weights_version == 3 and after.token_ids != before.token_ids
    assert (await client.status()).weights_version == 3


async def test_prometheus_metrics(client: SchedulerClient, server: SchedulerServer) -> None:
    await asyncio.gather(*(client.generate(f"t{i}", PROMPT, 40) for i in range(12)))
    registry = server.metrics.registry
    value = registry.get_sample_value
    assert value("kubestar_scheduler_completed_total") == 12
    assert (value("kubestar_scheduler_queued_total") or 0) >= 1
    assert value("kubestar_scheduler_turn_seconds_count") == 12
    assert value("kubestar_scheduler_queue_length") == 0
    admitted = [value("kubestar_scheduler_admitted_total", {"engine": e}) for e in ("e0", "e1")]
    assert sum(a or 0 for a in admitted) == 12
    assert value("kubestar_scheduler_engine_capacity_tokens", {"engine": "e0"}) == 272
    assert value("kubestar_scheduler_engine_reserved_tokens", {"engine": "e1"}) == 0
    assert value("kubestar_scheduler_engine_healthy", {"engine": "e1"}) == 1


def test_sampling_params_and_engine_arguments() -> None:
    assert sampling_params(None) == pb.SamplingParams()
    assert sampling_params({"temperature": 0.5, "stop": ["x"]}).stop == ["x"]
    assert parse_engine("e0=http://10.0.0.1:8000") == ("e0", "http://10.0.0.1:8000")
    assert parse_engine("10.0.0.1:8000") == ("10.0.0.1:8000", "http://10.0.0.1:8000")


async def test_cli_serves_reports_and_drains_on_sigterm(fakes: list[FakeEngine]) -> None:
    port, metrics_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    cli = [sys.executable, "-m", "kubestar.cli.main", "scheduler"]
    process = await asyncio.create_subprocess_exec(
        *cli,
        "serve",
        "--listen",
        endpoint,
        "--engine",
        f"a={fakes[0].url}",
        "--engine",
        f"b={fakes[1].url}",
        "--policy",
        "least-requests",
        "--metrics-port",
        str(metrics_port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        env=dict(os.environ),
    )
    try:
        async with SchedulerClient(endpoint, timeout=5) as client:
            for _ in range(200):
                try:
                    if await health_status(port) == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
            turns = [asyncio.ensure_future(client.generate(f"t{i}", PROMPT, 40)) for i in range(6)]
            status = await asyncio.create_subprocess_exec(
                *cli, "status", "--endpoint", endpoint, stdout=asyncio.subprocess.PIPE, cwd=REPO
            )
            out, _ = await status.communicate()
            reported = json.loads(out)
            assert reported["policy"] == "SCHEDULING_POLICY_LEAST_REQUESTS"
            assert [e["name"] for e in reported["engines"]] == ["a", "b"]
            metrics = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
            )
            assert b"kubestar_scheduler_queue_length" in metrics
            process.send_signal(signal.SIGTERM)  # turns in flight still finish
            assert all(len(r.token_ids) == 40 for r in await asyncio.gather(*turns))
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stdout is not None
        log = (await process.stdout.read()).decode()
        assert '"msg": "scheduler serving"' in log and '"msg": "scheduler stopped"' in log
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_rpcs_beyond_the_bound_are_refused_while_one_runs(fakes: list[FakeEngine]) -> None:
    """common.bounds.ServiceBounds holds for the scheduler too: with room for one RPC, a
    status request while a turn generates is refused (RESOURCE_EXHAUSTED), and served after."""
    from kubestar.common.bounds import ServiceBounds

    for fake in fakes:
        fake.paused = True  # the turn below generates until it is let go
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", f.url) for i, f in enumerate(fakes)],
        scheduler=fast_config(),
        bounds=ServiceBounds(max_concurrent_rpcs=1),
    )
    server = SchedulerServer(config)
    await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30) as client:
            turn = asyncio.create_task(client.generate("t", PROMPT, 8))
            await wait_for(lambda: any(fake.running for fake in fakes))  # the turn holds the slot
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.status()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for fake in fakes:
                fake.paused = False
            assert len((await turn).token_ids) == 8
            assert (await client.status()).admitted == 1
    finally:
        await server.stop(grace_seconds=2.0)
