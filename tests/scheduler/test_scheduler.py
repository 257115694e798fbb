"""The async scheduler against in-process fake engines (fast; real engines: test_vllm*.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import RequestTooLarge
from kubestar.scheduler.errors import (
    NoEngineAvailable,
    SchedulerDraining,
    TurnRejected,
    UnknownEngine,
)
from kubestar.scheduler.scheduler import Scheduler
from kubestar.v1 import rollout_pb2 as pb

from tests.scheduler.conftest import MakeScheduler, wait_for
from tests.scheduler.fake_engine import FakeEngine

# 20 + 40 tokens: 4 blocks of 16; a fake engine's 16 usable blocks hold four such turns.
PROMPT = list(range(1, 21))
NEW = 40


def prompt(i: int) -> list[int]:
    return [i + 1, *PROMPT[1:]]


async def batch(scheduler: Scheduler, n: int, new: int = NEW) -> list[pb.GenerateResponse]:
    return await asyncio.gather(*(scheduler.generate(f"t{i}", prompt(i), new) for i in range(n)))


def state(scheduler: Scheduler, name: str) -> object:
    return next(e for e in scheduler.engines() if e.name == name)


async def test_kv_aware_queues_instead_of_preempting(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    responses = await batch(scheduler, 24)
    assert all(len(r.token_ids) == NEW for r in responses)
    assert [f.preemptions for f in fakes] == [0, 0]
    assert all(f.max_running <= 4 for f in fakes)
    assert {r.engine for r in responses} == {"e0", "e1"}
    assert any(r.queue_ms > 0 for r in responses)
    queued = scheduler.metrics.registry.get_sample_value("kubestar_scheduler_queued_total")
    assert (queued or 0) >= 16
    status = scheduler.status()
    assert status.policy == pb.SCHEDULING_POLICY_KV_AWARE
    assert status.admitted == 24 and status.queued == 0 and status.retried == 0
    assert all(e.reserved_tokens == 0 and e.in_flight == 0 for e in status.engines)
    assert [e.capacity_tokens for e in status.engines] == [17 * 16, 17 * 16]


async def test_least_requests_sends_everything_and_the_engines_preempt(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes, policy="least-requests")
    responses = await batch(scheduler, 24)
    assert all(len(r.token_ids) == NEW for r in responses)
    assert sum(f.preemptions for f in fakes) > 0
    assert max(f.max_running for f in fakes) >= 12
    assert all(r.queue_ms < 50 for r in responses)


async def test_round_robin_assigns_new_trajectories_in_turn(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes, policy="round-robin")
    engines = [(await scheduler.generate(f"t{i}", PROMPT, 4)).engine for i in range(4)]
    assert engines == ["e0", "e1", "e0", "e1"]
    assert scheduler.status().policy == pb.SCHEDULING_POLICY_ROUND_ROBIN


async def test_turns_of_a_trajectory_stay_on_its_engine(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    context = list(PROMPT)
    engines = []
    for _ in range(3):
        response = await scheduler.generate("traj", context, 8)
        engines.append(response.engine)
        # Other trajectories' turns in between must not pull it away while it has room.
        await scheduler.generate("other", PROMPT, 4)
        context += [*response.token_ids, 5, 6]
    assert len(set(engines)) == 1
    holder = state(scheduler, engines[0])
    assert "traj" in holder.trajectories  # type: ignore[attr-defined]
    scheduler.end_trajectory("traj")
    assert "traj" not in holder.trajectories  # type: ignore[attr-defined]


async def test_a_turn_no_engine_can_hold_fails_at_once(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    with pytest.raises(RequestTooLarge, match="largest engine holds 256 KV tokens"):
        await scheduler.generate("t", PROMPT, 300)
    fakes[0].max_model_len = fakes[1].max_model_len = 100
    other = await make_scheduler(fakes)  # learns the context length from /v1/models
    with pytest.raises(RequestTooLarge, match="context length 100"):
        await other.generate("t", PROMPT, 90)
    with pytest.raises(TurnRejected):
        await scheduler.generate("t", PROMPT, 0)


async def test_an_engine_refusal_is_returned_without_retry(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    fakes[0].max_model_len = fakes[1].max_model_len = 30  # after the scheduler learned 1024
    with pytest.raises(TurnRejected, match="HTTP 400"):
        await scheduler.generate("t", PROMPT, 20)
    assert all(e.healthy for e in scheduler.status().engines)
    assert scheduler.status().retried == 0


async def test_engine_crash_mid_batch_retries_on_the_other(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    for fake in fakes:
        fake.token_delay = 0.01
    work = asyncio.ensure_future(batch(scheduler, 12))
    await wait_for(lambda: len(fakes[0].running) >= 2)
    await fakes[0].crash()
    responses = await work
    assert all(len(r.token_ids) == NEW for r in responses)
    retried = [r for r in responses if r.attempts > 1]
    assert retried and all(r.engine == "e1" for r in retried)
    status = scheduler.status()
    assert not status.engines[0].healthy and status.engines[1].healthy
    assert status.retried == len(retried)
    assert fakes[1].preemptions == 0
    assert status.engines[0].reserved_tokens == 0 and status.engines[0].in_flight == 0


async def test_http_500_takes_the_engine_out_and_retries(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    fakes[0].fail = "500"
    responses = await batch(scheduler, 4)
    assert all(r.engine == "e1" for r in responses)
    assert any(r.attempts == 2 for r in responses)


async def test_clients_get_an_error_only_when_no_engine_is_left(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    for fake in fakes:
        fake.token_delay = 0.01
    work = [asyncio.ensure_future(scheduler.generate(f"t{i}", prompt(i), NEW)) for i in range(12)]
    await wait_for(lambda: all(f.running for f in fakes))
    fakes[0].kill()
    fakes[1].kill()
    results = await asyncio.gather(*work, return_exceptions=True)
    assert all(isinstance(r, NoEngineAvailable) for r in results), results
    with pytest.raises(NoEngineAvailable, match="no healthy engine left"):
        await scheduler.generate("late", PROMPT, 4)
    assert scheduler.status().queued == 0


async def test_a_slow_engine_is_not_taken_out_until_it_stays_silent(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    # Margins are wide so that a loaded machine's event-loop lag cannot flip the outcome.
    scheduler = await make_scheduler(fakes, scrape_timeout=0.05, unresponsive_seconds=4.0)
    fakes[0].metrics_delay = 0.2  # every scrape times out
    await asyncio.sleep(0.6)
    assert scheduler.status().engines[0].healthy  # slow is not dead
    await wait_for(lambda: not scheduler.status().engines[0].healthy, timeout=15)
    fakes[0].metrics_delay = 0.0
    await wait_for(lambda: scheduler.status().engines[0].healthy, timeout=10)
    await fakes[1].crash()  # refused connections: out after a few scrapes, at once
    started = time.monotonic()
    await wait_for(lambda: not scheduler.status().engines[1].healthy, timeout=10)
    assert time.monotonic() - started < 3.0  # well inside the 4 s a silent engine gets


async def test_a_failed_engine_comes_back_with_the_current_weights(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    await scheduler.update_weights("/weights/step-1", 1)
    port = fakes[0].port
    await fakes[0].crash()
    await wait_for(lambda: not scheduler.status().engines[0].healthy)
    fakes[0].weights = "base"  # a restarted engine has its original weights
    await fakes[0].start(port)
    await wait_for(lambda: scheduler.status().engines[0].healthy)
    assert fakes[0].reloads == ["/weights/step-1", "/weights/step-1"]
    responses = await batch(scheduler, 8)
    assert {r.engine for r in responses} == {"e0", "e1"}
    assert {r.weights_version for r in responses} == {1}


async def test_an_engine_whose_reload_hangs_is_taken_out_and_named(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes, weights_reload_timeout=0.5)
    fakes[1].reload_delay = 30.0  # stuck
    answer = await asyncio.wait_for(scheduler.update_weights("/weights/step-1", 1), 10)
    # The step goes on with the engine that loaded the weights.
    assert list(answer.engines) == ["e0"]
    status = scheduler.status()
    assert (status.weights_version, status.weights_path) == (1, "/weights/step-1")
    stuck = status.engines[1]
    assert not stuck.healthy
    assert stuck.error == "loading weights v1 from /weights/step-1 did not finish in 0.5 s"
    assert {r.engine for r in await batch(scheduler, 4)} == {"e0"}
    # Unstuck, it loads the current weights before its first turn and takes turns again.
    fakes[1].reload_delay = 0.0
    await wait_for(lambda: scheduler.status().engines[1].healthy)
    assert scheduler.status().engines[1].error == ""
    assert fakes[1].weights == "/weights/step-1"
    assert {r.weights_version for r in await batch(scheduler, 8)} == {1}


async def test_engines_added_and_removed_at_run_time(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes[:1])
    await scheduler.add_engine("late", fakes[1].url)
    await scheduler.add_engine("late", "http://127.0.0.1:1")  # known name: no-op
    assert [(e.name, e.healthy) for e in scheduler.status().engines] == [
        ("e0", True),
        ("late", True),
    ]
    fakes[0].token_delay = 0.05
    fakes[1].token_delay = 0.05
    work = asyncio.ensure_future(scheduler.generate("t", PROMPT, 20))
    await wait_for(lambda: any(f.running for f in fakes))
    first = "e0" if fakes[0].running else "late"
    await scheduler.remove_engine(first)
    response = await work
    # Its turn moved to the other engine: not a failed attempt.
    assert response.attempts == 1 and response.engine != first
    assert scheduler.status().retried == 0
    moved = scheduler.metrics.registry.get_sample_value("kubestar_scheduler_moved_total")
    assert moved == 1
    assert [e.name for e in scheduler.status().engines] == [n for n in ("e0", "late") if n != first]
    with pytest.raises(UnknownEngine):
        await scheduler.remove_engine(first)


async def test_a_turn_whose_engines_keep_leaving_under_it_runs_out_of_attempts(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    # A scale-down moves a turn for free; a turn that crashes every engine it meets looks the
    # same to discovery, and must not go round the fleet for ever.
    scheduler = await make_scheduler(fakes[:1], max_attempts=2)
    fakes[0].token_delay = 0.2
    work = asyncio.ensure_future(scheduler.generate("t", PROMPT, 40))

    def admitted(engine: str) -> float:
        value = scheduler.metrics.registry.get_sample_value(
            "kubestar_scheduler_admitted_total", {"engine": engine}
        )
        return value or 0.0

    names = ["e0"]
    for _ in range(6):
        await wait_for(lambda: admitted(names[-1]) == 1 or work.done())
        if work.done():
            break
        names.append(f"e{len(names)}")
        await scheduler.add_engine(names[-1], fakes[0].url)
        await scheduler.remove_engine(names[-2])
    assert work.done(), "the turn still runs after 6 removals"
    with pytest.raises(NoEngineAvailable, match="failed on 2 engines; last: engine e3 was removed"):
        await work
    # Two removals moved it for free, the third spent its second attempt, the fourth failed it.
    assert len(names) == 5
    registry = scheduler.metrics.registry
    assert registry.get_sample_value("kubestar_scheduler_moved_total") == 2
    assert scheduler.status().retried == 1
    assert registry.get_sample_value("kubestar_scheduler_failed_total", {"reason": "attempts"}) == 1


async def test_update_weights_waits_for_turns_in_flight_and_holds_new_ones(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    before = await scheduler.generate("t", PROMPT, 8, pb.SamplingParams(temperature=0))
    fakes[0].token_delay = fakes[1].token_delay = 0.01
    running = asyncio.ensure_future(scheduler.generate("long", PROMPT, 60))
    await wait_for(lambda: any(f.running for f in fakes))
    update = asyncio.ensure_future(scheduler.update_weights("/weights/step-7", 7))
    await asyncio.sleep(0.05)
    held = asyncio.ensure_future(scheduler.generate("t", PROMPT, 8, pb.SamplingParams()))
    await asyncio.sleep(0.05)
    assert not update.done() and not held.done()
    assert scheduler.status().queued == 1
    old_turn = await running
    result = await update
    after = await held
    assert result.version == 7 and sorted(result.engines) == ["e0", "e1"]
    assert result.seconds >= 0
    assert old_turn.weights_version == 0 and after.weights_version == 7
    assert after.token_ids != before.token_ids
    assert [f.reloads for f in fakes] == [["/weights/step-7"]] * 2
    assert scheduler.weights_version == 7
    # No version means "the next one"; an explicit one is kept, 0 included (SFT weights).
    assert (await scheduler.update_weights("/weights/step-8")).version == 8
    assert (await scheduler.update_weights("/weights/sft", 0)).version == 0


async def test_weights_pushed_while_every_engine_is_away_reach_them_on_return(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    # Seen on a loaded cluster: the only engine left the endpoints for a moment just as the
    # trainer pushed a step's weights, and the whole run failed on UNAVAILABLE.
    scheduler = await make_scheduler(fakes[:1])
    port = fakes[0].port
    await fakes[0].crash()
    await wait_for(lambda: not scheduler.status().engines[0].healthy)
    answer = await scheduler.update_weights("/weights/step-4", 4)
    assert (answer.version, list(answer.engines)) == (4, [])
    assert scheduler.weights_version == 4
    fakes[0].weights = "base"
    await fakes[0].start(port)
    await wait_for(lambda: scheduler.status().engines[0].healthy)
    assert fakes[0].reloads[-1] == "/weights/step-4"  # before it took a turn
    responses = await batch(scheduler, 4)
    assert {r.weights_version for r in responses} == {4}


async def test_an_engine_added_during_an_update_gets_the_new_weights(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes[:1])
    fakes[0].token_delay = 0.01
    running = asyncio.ensure_future(scheduler.generate("long", PROMPT, 50))
    await wait_for(lambda: bool(fakes[0].running))
    update = asyncio.ensure_future(scheduler.update_weights("/weights/step-2", 2))
    await asyncio.sleep(0.05)
    adding = asyncio.ensure_future(scheduler.add_engine("new", fakes[1].url))
    await running
    await update
    await adding
    await wait_for(lambda: all(e.healthy for e in scheduler.status().engines))
    assert fakes[1].reloads == ["/weights/step-2"]
    responses = await batch(scheduler, 8)
    assert {r.engine for r in responses} == {"e0", "new"}
    assert {r.weights_version for r in responses} == {2}


async def test_update_weights_failing_everywhere_is_an_error(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    with pytest.raises(NoEngineAvailable, match="loading the weights failed"):
        await scheduler.update_weights("/weights/missing", 3)
    assert scheduler.weights_version == 0


async def test_a_big_turn_is_not_starved_by_a_stream_of_small_ones(
    make_scheduler: MakeScheduler,
) -> None:
    async with FakeEngine(token_delay=0.005) as fake:
        scheduler = await make_scheduler([fake], starvation_seconds=0.3)
        stop = asyncio.Event()

        async def small_stream(k: int) -> None:
            i = 0
            while not stop.is_set():
                await scheduler.generate(f"s{k}-{i}", PROMPT[:10], 20)
                i += 1

        streams = [asyncio.ensure_future(small_stream(k)) for k in range(12)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        big = await asyncio.wait_for(scheduler.generate("big", PROMPT, 230), timeout=20)
        waited = time.monotonic() - started
        stop.set()
        await asyncio.gather(*streams)
        assert len(big.token_ids) == 230
        assert big.queue_ms >= 250 and waited < 10
        assert fake.preemptions == 0


async def test_a_starving_turn_holds_one_engine_and_the_other_keeps_admitting(
    make_scheduler: MakeScheduler,
) -> None:
    fakes = [await FakeEngine(token_delay=0.01).start() for _ in range(2)]
    try:
        scheduler = await make_scheduler(fakes, starvation_seconds=0.3)
        stop = asyncio.Event()

        async def small_stream(k: int) -> None:
            i = 0
            while not stop.is_set():
                # 4 blocks each; different lengths, so that turns end at different times.
                await scheduler.generate(f"s{k}-{i}", PROMPT[:10], 24 + 6 * (k % 6))
                i += 1

        admitted: list[tuple[float, int]] = []

        async def watch() -> None:
            while not stop.is_set():
                admitted.append((time.monotonic(), scheduler.admitted_total))
                await asyncio.sleep(0.005)

        streams = [asyncio.ensure_future(small_stream(k)) for k in range(12)]
        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0.2)
        arrived = time.monotonic()
        big = await asyncio.wait_for(scheduler.generate("big", PROMPT, 230), timeout=20)
        stop.set()
        await asyncio.gather(*streams, watcher)
        assert len(big.token_ids) == 230 and [f.preemptions for f in fakes] == [0, 0]
        # While the big turn starved and its engine drained, the other engine took turns.
        held_from, held_to = arrived + 0.3 + 0.02, arrived + big.queue_ms / 1000 - 0.02
        during = [n for t, n in admitted if held_from <= t <= held_to]
        assert held_to > held_from and during and during[-1] > during[0]
    finally:
        for fake in fakes:
            await fake.stop()


async def test_a_cancelled_turn_gives_its_reservation_back(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    fakes[0].token_delay = fakes[1].token_delay = 0.05
    work = asyncio.ensure_future(scheduler.generate("t", PROMPT, 40))
    await wait_for(lambda: any(e.in_flight for e in scheduler.engines()))
    work.cancel()
    with pytest.raises(asyncio.CancelledError):
        await work
    assert all(e.in_flight == 0 and e.reserved_tokens == 0 for e in scheduler.engines())
    await wait_for(lambda: not any(f.running for f in fakes))


async def test_drain_finishes_queued_turns_and_refuses_new_ones(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes)
    work = asyncio.ensure_future(batch(scheduler, 16))
    await wait_for(lambda: scheduler.status().queued > 0)
    await scheduler.drain(10.0)
    assert scheduler.status().queued == 0
    assert all(e.in_flight == 0 for e in scheduler.engines())
    assert len(await asyncio.wait_for(work, 1.0)) == 16
    with pytest.raises(SchedulerDraining):
        await scheduler.generate("late", PROMPT, 4)


async def test_no_engines_at_all() -> None:
    scheduler = Scheduler([], SchedulerConfig())
    await scheduler.start()
    with pytest.raises(NoEngineAvailable, match="no engines are configured"):
        await scheduler.generate("t", PROMPT, 4)
    await scheduler.stop()


async def test_unreachable_engines_at_start() -> None:
    scheduler = Scheduler([("gone", "http://127.0.0.1:1")], SchedulerConfig(scrape_timeout=0.5))
    await scheduler.start()
    with pytest.raises(NoEngineAvailable):
        await scheduler.generate("t", PROMPT, 4)
    await scheduler.stop()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        SchedulerConfig(policy="fastest")


# ---- segments (kv-aware admits a long turn in parts) ------------------------------------


async def test_a_long_turn_runs_in_segments_and_answers_once(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    scheduler = await make_scheduler(fakes[:1], segment_tokens=32)
    response = await scheduler.generate("t0", PROMPT, 100, pb.SamplingParams(logprobs=True))
    assert len(response.token_ids) == 100 and len(response.logprobs) == 100
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    # Each segment continues from the context so far and ends on a block boundary (blocks of
    # 16) within 32 new tokens.
    assert fakes[0].requests == [(20, 28), (48, 32), (80, 32), (112, 8)]
    segments = scheduler.metrics.registry.get_sample_value("kubestar_scheduler_segments_total")
    assert segments == 3
    assert scheduler.status().admitted == 4


async def test_segments_fit_more_turns_without_preemptions(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    # 20 + 200 tokens: 14 of an engine's 16 usable blocks; whole turns run one at a time.
    whole = await make_scheduler(fakes[:1], segment_tokens=0)
    await asyncio.gather(*(whole.generate(f"w{i}", prompt(i), 200) for i in range(4)))
    assert fakes[0].max_running == 1
    fakes[0].max_running = 0
    segmented = await make_scheduler(fakes[1:], segment_tokens=32)
    responses = await asyncio.gather(
        *(segmented.generate(f"s{i}", prompt(i), 200) for i in range(4))
    )
    assert all(len(r.token_ids) == 200 for r in responses)
    assert fakes[1].max_running >= 2
    assert [f.preemptions for f in fakes] == [0, 0]


async def test_a_stop_string_split_between_segments_ends_the_turn(
    make_scheduler: MakeScheduler,
) -> None:
    # The output continues this text from the context's length: the prompt is one token, so
    # the first segment (12 tokens) ends inside "</tool_call>" and vLLM cannot see it whole.
    async with FakeEngine(script="0123456789</tool_call>after") as engine:
        scheduler = await make_scheduler([engine], segment_tokens=12)
        stop = pb.SamplingParams(stop=["</tool_call>"], logprobs=False)
        response = await scheduler.generate("t0", [1], 64, stop)
        assert response.text == "123456789</tool_call>"
        assert response.token_ids == [ord(c) for c in response.text]
        assert response.finish_reason == pb.FINISH_REASON_STOP
        assert response.stop_reason == "</tool_call>"
        assert len(response.logprobs) == 0  # asked for offsets only, not for logprobs
        # A stop wholly inside one segment ends it as the engine says.
        inside = await scheduler.generate("t1", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 64, stop)
        assert inside.text == "</tool_call>" and inside.finish_reason == pb.FINISH_REASON_STOP


async def test_update_weights_lets_a_segmented_turn_finish_on_the_old_weights(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    fakes[0].token_delay = 0.01
    scheduler = await make_scheduler(fakes[:1], segment_tokens=16)
    turn = asyncio.create_task(scheduler.generate("t0", PROMPT, 96))
    await wait_for(lambda: len(fakes[0].requests) >= 2)  # into its second segment
    update = asyncio.create_task(scheduler.update_weights("/weights/v1"))
    response = await turn
    await update
    assert len(response.token_ids) == 96
    assert response.weights_version == 0  # every segment ran before the reload
    assert fakes[0].reloads == ["/weights/v1"]
    assert scheduler.weights_version == 1


async def test_a_segmented_turn_whose_engine_dies_goes_on_elsewhere(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    fakes[0].token_delay = fakes[1].token_delay = 0.01
    scheduler = await make_scheduler(fakes, segment_tokens=16)
    turn = asyncio.create_task(scheduler.generate("t0", PROMPT, 64))
    await wait_for(lambda: len(fakes[0].requests) >= 2)
    await fakes[0].crash()
    response = await turn
    assert len(response.token_ids) == 64
    assert response.engine == "e1" and response.attempts == 2
    # The other engine went on from the tokens the first one had generated.
    assert fakes[1].requests[0][0] > len(PROMPT)


async def test_a_split_stop_string_wins_over_a_later_one_in_the_same_segment(
    make_scheduler: MakeScheduler,
) -> None:
    # The second segment ends on "STOP" (the engine's find), but "</tool_call>" split across
    # the boundary ended first.
    async with FakeEngine(script="0123456789</tool_call>xSTOPafter") as engine:
        scheduler = await make_scheduler([engine], segment_tokens=12)
        stop = pb.SamplingParams(stop=["</tool_call>", "STOP"])
        response = await scheduler.generate("t0", [1], 64, stop)
        assert response.text == "123456789</tool_call>"
        assert response.stop_reason == "</tool_call>"


async def test_an_idle_engine_takes_over_a_segment_from_a_much_slower_one(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    slow, fast = fakes
    slow.token_delay, fast.token_delay = 0.05, 0.002
    scheduler = await make_scheduler(fakes, segment_tokens=32)
    turn = asyncio.create_task(scheduler.generate("t0", PROMPT, 32))  # on e0: the most room
    await wait_for(lambda: len(slow.requests) == 1)
    # Decode rates as the scheduler measures them from finished generations.
    state(scheduler, "e0").decode_rate = 20.0  # type: ignore[attr-defined]
    state(scheduler, "e1").decode_rate = 500.0  # type: ignore[attr-defined]
    # Another turn ends on e1 and leaves it with nothing to do: it takes t0's segment over.
    assert (await scheduler.generate("t1", prompt(1), 4)).engine == "e1"
    response = await turn
    assert response.engine == "e1" and len(response.token_ids) == 32
    assert response.attempts == 1  # a move is not a failure
    moved = scheduler.metrics.registry.get_sample_value("kubestar_scheduler_moved_total")
    assert moved == 1
    await wait_for(lambda: not slow.running)  # the slow engine stopped generating it
    assert response.generate_ms < 1000  # 32 tokens on e0 alone: 1.6 s
