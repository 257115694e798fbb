"""The fleet status's KV capacity and weights come from the rollout scheduler
(GetSchedulerStatus): `scheduler_probe` against a real `kubestar scheduler serve` process
fronting a stand-in engine that answers /health, /metrics and the weight reload the way vLLM
does. The operator only reports the weights; the trainer pushes them (again after a restart:
tests/training/test_resilience.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubestar.common.net import free_port
from kubestar.engine.weight_sync import ROUTE
from kubestar.operator.main import scheduler_probe
from kubestar.scheduler.client import SchedulerClient

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
