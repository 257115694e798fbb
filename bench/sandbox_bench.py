"""Throughput and latency of the code sandbox against one `python -c` process per call.

Starts `kubestar sandbox serve` as a separate process (one process playing both roles, and
optionally a dispatcher in front of one worker), drives it from one asyncio loop with
grpc.aio, then runs the same workloads as one `python -c CODE` subprocess per call.

    .venv/bin/python bench/sandbox_bench.py                 # full run, ~4 minutes
    .venv/bin/python bench/sandbox_bench.py --quick         # ~1 minute
    .venv/bin/python bench/sandbox_bench.py --executors 2,3,4 --no-baseline
    .venv/bin/python bench/sandbox_bench.py --no-light-too   # light zygotes on and off
    .venv/bin/python bench/sandbox_bench.py --no-filter-too  # the syscall filter on and off
    .venv/bin/python bench/sandbox_bench.py --json out.json

The load generator and the server share the machine: the client's CPU use is reported per
run (column cli%), so the server had that much less CPU than the machine has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kubestar.common.net import free_port
from kubestar.sandbox.client import SandboxClient
from kubestar.v1 import sandbox_pb2 as pb

REPO = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
MiB = 1024 * 1024
NO_FILTER = "sandbox --no-syscall-filter"


@dataclass(frozen=True)
class Workload:
    name: str
    code: str
    expected: str
    # Makes each call's own code and expected output (fresh coefficients, as a model's calls
    # have); None: every call runs `code`.
    fresh: Callable[[], tuple[str, str]] | None = None

    def next_call(self) -> tuple[str, str]:
        return self.fresh() if self.fresh else (self.code, self.expected)


_roots = random.Random(2)


def quadratic_with_fresh_roots() -> tuple[str, str]:
    """W3: sympy solves a quadratic whose integer roots a < b are new in (almost) every call,
    never the warm-up's 2 and 3: its caches (filled by the zygote's warm-up) cannot answer."""
    a, b = 2, 3
    while (a, b) == (2, 3):
        a, b = sorted(_roots.sample(range(-99, 100), 2))
    p, q = -(a + b), a * b
    polynomial = f"x**2 {'-' if p < 0 else '+'} {abs(p)}*x {'-' if q < 0 else '+'} {abs(q)}"
    code = f"from sympy import symbols, solve; x = symbols('x'); print(solve({polynomial}, x))"
    return code, f"[{a}, {b}]\n"


WORKLOADS = [
    Workload("W1", "print(1+1)", "2\n"),
    Workload(
        "W2",
        "import math; print(sum(math.sqrt(i) for i in range(20000)))",
        f"{sum(math.sqrt(i) for i in range(20000))}\n",
    ),
    Workload("W3", *quadratic_with_fresh_roots(), fresh=quadratic_with_fresh_roots),
]


@dataclass(frozen=True)
class Mode:
    name: str
    concurrency: int  # requests in flight: single calls, or batches
    batch: int  # 0: single Execute calls


@dataclass
class RunResult:
    system: str  # "sandbox", "dispatcher+worker", "python -c"
    executors: int
    workload: str
    mode: str
    calls: int
    failures: int
    seconds: float
    calls_per_second: float
    latency_unit: str  # "call" or "batch"
    p50_ms: float
    p99_ms: float
    call_p50_ms: float  # per call for singles; for batches: executor-measured run time
    call_p99_ms: float
    peak_rss_mib: float
    peak_pss_mib: float
    server_cpu_percent: float  # gRPC process(es)
    executor_cpu_percent: float  # zygotes and the calls they forked
    client_cpu_percent: float
    other_cpu_percent: float  # everything else on the machine during the run
    # CPU time of server + executors (or subprocesses) + client per call: what a call costs,
    # much less sensitive to other load on the machine than calls/s.
    cpu_ms_per_call: float
    failure_examples: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- /proc sampling


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def process_tree(roots: list[int]) -> list[int]:
    """The roots and all their descendants (children of every thread)."""
    seen: list[int] = []
    stack = list(roots)
    while stack:
        pid = stack.pop()
        seen.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                stack.extend(int(c) for c in _read(f"/proc/{pid}/task/{task}/children").split())
            except OSError:
                continue
    return seen


def rss_bytes(pid: int) -> int:
    try:
        return int(_read(f"/proc/{pid}/statm").split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    try:
        for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def cpu_seconds(pid: int, with_children: bool) -> float:
    """utime+stime (plus the reaped children's, with_children) of a process."""
    try:
        fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[0] is the state (field 3 of stat): utime is field 14, so index 11 here.
    ticks = int(fields[11]) + int(fields[12])
    if with_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICKS


class Sampler:
    """Peak summed RSS (and PSS) over process trees, sampled from the running event loop."""

    def __init__(self, roots: list[int], interval: float = 0.1, pss_every: int = 5) -> None:
        self.roots = roots
        self.interval = interval
        self.pss_every = pss_every
        self.peak_rss = 0
        self.peak_pss = 0
        self._task: asyncio.Task[None] | None = None

    def sample(self, with_pss: bool) -> None:
        pids = process_tree(self.roots)
        self.peak_rss = max(self.peak_rss, sum(rss_bytes(pid) for pid in pids))
        if with_pss:
            self.peak_pss = max(self.peak_pss, sum(pss_bytes(pid) for pid in pids))

    async def _loop(self) -> None:
        tick = 0
        while True:
            self.sample(tick % self.pss_every == 0)
            tick += 1
            await asyncio.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sample(True)


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (all CPUs, all processes), from /proc/stat."""
    fields = [int(v) for v in _read("/proc/stat").split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already part of user time
    return (sum(fields[:8]) - idle) / TICKS


class CpuMeter:
    """CPU used by the server's gRPC processes, by its executors (or this process's
    subprocesses), by this client, and by everything else on the machine."""

    def __init__(self, server_pids: list[int], subprocesses: bool = False) -> None:
        self.server_pids = server_pids
        self.subprocesses = subprocesses

    def _now(self) -> tuple[float, float, float, float]:
        server = sum(cpu_seconds(pid, with_children=False) for pid in self.server_pids)
        if self.subprocesses:
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            executors = children.ru_utime + children.ru_stime
        else:
            executors = sum(
                cpu_seconds(pid, with_children=True)
                for pid in process_tree(self.server_pids)
                if pid not in self.server_pids
            )
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return server, executors, usage.ru_utime + usage.ru_stime, machine_busy_seconds()

    def __enter__(self) -> CpuMeter:
        self.start = self._now()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._now()
        elapsed = time.perf_counter() - self.started
        server, executors, client, busy = (
            100.0 * (b - a) / elapsed for a, b in zip(self.start, end, strict=True)
        )
        # Other processes on the machine (a noisy neighbour makes every number worse).
        self.percent = (server, executors, client, max(0.0, busy - server - executors - client))
        self.seconds = sum(b - a for a, b in zip(self.start[:3], end[:3], strict=True))


# ----------------------------------------------------------------------------- load generation


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[index]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds, per request
    call_latencies: list[float] = field(default_factory=list)  # seconds, per call
    calls: int = 0
    failures: int = 0
    warm_calls: int = 0  # calls made during the warm-up (not in the stats)
    examples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.examples) < 3:
            self.examples.append(what[:300])


Request = Callable[[Tally], Awaitable[None]]


async def drive(request: Request, concurrency: int, seconds: float, warmup: float) -> Tally:
    """`concurrency` loops issue requests back to back; measured after a warm-up.

    Each loop makes at least one measured request; none starts after the deadline, and the
    ones in flight then are awaited and counted.
    """
    warm = Tally()
    measured = Tally()
    loop = asyncio.get_running_loop()
    warm_until = loop.time() + warmup
    stop_at = warm_until + seconds

    async def one_loop() -> None:
        while loop.time() < warm_until:
            await request(warm)
        while True:
            await request(measured)
            if loop.time() >= stop_at:
                return

    await asyncio.gather(*(one_loop() for _ in range(concurrency)))
    measured.warm_calls = warm.calls
    if warm.failures:
        measured.examples = [f"(warm-up) {e}" for e in warm.examples] + measured.examples
        measured.failures += warm.failures
    return measured


def sandbox_request(client: SandboxClient, workload: Workload, batch: int) -> Request:
    ok = pb.EXECUTION_STATUS_OK

    def check(tally: Tally, result: pb.ExecutionResult, expected: str) -> None:
        tally.calls += 1
        if result.status != ok or result.stdout != expected:
            tally.fail(
                f"status={pb.ExecutionStatus.Name(result.status)} stdout={result.stdout!r} "
                f"stderr={result.stderr[-200:]!r} message={result.message!r}"
            )

    async def single(tally: Tally) -> None:
        code, expected = workload.next_call()
        started = time.perf_counter()
        try:
            result = await client.aexecute(code)
        except grpc.RpcError as error:
            tally.calls += 1
            tally.fail(f"rpc error: {error}")
            return
        elapsed = time.perf_counter() - started
        tally.latencies.append(elapsed)
        tally.call_latencies.append(elapsed)
        check(tally, result, expected)

    async def batched(tally: Tally) -> None:
        calls = [workload.next_call() for _ in range(batch)]
        started = time.perf_counter()
        try:
            results = await client.aexecute_batch([code for code, _ in calls])
        except grpc.RpcError as error:
            tally.calls += batch
            for _ in range(batch):
                tally.fail(f"rpc error: {error}")
            return
        tally.latencies.append(time.perf_counter() - started)
        if len(results) != batch:
            tally.fail(f"batch of {batch} returned {len(results)} results")
        for result, (_, expected) in zip(results, calls, strict=False):
            tally.call_latencies.append(result.wall_ms / 1000.0)
            check(tally, result, expected)

    return batched if batch else single


def baseline_request(python: str, workload: Workload, batch: int, env: dict[str, str]) -> Request:
    async def run_one(tally: Tally) -> float:
        code, expected = workload.next_call()
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            python,
            "-S",  # see run_baseline
            "-c",
            code,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        stdout, stderr = await process.communicate()
        elapsed = time.perf_counter() - started
        tally.calls += 1
        if process.returncode != 0 or stdout.decode() != expected:
            tally.fail(f"exit={process.returncode} stdout={stdout!r} stderr={stderr[-200:]!r}")
        return elapsed

    async def single(tally: Tally) -> None:
        elapsed = await run_one(tally)
        tally.latencies.append(elapsed)
        tally.call_latencies.append(elapsed)

    async def batched(tally: Tally) -> None:
        started = time.perf_counter()
        tally.call_latencies += await asyncio.gather(*(run_one(tally) for _ in range(batch)))
        tally.latencies.append(time.perf_counter() - started)

    return batched if batch else single


async def measure(
    system: str,
    executors: int,
    workload: Workload,
    mode: Mode,
    request: Request,
    sample_roots: list[int],
    server_pids: list[int],
    seconds: float,
    warmup: float,
) -> RunResult:
    with (
        CpuMeter(server_pids, subprocesses=not server_pids) as cpu,
        Sampler(sample_roots) as sampler,
    ):
        started = time.perf_counter()
        tally = await drive(request, mode.concurrency, seconds, warmup)
        # Throughput over the measured part (warm-up excluded; the drain at the end included).
        elapsed = time.perf_counter() - started - warmup
    server_cpu, executor_cpu, client_cpu, other_cpu = cpu.percent
    ms = 1000.0
    return RunResult(
        system=system,
        executors=executors,
        workload=workload.name,
        mode=mode.name,
        calls=tally.calls,
        failures=tally.failures,
        seconds=round(elapsed, 3),
        calls_per_second=tally.calls / elapsed if elapsed > 0 else 0.0,
        latency_unit="batch" if mode.batch else "call",
        p50_ms=percentile(tally.latencies, 50) * ms,
        p99_ms=percentile(tally.latencies, 99) * ms,
        call_p50_ms=percentile(tally.call_latencies, 50) * ms,
        call_p99_ms=percentile(tally.call_latencies, 99) * ms,
        peak_rss_mib=sampler.peak_rss / MiB,
        peak_pss_mib=sampler.peak_pss / MiB,
        server_cpu_percent=server_cpu,
        executor_cpu_percent=executor_cpu,
        client_cpu_percent=client_cpu,
        other_cpu_percent=other_cpu,
        cpu_ms_per_call=1000.0 * cpu.seconds / (tally.calls + tally.warm_calls)
        if tally.calls
        else 0.0,
        failure_examples=tally.examples,
    )


# ----------------------------------------------------------------------------- the service


class Service:
    """`kubestar sandbox serve` processes: one worker, or a dispatcher in front of it."""

    def __init__(
        self,
        label: str,
        executors: int,
        dispatcher: bool,
        log_dir: Path,
        source: Path | None = None,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        self.label = label
        self.serve_args = serve_args  # extra `kubestar sandbox serve` options of the worker
        self.executors = executors
        self.dispatcher = dispatcher
        self.log_dir = log_dir
        self.source = source  # another source tree (services/, protos/) to run instead
        self.processes: list[subprocess.Popen[bytes]] = []
        self.endpoint = ""

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        kubestar = str(Path(sys.executable).with_name("kubestar"))
        env = dict(os.environ)
        if self.source is not None:
            env["PYTHONPATH"] = f"{self.source / 'services'}:{self.source / 'protos'}"
        log_name = f"{self.label}-{self.executors}-{name}.log".replace("/", "_")
        log = open(self.log_dir / log_name, "wb")  # noqa: SIM115 - lives with the process
        process = subprocess.Popen(
            [kubestar, "sandbox", "serve", "--listen", f"127.0.0.1:{port}", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.processes.append(process)
        return process, f"127.0.0.1:{port}"

    def start(self) -> None:
        common = ["--log-level", "warning"]
        _, worker = self._spawn(
            "worker", ["--executors", str(self.executors), *self.serve_args, *common]
        )
        self._wait_ready(worker)
        self.endpoint = worker
        if self.dispatcher:
            _, front = self._spawn("dispatcher", ["--worker", worker, *common])
            self._wait_ready(front, need_capacity=True)
            self.endpoint = front

    def _wait_ready(self, endpoint: str, need_capacity: bool = False) -> None:
        deadline = time.monotonic() + 180.0
        with SandboxClient(endpoint, timeout=2.0) as client:
            while True:
                if any(p.poll() is not None for p in self.processes):
                    raise RuntimeError(f"a server exited early; see the logs in {self.log_dir}")
                try:
                    capacity = client.capacity()
                    if capacity.capacity or not need_capacity:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{endpoint} did not become ready")
                time.sleep(0.2)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


# ----------------------------------------------------------------------------- reporting


def git_commit() -> str:
    """HEAD's commit, read from .git without running git."""
    git = REPO / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return f"{(git / ref).read_text().strip()} ({ref.removeprefix('refs/heads/')})"
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return f"{line.split()[0]} ({ref.removeprefix('refs/heads/')})"
    except OSError:
        pass
    return "unknown"


