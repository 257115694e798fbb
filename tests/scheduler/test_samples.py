"""Generate with n samples (how a search draws a node's children): one request to one engine,
n completions, KV reserved for the prompt once and every continuation, and a tree's requests
kept on the engine that holds its prefix. Fake engines (fast); a real engine:
test_n_samples.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from kubestar.scheduler.client import SchedulerClient, completions
from kubestar.scheduler.core import (
    EngineState,
    RequestTooLarge,
    TurnRequest,
    check_fits,
    kv_aware,
    plan_admissions,
)
from kubestar.scheduler.errors import TurnRejected
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.v1 import rollout_pb2 as pb

from tests.scheduler.conftest import MakeScheduler, fast_config, wait_for
from tests.scheduler.fake_engine import FakeEngine

# 20 prompt tokens: one full block of 16 shared by the samples, 4 tokens in each sample's own
# first block.
PROMPT = list(range(1, 21))


def engine(blocks: int = 17) -> EngineState:
    return EngineState("e", healthy=True, probed=True, block_size=16, num_blocks=blocks)


def test_n_samples_need_the_prompt_once_and_every_continuation() -> None:
    one = TurnRequest("tree", 20, 40)
    four = TurnRequest("tree", 20, 40, samples=4)
    state = engine()
    assert state.need(one) == 64  # ceil(60 / 16) blocks
    # The full prompt block once, then 4 x ceil((4 + 40) / 16) blocks.
    assert state.need(four) == 16 + 4 * 48 == 208
    assert four.kv_tokens == 20 + 4 * 40 and four.tokens == 60  # context: one sample's
    # Whole blocks of the prompt are shared: a prompt of exactly two blocks adds none per sample.
    assert state.need(TurnRequest("tree", 32, 16, samples=3)) == 32 + 3 * 16


def test_n_samples_that_no_engine_holds_fail_naming_n() -> None:
    state = engine()  # 256 usable tokens
    check_fits([state], TurnRequest("tree", 20, 40, samples=5))  # 16 + 5 x 48 = 256
    with pytest.raises(RequestTooLarge, match="x 6 samples"):
        check_fits([state], TurnRequest("tree", 20, 40, samples=6))


def test_kv_aware_admits_n_samples_only_where_all_fit() -> None:
    small, large = engine(10), engine(17)
    small.name, large.name = "small", "large"
    four = TurnRequest("tree", 20, 40, samples=4)
    assert kv_aware([small, large], four) is large
    plan = plan_admissions([four, TurnRequest("other", 20, 40, samples=4)], [large], kv_aware, 0)
    assert [request.trajectory_id for request, _ in plan] == ["tree"]
    assert large.reserved_tokens == 208 and large.in_flight == 1


async def test_one_request_returns_n_distinct_completions(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    response = await scheduler.generate("tree", PROMPT, 8, pb.SamplingParams(logprobs=True), n=4)
    samples = list(response.completions)
    assert len(samples) == 4
    assert len({tuple(s.token_ids) for s in samples}) == 4
    assert all(len(s.token_ids) == 8 == len(s.logprobs) for s in samples)
    assert all(s.finish_reason == pb.FINISH_REASON_LENGTH for s in samples)
    # The one-completion fields are the first sample.
    assert list(response.token_ids) == list(samples[0].token_ids)
    assert response.text == samples[0].text
    assert [f.samples for f in fakes if f.samples] == [[4]]  # one request, n = 4
    one = await scheduler.generate("single", PROMPT, 8)
    assert len(one.completions) == 1 and one.completions[0].token_ids == one.token_ids


async def test_n_samples_reserve_kv_for_every_continuation(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    for fake in fakes:
        fake.token_delay = 0.02
    scheduler = await make_scheduler(fakes)
    work = asyncio.ensure_future(scheduler.generate("tree", PROMPT, 40, n=4))
    await wait_for(lambda: any(e.in_flight for e in scheduler.engines()))
    held = next(e for e in scheduler.engines() if e.in_flight)
    assert held.reserved_tokens == 208
    await work
    assert all(e.reserved_tokens == 0 for e in scheduler.engines())


async def test_n_sample_turns_queue_rather_than_make_the_engines_preempt(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    """Each turn of 4 samples needs 208 of an engine's 256 tokens: one at a time per engine.
    Reserving one sample's 64 tokens would let four in at once, and the engine would preempt."""
    scheduler = await make_scheduler(fakes)
    responses = await asyncio.gather(
        *(scheduler.generate(f"tree-{i}", [i + 1, *PROMPT[1:]], 40, n=4) for i in range(6))
    )
    assert all(len(r.completions) == 4 for r in responses)
    assert [f.preemptions for f in fakes] == [0, 0]
    assert all(f.max_running == 1 for f in fakes)


