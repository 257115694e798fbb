"""The fleet status's KV capacity and weights, and spec.autoscaling's metric, come from the
rollout scheduler (GetSchedulerStatus): `scheduler_probe` against a real `kubestar scheduler
serve` process (or server) fronting a stand-in engine that answers /health, /metrics and the
weight reload the way vLLM does. The operator only reports the weights; the trainer pushes
them (again after a restart: tests/training/test_resilience.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiohttp import web
from kubestar.api.v1alpha1 import AutoscalingSpec
from kubestar.common.net import free_port
from kubestar.engine.weight_sync import ROUTE
from kubestar.operator.autoscaler import decide, metric_value
from kubestar.operator.main import scheduler_probe
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.server import SchedulerServer, ServerConfig

from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine

METRICS = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="257"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 0.0
"""


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def metrics(_: web.Request) -> web.Response:
    return web.Response(text=METRICS)


async def models(_: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "policy", "max_model_len": 1024}]})


RELOADS: list[str] = []


async def reload(request: web.Request) -> web.Response:
    RELOADS.append((await request.json())["path"])
    return web.json_response({"bytes": 0, "seconds": 0.0})


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    RELOADS.clear()
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post(ROUTE, reload)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_probe_reads_capacity_and_weights(engine: str) -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kubestar.cli.main", "scheduler", "serve",
        "--listen", f"127.0.0.1:{port}", "--engine", f"fleet-engine-abc={engine}",
        "--poll-interval", "0.1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"127.0.0.1:{port}"
    try:
        scheduler = None
        for _ in range(150):
            try:
                scheduler = await scheduler_probe(endpoint, "default")
            except Exception:  # not listening yet
                scheduler = None
            probe = scheduler.engines.get("fleet-engine-abc") if scheduler else None
            if probe and probe.capacity_tokens and not probe.taken_out:
                break
            await asyncio.sleep(0.1)
        assert scheduler is not None
        probe = scheduler.engines["fleet-engine-abc"]
        assert probe.capacity_tokens == 257 * 16
        assert probe.kv_usage == pytest.approx(0.25, abs=0.01)
        assert probe.taken_out == ""
        # Started, it serves the engines' own weights, until a trainer pushes its own.
        assert (scheduler.weights_version, scheduler.weights_path) == (0, "")
        async with SchedulerClient(endpoint, timeout=10) as trainer:
            await trainer.update_weights("/ckpt/weights/v000005", 5, timeout=30.0)
        assert RELOADS == ["/ckpt/weights/v000005"]
        after = await scheduler_probe(endpoint, "default")
        assert after and (after.weights_version, after.weights_path) == (5, RELOADS[0])
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 30)


async def test_turns_queued_on_a_real_scheduler_scale_an_autoscaled_fleet_up() -> None:
    """spec.autoscaling's queuedTurns read as the operator reads it: turns wait for KV room
    behind one engine of a real scheduler's gRPC server, the operator's probe reports them,
    and the autoscaler asks for the engines the HorizontalPodAutoscaler's rule gives."""
    # 17 blocks of 16 tokens: one turn of 64 + 128 tokens (12 blocks) fits at a time.
    engine = await FakeEngine(num_blocks=17, token_delay=0.05).start()
    config = ServerConfig(
        listen=f"127.0.0.1:{free_port()}",
        engines=[("fleet-engine-0", engine.url)],
        scheduler=fast_config(),
    )
    server = SchedulerServer(config)
    await server.start()
    endpoint = config.listen
    spec = AutoscalingSpec(min_replicas=1, max_replicas=4, target=1)
    try:
        async with SchedulerClient(endpoint, timeout=60) as client:
            turns = [
                asyncio.create_task(client.generate(f"t{i}", list(range(64)), 128))
                for i in range(5)
            ]
            probe = None
            for _ in range(200):
                probe = await scheduler_probe(endpoint, "default")
                if probe is not None and probe.queued >= 3:
                    break
                await asyncio.sleep(0.05)
            assert probe is not None and probe.queued >= 3, probe
            value = metric_value(spec, probe, ready=1)
            assert value == probe.queued
            decision = decide(spec, 1, 1, value, None, datetime.now(UTC))
            assert decision.replicas == min(probe.queued, 4) > 1
            assert decision.message.startswith(f"queuedTurns {probe.queued}")
            for turn in turns:
                turn.cancel()
            await asyncio.gather(*turns, return_exceptions=True)
    finally:
        await server.stop(grace_seconds=0)
        await engine.stop()