def environment() -> dict[str, Any]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in _read("/proc/cpuinfo").splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * PAGE / 1024**3, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "running_as_root": os.geteuid() == 0,
        "versions": {
            name: version(name)
            for name in ("kubestar", "grpcio", "protobuf", "numpy", "sympy", "uvloop")
        },
    }


def fmt(value: float, digits: int = 1) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def print_header(env: dict[str, Any], args: argparse.Namespace) -> None:
    print("kubestar sandbox benchmark")
    print(f"  commit     {env['commit']}")
    print(f"  date       {env['date']}")
    print(
        f"  machine    {env['usable_cpus']} usable CPUs ({env['host_cpus']} online), "
        f"{env['cpu_model']}, {env['memory_gib']} GiB, kernel {env['kernel']}, "
        f"root={env['running_as_root']}"
    )
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    print(f"  software   python {env['python']}, {versions}")
    print(
        f"  settings   {args.seconds:g}s measured + {args.warmup:g}s warm-up per run; "
        f"batches of {args.batch_size} with {args.batch_concurrency} in flight; "
        f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
    )
    print(
        "  note       the load generator (this process, one asyncio loop, grpc.aio) runs on the"
        " same machine as the server and competes with it for CPU: see column cli%"
    )
    print(flush=True)


COLUMNS = (
    f"{'system':<27} {'ex':>2} {'load':<4} {'mode':<10} {'calls':>6} {'fail':>4} "
    f"{'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'call p50':>8} {'call p99':>8} "
    f"{'RSS MiB':>8} {'PSS MiB':>8} {'srv%':>5} {'exe%':>5} {'cli%':>5} {'oth%':>5} {'cpu ms':>6}"
)