async def test_n_samples_run_whole_not_in_segments(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes, segment_tokens=16)
    response = await scheduler.generate("tree", PROMPT, 40, n=2)
    assert all(len(c.token_ids) == 40 for c in response.completions)
    assert [r for f in fakes for r in f.requests] == [(20, 40)]
    assert scheduler.metrics.registry.get_sample_value("kubestar_scheduler_segments_total") == 0


async def test_a_trees_requests_stay_on_the_engine_holding_its_prefix(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    """The tree's expansions share one affinity key. Its first one lands on e1 (another
    tree holds e0); later ones, sent while both engines are idle, would go to e0 by list order
    but stay on e1, which holds the tree's prefix."""
    scheduler = await make_scheduler(fakes)
    path = list(PROMPT)
    engines = []
    for depth in range(4):
        expansion = scheduler.generate("tree-a", path, 4, n=3)
        other = scheduler.generate(f"tree-b{depth}", [99, *PROMPT], 4, n=3)
        if depth == 0:
            _, response = await asyncio.gather(other, expansion)
        else:
            response, _ = await asyncio.gather(expansion, other)
        engines.append(response.engine)
        path += [*response.completions[depth % 3].token_ids, 7]
    assert engines == ["e1"] * 4
    holder = next(e for e in scheduler.engines() if e.name == engines[0])
    assert "tree-a" in holder.trajectories
    scheduler.end_trajectory("tree-a")
    assert "tree-a" not in holder.trajectories


async def test_n_must_be_positive_and_samples_are_not_streamed(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    with pytest.raises(TurnRejected, match="n must be at least 1"):
        await scheduler.generate("t", PROMPT, 4, n=0)
    with pytest.raises(TurnRejected, match="answered whole"):
        await scheduler.generate("t", PROMPT, 4, n=2, on_segment=lambda *_: None)


async def test_n_over_grpc_and_n_unset_means_one(fakes: list[FakeEngine]) -> None:
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", f.url) for i, f in enumerate(fakes)],
        scheduler=fast_config(),
    )
    server = SchedulerServer(config)
    await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30) as client:
            response = await client.generate("tree", PROMPT, 6, {"temperature": 1.0}, n=3)
            assert len(completions(response)) == 3
            assert len({tuple(c.token_ids) for c in completions(response)}) == 3
            unset = await client.stub.Generate(
                pb.GenerateRequest(trajectory_id="t", prompt_token_ids=PROMPT, max_new_tokens=6)
            )
            assert len(unset.completions) == 1
            with pytest.raises(grpc.aio.AioRpcError) as too_large:
                await client.generate("tree", PROMPT, 40, n=6)
            assert too_large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x 6 samples" in (too_large.value.details() or "")
    finally:
        await server.stop(grace_seconds=2.0)


def test_completions_reads_an_answer_from_before_n_samples() -> None:
    old = pb.GenerateResponse(token_ids=[5, 6], text="ab", stop_reason="b")
    (only,) = completions(old)
    assert (list(only.token_ids), only.text, only.stop_reason) == ([5, 6], "ab", "b")
