"""The rollout simulator's command line: a large fleet under each scheduler policy.

The simulator (`kubestar.scheduler.simulator`) runs the scheduler's own admission code on
simulated engines; see its docstring for the model. This prints one row per policy
(makespan, idle engine time, preemptions, queueing) and how each compares with round-robin.

Calibration: `--calibration bench/scheduler_calibration.json` (written by scheduler_bench.py)
takes step_base_s, step_per_seq_s, prefill_tokens_per_s and turn_overhead_s from the real
engines (CPU, tiny model: absolute times are CPU times, the ratios are what carries over).
Without it, GPU-like defaults are used (documented in `SimConfig`).

    .venv/bin/python bench/rollout_sim.py                        # 64 engines x 4096 trajectories
    .venv/bin/python bench/rollout_sim.py --calibration bench/scheduler_calibration.json
    .venv/bin/python bench/rollout_sim.py --engines 2 --trajectories 32 --seed 1
    .venv/bin/python bench/rollout_sim.py --slow-engines 16 --slow-factor 2   # uneven fleet
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kubestar.scheduler.core import ROUND_ROBIN
from kubestar.scheduler.simulator import (
    POLICY_ORDER,
    SimConfig,
    SimResult,
    Simulation,
    make_workload,
)


def load_calibration(config: SimConfig, path: str) -> SimConfig:
    data = json.loads(Path(path).read_text())
    return replace(
        config,
        step_base_s=float(data["step_base_s"]),
        step_per_seq_s=float(data["step_per_seq_s"]),
        prefill_tokens_per_s=float(data["prefill_tokens_per_s"]),
        turn_overhead_s=float(data["turn_overhead_s"]),
    )


def print_table(results: list[SimResult]) -> None:
    header = (
        f"{'policy':<15}{'makespan s':>11}{'idle frac':>10}{'idle eng-s':>11}{'preempt':>9}"
        f"{'turns':>7}{'queued':>8}{'q mean s':>9}{'q p95 s':>9}{'kv ok':>6}{'wall s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.policy:<15}{r.makespan_s:>11.1f}{r.idle_fraction:>10.3f}{r.idle_engine_s:>11.0f}"
            f"{r.preemptions:>9}{r.turns:>7}{r.queued_on_arrival:>8}{r.queue_mean_s:>9.2f}"
            f"{r.queue_p95_s:>9.2f}{'yes' if r.capacity_ok else 'NO':>6}{r.wall_s:>7.1f}"
        )
    by = {r.policy: r for r in results}
    rr = by.get(ROUND_ROBIN)
    if rr is None:
        return
    for r in results:
        if r.policy == ROUND_ROBIN:
            continue
        reduction = 1 - r.idle_engine_s / rr.idle_engine_s if rr.idle_engine_s else 0.0
        print(
            f"{r.policy} vs round-robin (static): makespan x{r.makespan_s / rr.makespan_s:.2f}, "
            f"idle-time reduction {reduction:.0%}, preemptions {r.preemptions} vs "
            f"{rr.preemptions}" + (f", segments moved {r.moves}" if r.moves else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    defaults = SimConfig()
    for name in (
        "engines", "trajectories", "seed", "kv_tokens", "block_size", "new_median",
        "new_max", "turns_min", "turns_max", "prompt_min", "prompt_max", "tool_tokens_min",
        "tool_tokens_max", "max_context", "chunk", "window", "segment_tokens", "slow_engines",
    ):  # fmt: skip
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    parser.add_argument("--tool-s", type=float, default=defaults.tool_s)
    parser.add_argument("--new-sigma", type=float, default=defaults.new_sigma)
    parser.add_argument("--slow-factor", type=float, default=defaults.slow_factor)
    parser.add_argument("--starvation-s", type=float, default=defaults.starvation_s)
    parser.add_argument("--calibration", default="", help="JSON from scheduler_bench.py")
    parser.add_argument("--policies", default=",".join(POLICY_ORDER))
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    config = replace(
        defaults,
        **{
            name: getattr(args, name)
            for name in SimConfig.__dataclass_fields__
            if hasattr(args, name)
        },
    )
    if args.calibration:
        config = load_calibration(config, args.calibration)
    workload = make_workload(config)
    turns = sum(len(t.turns) for t in workload)
    print(
        f"{config.engines} engines x {config.usable_tokens} KV tokens; {len(workload)} "
        f"trajectories, {turns} turns; step {config.step_base_s * 1000:.1f} ms + "
        f"{config.step_per_seq_s * 1000:.3f} ms x batch; prefill "
        f"{config.prefill_tokens_per_s:.0f} tok/s; tool {config.tool_s} s mean; starvation "
        f"{config.starvation_s} s"
        + (f" (calibrated from {args.calibration})" if args.calibration else "")
    )
    results = [Simulation(config, p, workload).run() for p in args.policies.split(",") if p]
    print_table(results)
    if args.json:
        Path(args.json).write_text(
            json.dumps([r.__dict__ for r in results], indent=2, default=str) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