def row(r: RunResult) -> str:
    ex = str(r.executors) if r.executors else "-"
    return (
        f"{r.system:<27} {ex:>2} {r.workload:<4} {r.mode:<10} {r.calls:>6} {r.failures:>4} "
        f"{fmt(r.calls_per_second):>9} {fmt(r.p50_ms, 2):>8} {fmt(r.p99_ms, 2):>8} "
        f"{fmt(r.call_p50_ms, 2):>8} {fmt(r.call_p99_ms, 2):>8} "
        f"{fmt(r.peak_rss_mib, 0):>8} {fmt(r.peak_pss_mib, 0):>8} "
        f"{fmt(r.server_cpu_percent, 0):>5} {fmt(r.executor_cpu_percent, 0):>5} "
        f"{fmt(r.client_cpu_percent, 0):>5} {fmt(r.other_cpu_percent, 0):>5} "
        f"{fmt(r.cpu_ms_per_call, 2):>6}"
    )


LEGEND = """\
  p50/p99 ms: client-measured latency per call (single modes) or per batch (batch modes).
  call p50/p99: per call; for batch modes the executor-measured run time of each call
    (for python -c: each subprocess's own wall time).
  RSS MiB: peak of RSS summed over the server process(es) and all descendants (executors and
    the calls they fork), sampled every 0.1 s; shared pages count once per process, so this
    overstates real use: PSS MiB (sampled every 0.5 s) splits shared pages fairly.
    For python -c: summed over the running subprocesses.
  srv%/exe%/cli%/oth%: CPU of the gRPC server process(es) / executors and their calls (for
    python -c: the subprocesses) / this client process / everything else on the machine, in %
    of one core over the run (200% = both cores of a 2-core machine). oth% well above 0 means
    a noisy neighbour took CPU from the run.
  cpu ms: CPU time per call of server + executors (or subprocesses) + client; unlike calls/s
    it hardly depends on other load. On an otherwise idle machine with N cores, calls/s can
    reach at most about N*1000/cpu ms.
  fail: results whose status is not ok or whose stdout is wrong, plus RPC errors."""


