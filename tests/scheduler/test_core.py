"""The pure core: /metrics parsing on recorded vLLM texts, policies on constructed states."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubestar.scheduler.core import (
    POLICIES,
    EngineSample,
    EngineState,
    RequestTooLarge,
    RunningSegment,
    TurnRequest,
    apply_sample,
    check_fits,
    find_split_stop,
    kv_aware,
    least_requests,
    parse_vllm_metrics,
    plan_admissions,
    record_decode,
    release,
    reserve,
    round_robin,
    segment_new_tokens,
    segment_to_move,
    soonest_fit,
    tokens_through,
)

DATA = Path(__file__).parent / "data"


def recorded(name: str) -> EngineSample:
    return parse_vllm_metrics((DATA / f"vllm-cpu-{name}.prom").read_text())


def engine(name: str, sample: EngineSample | None = None, **fields: object) -> EngineState:
    state = EngineState(name=name, healthy=True, probed=True)
    apply_sample(state, sample or recorded("idle"))
    for key, value in fields.items():
        setattr(state, key, value)
    return state


def turn(prompt: int = 100, new: int = 300, trajectory: str = "", seq: int = 0) -> TurnRequest:
    return TurnRequest(trajectory, prompt, new, seq=seq)


# ---- parsing -----------------------------------------------------------------------------


def test_parses_capacity_and_idle_gauges() -> None:
    idle = recorded("idle")
    assert (idle.block_size, idle.num_blocks) == (128, 16)
    assert (idle.kv_usage, idle.running, idle.waiting, idle.preemptions) == (0.0, 0, 0, 0)
    state = engine("e", idle)
    assert state.capacity_tokens == 2048  # what vLLM calls kv_cache_size_tokens
    assert state.usable_tokens == 15 * 128  # less the null block
    assert state.free_tokens == 1920


def test_parses_an_overloaded_engine() -> None:
    busy = recorded("busy")
    assert busy.running > 0 and busy.waiting > 0 and busy.preemptions > 0
    assert 0.5 < busy.kv_usage <= 1.0
    state = engine("e", busy)
    assert state.observed_used_tokens == round(busy.kv_usage * 1920)
    after = recorded("after")
    assert after.preemptions >= busy.preemptions and after.running == 0


def test_parse_ignores_everything_else_and_rejects_non_vllm_text() -> None:
    text = (DATA / "vllm-cpu-idle.prom").read_text()
    noisy = "# a comment\nprocess_cpu_seconds_total 3.0\n" + text + "\nvllm:unknown_x 1\n"
    assert parse_vllm_metrics(noisy) == recorded("idle")
    with pytest.raises(ValueError, match="cache_config_info"):
        parse_vllm_metrics("process_cpu_seconds_total 3.0\n")


def test_parse_sums_data_parallel_engine_cores() -> None:
    text = "\n".join(
        [
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0',
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="51"} 1.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 1.0',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
        ]
    )
    sample = parse_vllm_metrics(text)
    assert (sample.num_blocks, sample.max_core_blocks) == (152, 101)
    assert sample.kv_usage == pytest.approx((0.5 * 100 + 1.0 * 50) / 150)
    assert (sample.running, sample.waiting, sample.preemptions) == (5, 4, 7)
    state = engine("dp", sample)
    assert state.largest_request_tokens() == 100 * 16  # one turn lives on one core


def test_parse_falls_back_to_kv_cache_size_tokens() -> None:
    text = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="1600"} 1.0\n'
    assert parse_vllm_metrics(text).num_blocks == 100


# ---- kv-aware ------------------------------------------------------------------------------


def test_kv_aware_picks_the_most_free_and_rounds_to_blocks() -> None:
    a = engine("a", reserved_tokens=512)
    b = engine("b", recorded("busy"))  # observed use counts even without reservations
    c = engine("c")
    assert kv_aware([a, b, c], turn()) is c
    assert c.need(turn(100, 300)) == 512  # 400 tokens -> 4 blocks of 128
    assert c.need(turn(1, 127)) == 128


def test_kv_aware_queues_rather_than_overload() -> None:
    a, b = engine("a"), engine("b")
    admitted = []
    for i in range(7):
        chosen = kv_aware([a, b], turn(seq=i))
        if chosen is not None:
            reserve(chosen, turn(seq=i))
        admitted.append(chosen)
    # 1920 usable tokens hold three turns of 512 per engine; the seventh waits.
    assert [e.name if e else None for e in admitted] == ["a", "b", "a", "b", "a", "b", None]
    assert a.reserved_tokens == b.reserved_tokens == 1536
    assert a.free_tokens == 384 < 512


def test_kv_aware_counts_load_it_did_not_send() -> None:
    busy = engine("busy", recorded("busy"))
    assert busy.reserved_tokens == 0 and busy.free_tokens < 512
    assert kv_aware([busy], turn()) is None


def test_metrics_lag_after_admission_is_covered_by_reservations() -> None:
    e = engine("e")
    reserve(e, turn())
    # The next scrape happened before the engine saw the turn: usage still 0.
    apply_sample(e, recorded("idle"))
    assert e.used_tokens == 512 and e.free_tokens == 1920 - 512


def test_metrics_lag_after_completion_is_discounted_until_the_next_scrape() -> None:
    e = engine("e", EngineSample(128, 16, kv_usage=12 / 15, running=3, waiting=0, preemptions=0))
    reservations = [reserve(e, turn(100, 300, seq=i)) for i in range(3)]
    assert e.used_tokens == 12 * 128 and e.free_tokens == 3 * 128
    # One turn finishes (400 tokens: 4 blocks); the last scrape still shows its blocks.
    release(e, reservations[0], used_tokens=400)
    assert e.observed_used_tokens == 8 * 128
    assert e.free_tokens == 1920 - 1024
    # A scrape that began before the release may still show it ...
    apply_sample(
        e, EngineSample(128, 16, 12 / 15, 3, 0, 0), released_during_scrape=e.released_since_sample
    )
    assert e.observed_used_tokens == 8 * 128
    # ... one that began after does not, and the discount goes.
    apply_sample(e, EngineSample(128, 16, 8 / 15, 2, 0, 0), released_during_scrape=0)
    assert e.released_since_sample == 0 and e.observed_used_tokens == 8 * 128


def test_kv_aware_keeps_a_trajectory_on_its_engine_while_it_has_room() -> None:
    a, b = engine("a", reserved_tokens=1024), engine("b")
    a.trajectories.add("t1")
    assert kv_aware([a, b], turn(trajectory="t1")) is a  # b has more room; a has the prefix
    assert kv_aware([a, b], turn(trajectory="t2")) is b
    a.reserved_tokens = 1536  # no room left for 512 more: move rather than wait
    assert kv_aware([a, b], turn(trajectory="t1")) is b


def test_kv_aware_leaves_the_prefix_for_a_much_less_crowded_engine() -> None:
    # The end of a batch, or a slow engine: three turns still run on a, none on b.
    a = engine("a", reserved_tokens=1024, in_flight=3)
    b = engine("b")
    a.trajectories.add("t1")
    assert kv_aware([a, b], turn(trajectory="t1")) is b
    # Two against one is no reason to give up the prefix (nor 8 against 6, or 100 against 80).
    for ours, theirs in ((2, 1), (8, 6), (100, 80)):
        a.in_flight, b.in_flight = ours, theirs
        assert kv_aware([a, b], turn(trajectory="t1")) is a, (ours, theirs)
    a.in_flight, b.in_flight = 100, 70
    assert kv_aware([a, b], turn(trajectory="t1")) is b


def test_kv_aware_leaves_the_prefix_for_a_much_faster_engine() -> None:
    slow, fast = engine("slow", in_flight=2), engine("fast", in_flight=2)
    slow.trajectories.add("t1")
    for tokens, seconds in ((64, 1.0), (64, 1.0), (8, 0.01)):  # 8 tokens: too few to count
        record_decode(slow, tokens, seconds)
    assert slow.decode_rate == 64.0
    assert kv_aware([slow, fast], turn(trajectory="t1")) is slow  # fast: not measured yet
    record_decode(fast, 80, 1.0)
    assert kv_aware([slow, fast], turn(trajectory="t1")) is slow  # 80 vs 64: not worth it
    record_decode(fast, 200, 1.0)  # 80 + 0.3 * (200 - 80) = 116 tokens/s
    assert fast.decode_rate == pytest.approx(116.0)
    assert kv_aware([slow, fast], turn(trajectory="t1")) is fast


def test_an_idle_engine_takes_over_a_segment_a_much_slower_engine_still_needs_long_for() -> None:
    fast = engine("fast", decode_rate=100.0)  # nothing in flight
    slow = engine("slow", decode_rate=40.0, in_flight=2, reserved_tokens=1024)
    just_started = RunningSegment(turn(256, 128, trajectory="t1"), slow, 0.2)  # 3 s to go
    nearly_done = RunningSegment(turn(256, 128, trajectory="t2"), slow, 2.9)  # 0.3 s to go
    assert segment_to_move([fast, slow], [nearly_done, just_started]) == (just_started, fast)
    # Half done: 1.28 s on fast against 1.6 s still needed on slow is not gain enough.
    half_done = RunningSegment(turn(256, 128, trajectory="t3"), slow, 1.6)
    assert segment_to_move([fast, slow], [nearly_done, half_done]) is None
    # Not when the idle engine is not much faster, has no room, or is not idle at all.
    assert segment_to_move([engine("peer", decode_rate=50.0), slow], [just_started]) is None
    full = engine("full", decode_rate=100.0, reserved_tokens=1920)
    assert segment_to_move([full, slow], [just_started]) is None
    busy = engine("busy", decode_rate=100.0, in_flight=1)
    assert segment_to_move([busy, slow], [just_started]) is None


def test_kv_aware_skips_unhealthy_removed_and_unknown_engines() -> None:
    dead = engine("dead", healthy=False)
    removing = engine("removing", removing=True)
    unknown = EngineState(name="unknown", healthy=True, probed=True)
    ok = engine("ok", reserved_tokens=1024)
    assert kv_aware([dead, removing, unknown, ok], turn()) is ok
    assert kv_aware([dead, removing, unknown], turn()) is None


def test_a_turn_larger_than_every_engine_is_an_error_not_a_wait() -> None:
    a, b = engine("a"), engine("b")
    check_fits([a, b], turn(100, 1820))  # 1920 tokens: exactly fits
    with pytest.raises(RequestTooLarge, match="largest engine holds 1920 KV tokens"):
        check_fits([a, b], turn(100, 1821))
    a.max_model_len = b.max_model_len = 1024
    with pytest.raises(RequestTooLarge, match="context length 1024"):
        check_fits([a, b], turn(100, 1000))
    # Engines not probed yet may be big enough: no verdict until they are.
    check_fits([a, EngineState(name="new")], turn(100, 5000))


# ---- least-requests and round-robin --------------------------------------------------------


def test_least_requests_sends_at_once_to_the_fewest_in_flight() -> None:
    a, b = engine("a", recorded("busy")), engine("b")
    chosen = []
    for i in range(6):
        e = least_requests([a, b], turn(seq=i))
        assert e is not None
        reserve(e, turn(seq=i))
        chosen.append(e.name)
    assert chosen == ["a", "b", "a", "b", "a", "b"]  # blind to KV: a is overloaded already
    assert least_requests([a, b], turn(seq=9)) is not None  # never queues
    a.trajectories.add("t")
    a.in_flight = 10
    assert least_requests([a, b], turn(trajectory="t")) is a  # sticky, like verl


def test_round_robin_assigns_in_turn_by_arrival() -> None:
    engines = [engine("a"), engine("b"), engine("c")]
    assert [round_robin(engines, turn(seq=i)).name for i in range(5)] == [  # type: ignore[union-attr]
        "a",
        "b",
        "c",
        "a",
        "b",
    ]
    engines[1].healthy = False
    assert [round_robin(engines, turn(seq=i)).name for i in range(3)] == [  # type: ignore[union-attr]
        "a",
        "c",
        "a",
    ]


def test_no_policy_picks_a_dead_engine() -> None:
    dead = [engine("a", healthy=False), engine("b", healthy=False)]
    for policy in POLICIES.values():
        assert policy(dead, turn()) is None


# ---- the queue -----------------------------------------------------------------------------


def test_plan_backfills_small_turns_past_a_big_one() -> None:
    a = engine("a", reserved_tokens=1024)
    queue = [turn(100, 900, seq=0), turn(50, 50, seq=1), turn(50, 50, seq=2)]
    plan = plan_admissions(queue, [a], kv_aware, now=1.0, starvation_seconds=5.0)
    assert [r.seq for r, _ in plan] == [1, 2]
    assert a.reserved_tokens == 1024 + 2 * 128


def test_plan_finds_the_one_turn_that_fits_at_the_end_of_a_long_queue() -> None:
    a, b = engine("a", reserved_tokens=1664), engine("b", reserved_tokens=1792)
    queue = [turn(100, 900, seq=i) for i in range(200)] + [turn(50, 50, seq=200)]
    plan = plan_admissions(queue, [a, b], kv_aware, now=1.0, starvation_seconds=5.0)
    assert [(r.seq, e.name) for r, e in plan] == [(200, "a")]
    # Starving big turns hold both engines: the small one waits too.
    assert plan_admissions(queue, [a, b], kv_aware, now=9.0, starvation_seconds=5.0) == []


def test_plan_stops_backfilling_behind_a_starving_turn() -> None:
    a = engine("a", reserved_tokens=1024)
    queue = [turn(100, 900, seq=0), turn(50, 50, seq=1)]
    assert plan_admissions(queue, [a], kv_aware, now=6.0, starvation_seconds=5.0) == []
    a.reserved_tokens = 0  # room drained: the big turn goes first
    plan = plan_admissions(queue, [a], kv_aware, now=6.0, starvation_seconds=5.0)
    assert [r.seq for r, _ in plan] == [0, 1]


def test_a_starving_turn_holds_only_the_engine_closest_to_fitting_it() -> None:
    # The big turn needs 1024 tokens: "a" lacks 512 of them, "b" 896.
    a = engine("a", reserved_tokens=1408)
    b = engine("b", reserved_tokens=1792)
    big = turn(100, 900, seq=0)
    small = [turn(50, 50, seq=i) for i in (1, 2)]
    assert soonest_fit([a, b], big) is a
    plan = plan_admissions([big, *small], [a, b], kv_aware, now=6.0, starvation_seconds=5.0)
    # "a" is held for the big turn; "b" still takes the small ones that fit it.
    assert [(r.seq, e.name) for r, e in plan] == [(1, "b")]
    assert a.reserved_tokens == 1408
    # Not starving yet: the small turns go wherever there is most room.
    a.reserved_tokens, b.reserved_tokens = 1408, 1792
    plan = plan_admissions([big, *small], [a, b], kv_aware, now=1.0, starvation_seconds=5.0)
    assert [(r.seq, e.name) for r, e in plan] == [(1, "a"), (2, "a")]


def test_the_hold_follows_the_engine_that_lacks_least_and_ends_when_the_turn_fits() -> None:
    a = engine("a", reserved_tokens=1408)
    b = engine("b", reserved_tokens=1792)
    big = turn(100, 900, seq=0)
    assert plan_admissions([big], [a, b], kv_aware, now=6.0) == []
    b.reserved_tokens = 1024  # a turn finished on "b": it now lacks only 128 tokens
    assert soonest_fit([a, b], big) is b
    plan = plan_admissions([big, turn(50, 50, seq=1)], [a, b], kv_aware, now=6.0)
    assert [(r.seq, e.name) for r, e in plan] == [(1, "a")]
    b.reserved_tokens = 896  # and now it fits there
    plan = plan_admissions([big, turn(50, 50, seq=1)], [a, b], kv_aware, now=6.0)
    assert [(r.seq, e.name) for r, e in plan] == [(0, "b"), (1, "a")]


def test_starving_turns_hold_one_engine_each_oldest_first() -> None:
    a = engine("a", reserved_tokens=1408)
    b = engine("b", reserved_tokens=1792)
    queue = [turn(100, 900, seq=0), turn(100, 900, seq=1), turn(50, 50, seq=2)]
    # Both big turns starve: each holds an engine, so the small one waits too.
    assert plan_admissions(queue, [a, b], kv_aware, now=6.0, starvation_seconds=5.0) == []
    # Only the oldest starves: it holds "a" and the small one goes to "b".
    queue[1] = TurnRequest("", 100, 900, seq=1, enqueued_at=3.0)
    plan = plan_admissions(queue, [a, b], kv_aware, now=6.0, starvation_seconds=5.0)
    assert [(r.seq, e.name) for r, e in plan] == [(2, "b")]


def test_plan_with_immediate_policies_sends_everything() -> None:
    a, b = engine("a"), engine("b")
    queue = [turn(100, 900, seq=i) for i in range(10)]
    for policy in (least_requests, round_robin):
        assert len(plan_admissions(queue, [a, b], policy, now=0.0)) == 10
    assert a.reserved_tokens > a.usable_tokens  # they overload (what kv-aware prevents)


def test_segments_ask_for_at_most_segment_tokens() -> None:
    assert segment_new_tokens(1000, 256) == 256
    assert segment_new_tokens(100, 256) == 100
    assert segment_new_tokens(1000, 0) == 1000
    # On block boundaries (blocks of 128): the last one within 256 new tokens, else the next.
    assert segment_new_tokens(1000, 256, context_tokens=300, block_size=128) == 212
    assert segment_new_tokens(1000, 256, context_tokens=512, block_size=128) == 256
    assert segment_new_tokens(1000, 64, context_tokens=300, block_size=128) == 84
    assert segment_new_tokens(50, 64, context_tokens=300, block_size=128) == 50


@pytest.mark.parametrize(
    ("previous", "segment", "expected"),
    [
        ("x = 1</tool", "_call>\nmore", (6, "</tool_call>")),  # split: ends 6 chars in
        ("x = 1<", "/tool_call>more", (11, "</tool_call>")),
        ("x = 1", "</tool_call>", None),  # wholly in the segment: the engine's to find
        ("x = 1</tool", "_cal", None),  # not complete yet
        ("</tool_call>", "abc", None),  # wholly in the earlier text
        ("", "_call>", None),
        ("ab</an", "swer></tool_call>", (5, "</answer>")),  # any of the stop strings
    ],
)
def test_a_stop_string_split_across_segments_is_found(
    previous: str, segment: str, expected: tuple[int, str] | None
) -> None:
    assert find_split_stop(previous, segment, ["</tool_call>", "</answer>"]) == expected


def test_tokens_through_counts_the_tokens_that_cover_a_prefix() -> None:
    offsets = [0, 3, 4, 9]  # tokens "abc", "d", "efghi", "j..."
    assert tokens_through(offsets, 1) == 1
    assert tokens_through(offsets, 4) == 2
    assert tokens_through(offsets, 5) == 3
    assert tokens_through(offsets, 100) == 4
