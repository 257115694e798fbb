"""algorithm.maxStaleness projected to a large fleet: steps per hour at k = 0, 1, 2.

Each step's rollout batch is simulated on the fleet by the rollout simulator
(`kubestar.scheduler.simulator`: the scheduler's own kv-aware admission on simulated engines,
long-tailed multi-turn trajectories, a different seed per step), which gives the batch's
makespan R_i: the time from its first turn to its last, long tail included. The steps are
then scheduled as the trainer runs them (`kubestar.training.pipeline`):

- the trainer collects step i's batch when it is done and the previous step has trained and
  pushed, then trains for T and pushes for P;
- with maxStaleness k the batches of steps i+1 .. i+k are launched as step i's is collected
  (k = 0: step i+1's is launched after step i's push);
- the fleet runs one batch at a time, in order: a batch starts when it is launched and the
  one before it has finished.

The last rule is conservative: a real fleet starts the next batch's turns on the engines the
previous batch's long tail leaves idle, which this schedule does not credit. T is given as a
ratio of the mean makespan (`--train-ratios`), since it depends on the model and the
trainer's GPUs, not on the fleet. Ratios against k = 0 are printed side by side.

    .venv/bin/python bench/staleness_sim.py                 # 64 engines, 8 steps of 1024
    .venv/bin/python bench/staleness_sim.py --trajectories 4096 --steps 16
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kubestar.scheduler.core import KV_AWARE
from kubestar.scheduler.simulator import SimConfig, simulate


@dataclass(frozen=True)
class Schedule:
    staleness: int
    seconds: float  # from the first launch to the last push
    steps_per_hour: float
    engine_idle_fraction: float  # of the fleet's time, between batches
    trainer_idle_fraction: float  # of the trainer's time, waiting on batches


def schedule(makespans: list[float], train_s: float, push_s: float, staleness: int) -> Schedule:
    """The steps as the trainer runs them at `staleness` (see the module docstring)."""
    steps = len(makespans)
    launched: dict[int, float] = {0: 0.0}
    done: list[float] = []
    step_end = 0.0  # when the trainer finished the previous step (trained and pushed)
    waited = 0.0
    for step in range(steps):
        if step not in launched:  # in step: launched after the previous push
            launched[step] = step_end
        start = max(launched[step], done[-1] if done else 0.0)
        done.append(start + makespans[step])
        collected = max(done[step], step_end)
        waited += collected - step_end
        for ahead in range(step + 1, min(step + 1 + staleness, steps)):
            launched.setdefault(ahead, collected)
        step_end = collected + train_s + push_s
    total = step_end
    busy = sum(makespans)
    return Schedule(
        staleness=staleness,
        seconds=total,
        steps_per_hour=steps / total * 3600,
        engine_idle_fraction=1 - busy / total,
        trainer_idle_fraction=waited / total,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=1024, help="per step's batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--segment-tokens", type=int, default=256)
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument(
        "--train-ratios", default="0.25,0.5,1.0", help="train seconds / mean makespan"
    )
    parser.add_argument("--push-ratio", type=float, default=0.05, help="push / mean makespan")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    config = SimConfig(
        engines=args.engines, trajectories=args.trajectories, segment_tokens=args.segment_tokens
    )
    makespans = [
        simulate(replace(config, seed=step), KV_AWARE).makespan_s for step in range(args.steps)
    ]
    mean = sum(makespans) / len(makespans)
    print(
        f"{args.engines} engines, {args.steps} steps of {args.trajectories} trajectories "
        f"(kv-aware, segments of {args.segment_tokens}); batch makespan mean {mean:.1f} s, "
        f"min {min(makespans):.1f}, max {max(makespans):.1f}"
    )
    print("| train / makespan | maxStaleness | steps/hour | x k=0 | engine idle | trainer idle |")
    print("|---|---|---|---|---|---|")
    rows = []
    for ratio in (float(r) for r in args.train_ratios.split(",")):
        base = None
        for staleness in (int(k) for k in args.staleness.split(",")):
            result = schedule(makespans, ratio * mean, args.push_ratio * mean, staleness)
            base = base or result.steps_per_hour
            rows.append({"train_ratio": ratio, **result.__dict__})
            print(
                f"| {ratio:g} | {staleness} | {result.steps_per_hour:.1f} | "
                f"{result.steps_per_hour / base:.2f} | {result.engine_idle_fraction:.0%} | "
                f"{result.trainer_idle_fraction:.0%} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"makespans": makespans, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