def print_ratios(results: list[RunResult]) -> None:
    base = {(r.workload, r.mode): r for r in results if r.system == "python -c"}
    ours = [r for r in results if r.system != "python -c" and (r.workload, r.mode) in base]
    if not ours:
        return
    print()
    print("ours / baseline (python -c per call); latency ratios are baseline/ours (higher=better)")
    print(
        f"{'system':<27} {'ex':>2} {'load':<4} {'mode':<10} {'calls/s':>9} {'base/s':>8} "
        f"{'thr x':>7} {'p50 x':>7} {'p99 x':>7}"
    )
    for r in ours:
        b = base[(r.workload, r.mode)]
        thr = r.calls_per_second / b.calls_per_second if b.calls_per_second else float("nan")
        p50 = b.p50_ms / r.p50_ms if r.p50_ms else float("nan")
        p99 = b.p99_ms / r.p99_ms if r.p99_ms else float("nan")
        print(
            f"{r.system:<27} {r.executors:>2} {r.workload:<4} {r.mode:<10} "
            f"{fmt(r.calls_per_second):>9} {fmt(b.calls_per_second):>8} "
            f"{fmt(thr):>7} {fmt(p50):>7} {fmt(p99):>7}"
        )


def print_side_by_side(results: list[RunResult]) -> None:
    """Each variant (--no-filter-too, --no-light-too, --compare) against `sandbox`, measured in
    turn with it in the same run; for the filter, what it costs against the 5% target."""
    ours = {(r.executors, r.workload, r.mode): r for r in results if r.system == "sandbox"}
    variants = [
        r
        for r in results
        if r.system not in ("sandbox", "python -c") and (r.executors, r.workload, r.mode) in ours
    ]
    if not variants:
        return
    print()
    print("sandbox / variant, measured side by side: calls/s and CPU ms a call (x: the ratio)")
    print(
        f"{'variant':<27} {'ex':>2} {'load':<4} {'mode':<10} {'calls/s':>9} {'variant':>9} "
        f"{'x':>6} {'cpu ms':>7} {'variant':>8} {'x':>6}"
    )
    for v in variants:
        r = ours[(v.executors, v.workload, v.mode)]
        throughput = r.calls_per_second / v.calls_per_second if v.calls_per_second else math.nan
        cpu = r.cpu_ms_per_call / v.cpu_ms_per_call if v.cpu_ms_per_call else math.nan
        print(
            f"{v.system:<27} {v.executors:>2} {v.workload:<4} {v.mode:<10} "
            f"{fmt(r.calls_per_second):>9} {fmt(v.calls_per_second):>9} {fmt(throughput, 3):>6} "
            f"{fmt(r.cpu_ms_per_call, 2):>7} {fmt(v.cpu_ms_per_call, 2):>8} {fmt(cpu, 3):>6}"
        )
    unfiltered = [v for v in variants if v.system == NO_FILTER and v.workload in ("W1", "W3")]
    if unfiltered:
        print()
        print("syscall filter's cost (target: under 5% on W1 and W3)")
        for v in unfiltered:
            r = ours[(v.executors, v.workload, v.mode)]
            cpu = 100.0 * (r.cpu_ms_per_call / v.cpu_ms_per_call - 1.0)
            throughput = 100.0 * (1.0 - r.calls_per_second / v.calls_per_second)
            print(
                f"  {v.workload} {v.mode:<10} CPU a call {cpu:+.1f}%, calls/s {-throughput:+.1f}%"
            )


