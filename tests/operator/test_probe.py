"""The fleet status's KV capacity comes from the rollout scheduler (GetSchedulerStatus):
`scheduler_probe` against a real `kubestar scheduler serve` process fronting a stand-in
engine that answers /health and /metrics the way vLLM does."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubestar.common.net import free_port
from kubestar.operator.main import scheduler_probe

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


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_probe_reads_engine_capacity_from_the_scheduler(engine: str) -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kubestar.cli.main", "scheduler", "serve",
        "--listen", f"127.0.0.1:{port}", "--engine", f"fleet-engine-abc={engine}",
        "--poll-interval", "0.1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        capacities = None
        for _ in range(150):
            try:
                capacities = await scheduler_probe(f"127.0.0.1:{port}")
            except Exception:  # not listening yet
                capacities = None
            probe = (capacities or {}).get("fleet-engine-abc")
            if probe and probe.capacity_tokens and not probe.taken_out:
                break
            await asyncio.sleep(0.1)
        assert capacities is not None
        probe = capacities["fleet-engine-abc"]
        assert probe.capacity_tokens == 257 * 16
        assert probe.kv_usage == pytest.approx(0.25, abs=0.01)
        assert probe.taken_out == ""
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 30)
