"""The rollout simulator (kubestar.scheduler.simulator): fast, small fleets."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubestar.scheduler import simulator as sim
from kubestar.scheduler.core import KV_AWARE, ROUND_ROBIN

# 4 engines of 4k KV tokens and 96 trajectories: capacity binds, runs in well under a second.
SMALL = sim.SimConfig(
    engines=4,
    trajectories=96,
    kv_tokens=4096,
    block_size=16,
    max_context=2048,
    prompt_min=64,
    prompt_max=256,
    turns_max=4,
    new_median=120,
    new_max=1024,
    tool_tokens_max=64,
)


def test_same_seed_same_results() -> None:
    for policy in sim.POLICY_ORDER:
        first, second = sim.simulate(SMALL, policy), sim.simulate(SMALL, policy)
        assert (first.makespan_s, first.preemptions, first.idle_engine_s) == (
            second.makespan_s,
            second.preemptions,
            second.idle_engine_s,
        )
    other = sim.simulate(replace(SMALL, seed=1), KV_AWARE)
    assert other.makespan_s != sim.simulate(SMALL, KV_AWARE).makespan_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_aware_never_preempts_and_static_does(seed: int) -> None:
    config = replace(SMALL, seed=seed)
    workload = sim.make_workload(config)
    turns = sum(len(t.turns) for t in workload)
    kv = sim.Simulation(config, KV_AWARE, workload).run()
    rr = sim.Simulation(config, ROUND_ROBIN, workload).run()
    assert kv.preemptions == 0
    assert rr.preemptions > 0  # the mix overflows a statically assigned engine's cache
    assert kv.turns == rr.turns == turns  # every turn of every trajectory ran
    assert kv.capacity_ok and rr.capacity_ok


def test_capacity_invariants() -> None:
    for policy in sim.POLICY_ORDER:
        run = sim.Simulation(SMALL, policy, sim.make_workload(SMALL))
        result = run.run()
        usable_blocks = SMALL.kv_tokens // SMALL.block_size - 1
        for engine in run.engines:
            assert engine.max_blocks_used <= usable_blocks
            # Everything reserved was released; nothing left running or waiting.
            assert engine.state.reserved_tokens == 0 and engine.state.in_flight == 0
            assert not engine.running and not engine.waiting
        assert not run.queue and not run.pending
        assert 0.0 <= result.idle_fraction < 1.0
        assert result.makespan_s > 0


def test_an_uneven_fleet_moves_segments_and_kv_aware_gains() -> None:
    # Two of four engines at 1/2.5 the speed: static assignment waits for them, kv-aware
    # measures the rates, leaves the slow engines and moves their last segments.
    config = replace(SMALL, trajectories=48, slow_engines=2, slow_factor=2.5, segment_tokens=128)
    workload = sim.make_workload(config)
    kv = sim.Simulation(config, KV_AWARE, workload).run()
    rr = sim.Simulation(config, ROUND_ROBIN, workload).run()
    assert kv.turns == rr.turns == sum(len(t.turns) for t in workload)
    assert kv.preemptions == 0 and kv.capacity_ok
    assert kv.moves > 0
    assert kv.makespan_s < 0.9 * rr.makespan_s