def print_targets(results: list[RunResult]) -> None:
    ours = [r for r in results if r.system == "sandbox"]
    if not ours:
        return
    cores = len(os.sched_getaffinity(0))

    def best(workload: str) -> str:
        candidates = [r for r in ours if r.workload == workload]
        if not candidates:
            return "not measured"
        top = max(candidates, key=lambda r: r.calls_per_second)
        cheapest = min(r.cpu_ms_per_call for r in candidates)
        return (
            f"best {fmt(top.calls_per_second)} ({top.mode}, {top.executors} executors); "
            f"at {fmt(cheapest, 2)} CPU ms a call, {cores} otherwise idle cores would allow "
            f"at most ~{fmt(cores * 1000.0 / cheapest, 0)}"
        )

    print()
    print(f"targets (2-core machine; this one has {cores})")
    print(f"  W1 >= 1,000 calls/s: {best('W1')}")
    print(f"  W3 >= 150 calls/s:   {best('W3')}")
    for r in ours:
        if r.workload == "W1" and r.mode == "c64":
            print(f"  W1 p99 at c64 < 100 ms: {fmt(r.p99_ms, 2)} ms ({r.executors} executors)")
    served = [r for r in results if r.system != "python -c"]
    failures = sum(r.failures for r in served)
    print(f"  nothing lost or failed: {failures} failures in {sum(r.calls for r in served)} calls")
    for r in served:
        for example in r.failure_examples:
            print(f"    {r.system} {r.workload} {r.mode}: {example}")


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per run (default 1)")
    parser.add_argument(
        "--executors",
        default="4",
        help="executors of the service; a comma-separated list runs each side by side "
        "(default 4: on 2 cores, 2 to 4 did about as well; 4 fills the gaps while an "
        "executor waits for its next call)",
    )
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute)")
    parser.add_argument(
        "--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3"
    )
    parser.add_argument("--modes", default="c8,c64,b32", help="comma-separated: c8,c64,b32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--batch-concurrency", type=int, default=2, help="batches in flight at once (default 2)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the python -c runs")
    parser.add_argument(
        "--baseline-only", action="store_true", help="only the python -c runs (no service)"
    )
    parser.add_argument(
        "--dispatcher",
        action="store_true",
        help="also measure a dispatcher in front of one worker (two processes)",
    )
    parser.add_argument(
        "--no-light-too",
        action="store_true",
        help="also measure the service without light zygotes (--no-light), side by side",
    )
    parser.add_argument(
        "--no-filter-too",
        action="store_true",
        help="also measure the service without its syscall filter (--no-syscall-filter), side "
        "by side: what the filter costs",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also run the service from another source tree (DIR/services, DIR/protos), "
        "measured side by side with this one (repeatable)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the bench, the service and the baseline at this nice value (e.g. -10, as "
        "root) so that other load on a shared machine disturbs the numbers less; calls run in "
        "sessions of their own, which autogroup scheduling does not prioritise",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write a JSON summary here")
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 1.5 if args.quick else 5.0
    if args.warmup is None:
        args.warmup = 0.5 if args.quick else 1.0
    compare = []
    for spec in args.compare:
        label, _, directory = spec.partition("=")
        if not directory or not (Path(directory) / "services").is_dir():
            parser.error(f"--compare {spec}: expected LABEL=DIR with DIR/services")
        compare.append((label, Path(directory).resolve()))
    args.compare = compare
    return args


async def run_services(
    services: list[Service],
    workloads: list[Workload],
    modes: list[Mode],
    args: argparse.Namespace,
    results: list[RunResult],
) -> None:
    """Each (workload, mode) on every service in turn: variants are measured side by side."""
    clients = [SandboxClient(service.endpoint, timeout=120.0) for service in services]
    try:
        for workload in workloads:
            for mode in modes:
                for service, client in zip(services, clients, strict=True):
                    result = await measure(
                        service.label,
                        service.executors,
                        workload,
                        mode,
                        sandbox_request(client, workload, mode.batch),
                        service.pids,
                        service.pids,
                        args.seconds,
                        args.warmup,
                    )
                    print(row(result), flush=True)
                    results.append(result)
    finally:
        for client in clients:
            await client.aclose()
            client.close()


async def run_baseline(
    workloads: list[Workload],
    modes: list[Mode],
    args: argparse.Namespace,
    results: list[RunResult],
) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        # A plain interpreter with numpy and sympy installed: this venv's site hooks (the
        # editable-install finder of kubestar itself, ~17 ms a start) would slow the baseline
        # down for a reason no user's python3 has. -S skips them; the packages stay importable.
        "PYTHONPATH": os.pathsep.join(
            {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
        ),
    }
    for workload in workloads:
        for mode in modes:
            request = baseline_request(sys.executable, workload, mode.batch, env)
            # No warm-up phase (a slow call would run past it): one untimed call warms the
            # page cache instead.
            await baseline_request(sys.executable, workload, 0, env)(Tally())
            result = await measure(
                "python -c", 0, workload, mode, request, [os.getpid()], [], args.seconds, 0.0
            )
            # The sampler's tree includes this process: count only the subprocesses.
            result.peak_rss_mib = max(0.0, result.peak_rss_mib - rss_bytes(os.getpid()) / MiB)
            result.peak_pss_mib = max(0.0, result.peak_pss_mib - pss_bytes(os.getpid()) / MiB)
            print(row(result), flush=True)
            results.append(result)


async def main_async(args: argparse.Namespace) -> list[RunResult]:
    workloads = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    all_modes = {
        "c8": Mode("c8", 8, 0),
        "c64": Mode("c64", 64, 0),
        "b32": Mode(
            f"b{args.batch_size}x{args.batch_concurrency}",
            args.batch_concurrency,
            args.batch_size,
        ),
    }
    modes = [all_modes[m] for m in args.modes.split(",")]
    results: list[RunResult] = []
    print(COLUMNS, flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="sandbox-bench-"))
    if not args.baseline_only:
        sources: list[tuple[str, Path | None]] = [("sandbox", None), *args.compare]
        services = []
        for executors in [int(n) for n in args.executors.split(",")]:
            for label, source in sources:
                services.append(Service(label, executors, False, log_dir, source))
                if args.dispatcher:
                    name = "dispatcher+worker" if source is None else f"{label}+dispatcher"
                    services.append(Service(name, executors, True, log_dir, source))
            if args.no_light_too:
                services.append(
                    Service("sandbox --no-light", executors, False, log_dir, None, ("--no-light",))
                )
            if args.no_filter_too:
                services.append(
                    Service(NO_FILTER, executors, False, log_dir, None, ("--no-syscall-filter",))
                )
        try:
            for service in services:
                service.start()
            await run_services(services, workloads, modes, args, results)
        finally:
            for service in services:
                service.stop()
    if not args.no_baseline:
        # One python -c per call at concurrency 64 takes ~15 s for W3 alone: --quick keeps
        # the baseline to the lowest concurrency.
        baseline_modes = modes[:1] if args.quick else modes
        await run_baseline(workloads, baseline_modes, args, results)
    return results


def main() -> None:
    args = parse_args()
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by every process started
        # With autogroup scheduling a nice value only counts within the session's group:
        # give the group the same nice (the calls, each in a session of its own, escape it).
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(str(args.nice))
    env = environment()
    print_header(env, args)
    started = time.monotonic()
    results = asyncio.run(main_async(args))
    print()
    print(LEGEND)
    print_ratios(results)
    print_side_by_side(results)
    print_targets(results)
    total = time.monotonic() - started
    print(f"\ntotal time {total:.0f}s")
    if args.json:
        summary = {
            "environment": env,
            "settings": {
                "seconds": args.seconds,
                "warmup": args.warmup,
                "batch_size": args.batch_size,
                "batch_concurrency": args.batch_concurrency,
                "quick": args.quick,
                "nice": args.nice,
                "client_shares_machine": True,
            },
            "results": [asdict(r) for r in results],
            "total_seconds": round(total, 1),
        }
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"JSON summary written to {args.json}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
