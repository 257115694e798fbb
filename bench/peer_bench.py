"""kubestar's HTTP endpoint against SandboxFusion's own server, on the same calls in one run.

Starts `kubestar sandbox serve --http-listen` and SandboxFusion's server (uvicorn, from the
virtualenv that `make peer-sandbox-fusion` makes), both bound to 127.0.0.1, and sends both the
workloads of bench/sandbox_bench.py (W1 `print(1+1)`, W2 a `math` loop, W3 a sympy solve with
new coefficients every call) as SandboxFusion's `POST /run_code`, at fixed client concurrency,
alternating between the two servers measurement by measurement so that a change in the
machine's speed touches both. Prints correct answers per second, latency percentiles and the
ratio ours/theirs per workload as a Markdown table, and the isolation each server gave.

Every answer is checked: HTTP 200, `status` Success and the workload's exact stdout; anything
else is a failure, counted in the table (a time limit too), and the exit status is 1.

    make peer-sandbox-fusion SANDBOX_FUSION_SRC=DIR   # once: DIR is a SandboxFusion checkout
    .venv/bin/python bench/peer_bench.py              # c8 and c64, ~4 minutes on 2 cores
    .venv/bin/python bench/peer_bench.py --quick      # c8 only, ~1 minute

The load generator (this process, one asyncio loop, aiohttp) shares the machine with both
servers: its CPU use is reported per run (column cli%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import yaml
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE
from kubestar.common.net import free_port

REPO = Path(__file__).resolve().parents[1]
# Run as a script (python bench/peer_bench.py): make the checkout's bench/ importable as a
# package, as mypy sees it.
sys.path.insert(0, str(REPO))

from bench.sandbox_bench import (  # noqa: E402
    WORKLOADS,
    CpuMeter,
    MiB,
    Sampler,
    Service,
    Workload,
    cpu_seconds,
    environment,
    fmt,
    machine_busy_seconds,
    percentile,
    process_tree,
)

PEER_HOME = Path.home() / ".cache" / "kubestar" / "peers" / "sandbox-fusion"
SETUP = (
    "make peer-sandbox-fusion SANDBOX_FUSION_SRC=DIR (DIR: a checkout of bytedance/"
    "SandboxFusion; PyPI's sandbox-fusion is only its client)"
)
# SandboxFusion's default configuration (sandbox/configs/local.yaml, unless SANDBOX_CONFIG names
# another): code runs on the host, no isolation.
PEER_CONFIG = "local"
OURS = "kubestar"
THEIRS = "SandboxFusion"
# Without a proxy: every address here is 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ----------------------------------------------------------------------------- the servers


class PeerServer:
    """SandboxFusion's server (`uvicorn sandbox.server.server:app`, as its Makefile starts it)
    from the peer virtualenv, on 127.0.0.1."""

    def __init__(self, home: Path, log_dir: Path) -> None:
        self.home = home
        self.log_path = log_dir / "sandbox-fusion.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        port = free_port()
        # The project's interpreter settings must not leak into the peer's own virtualenv.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KUBESTAR_"))
        }
        env["SANDBOX_CONFIG"] = PEER_CONFIG
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives with the process
        self.process = subprocess.Popen(
            [
                *(str(self.home / "bin" / "python"), "-m", "uvicorn"),
                "sandbox.server.server:app",
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            cwd=self.home / "src",  # it reads its configuration and sample data from there
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.url = f"http://127.0.0.1:{port}"
        process = self.process
        wait_for_ping(self.url, lambda: process.poll() is None, self.log_path)

    @property
    def pids(self) -> list[int]:
        return [self.process.pid] if self.process else []

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def wait_for_ping(url: str, alive: Callable[[], bool], log: Path) -> None:
    """Until `GET /v1/ping` answers "pong" (both servers have it), up to 3 minutes."""
    deadline = time.monotonic() + 180.0
    while True:
        if not alive():
            raise RuntimeError(f"the server of {url} exited early; see {log}")
        with (
            contextlib.suppress(OSError, ValueError),
            _OPENER.open(f"{url}/v1/ping", timeout=2) as response,
        ):
            if json.load(response) == "pong":
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/v1/ping did not answer; see {log}")
        time.sleep(0.5)


def peer_isolation(home: Path) -> str:
    """What isolation the peer's calls had, from the configuration its server read."""
    config = yaml.safe_load((home / "src" / "sandbox" / "configs" / f"{PEER_CONFIG}.yaml").open())
    sandbox = config.get("sandbox", {})
    isolation = sandbox.get("isolation")
    user = "root" if os.geteuid() == 0 else "this user"
    if isolation == "none":
        uid = sandbox.get("set_uid")
        as_user = f"as uid {uid}" if uid else f"as the server's user ({user})"
        return (
            f"none (its `{PEER_CONFIG}` configuration, sandbox.isolation: none): each call is "
            f"`python FILE` under bash in a temporary directory in /tmp, {as_user}, with the "
            "host's network, filesystem and processes in reach, no memory limit (none asked), "
            "a 10 s time limit, no queue (every request runs at once); its `lite` mode "
            "(overlayfs of /, cgroups, network namespaces, through sudo: meant for a privileged "
            "container) was not used"
        )
    return f"sandbox.isolation: {isolation} (its `{PEER_CONFIG}` configuration)"


def our_isolation() -> str:
    if os.geteuid() == 0:
        return (
            "per executor: its own network, mount, PID, IPC and UTS namespaces and uid, a "
            "syscall filter; per call: a fresh process forked from a zygote, its own working "
            "directory, rlimits (512 MiB on top of the preloads, 32 processes, CPU), a 10 s "
            "time limit, queued for one of 4 executors"
        )
    return (
        "not root, so no namespaces or uids of its own; per call: a fresh process forked from "
        "a zygote, its own working directory, rlimits, a syscall filter, a 10 s time limit"
    )


def peer_versions(home: Path) -> str:
    """The peer's commit and the python/sympy its calls ran with."""
    commit = subprocess.run(
        ["git", "-C", str(home / "src"), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    runtime = subprocess.run(
        [
            str(home / "bin" / "python"),
            "-c",
            "import platform, sympy, fastapi, uvicorn; print(f'python {platform.python_version()}"
            ", sympy {sympy.__version__}, fastapi {fastapi.__version__}, uvicorn "
            "{uvicorn.__version__}')",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"SandboxFusion {commit or 'unknown commit'}, {runtime or 'runtime unknown'}"


# ----------------------------------------------------------------------------- load generation


@dataclass(frozen=True)
class Outcome:
    failure: str | None  # None: Success with the expected stdout
    run_seconds: float | None  # the server's own `run_result.execution_time`


@dataclass(frozen=True)
class Sample:
    started: float
    ended: float
    outcome: Outcome


Send = Callable[[], Awaitable[Outcome]]


def run_code_sender(session: aiohttp.ClientSession, url: str, workload: Workload) -> Send:
    """One `POST /run_code` of the workload's next call, its answer checked."""

    async def send() -> Outcome:
        code, expected = workload.next_call()
        try:
            async with session.post(url, json={"code": code, "language": "python"}) as response:
                status = response.status
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            return Outcome(f"HTTP request failed: {error!r}", None)
        try:
            answer = json.loads(body)
        except ValueError:
            return Outcome(f"HTTP {status}, not JSON: {body[:200]!r}", None)
        run = answer.get("run_result") if isinstance(answer, dict) else None
        run = run if isinstance(run, dict) else {}
        seconds = run.get("execution_time")
        run_seconds = float(seconds) if isinstance(seconds, int | float) else None
        if status != 200 or answer.get("status") != "Success" or run.get("stdout") != expected:
            stderr = str(run.get("stderr") or "")[-200:]
            return Outcome(
                f"HTTP {status} status={answer.get('status')!r} run={run.get('status')!r} "
                f"stdout={run.get('stdout')!r} stderr={stderr!r} "
                f"message={str(answer.get('message'))[:200]!r}",
                run_seconds,
            )
        return Outcome(None, run_seconds)

    return send


@dataclass
class Window:
    samples: list[Sample]
    start: float  # the end of the warm-up
    end: float


async def drive(send: Send, concurrency: int, seconds: float, warmup: float) -> Window:
    """`concurrency` loops send back to back; throughput is counted over a window after the
    warm-up of at least `seconds`, stretched until every loop has finished one request that it
    started inside the window, so that a server whose calls take longer than the window is
    still measured over whole calls. The loops keep sending until the window closes (the load
    stays at `concurrency` throughout); requests in flight then are awaited and checked."""
    loop = asyncio.get_running_loop()
    warm_until = loop.time() + warmup
    stop_at = warm_until + seconds
    samples: list[Sample] = []
    loops_unmeasured = concurrency
    all_measured_at = stop_at

    async def one_loop() -> None:
        nonlocal loops_unmeasured, all_measured_at
        measured = False
        while loop.time() < stop_at or loops_unmeasured:
            started = loop.time()
            outcome = await send()
            samples.append(Sample(started, loop.time(), outcome))
            if started >= warm_until and not measured:
                measured = True
                loops_unmeasured -= 1
                if not loops_unmeasured:
                    all_measured_at = loop.time()

    await asyncio.gather(*(one_loop() for _ in range(concurrency)))
    return Window(samples, warm_until, max(stop_at, all_measured_at))


class CallCpuMeter(CpuMeter):
    """CPU of the server's own processes, of the calls it ran (alive at either end, or reaped
    by the server or by its long-lived executors: SandboxFusion's calls are children of its
    server, kubestar's of its executors), of this client, and of everything else."""

    def _now(self) -> tuple[float, float, float, float]:
        own = sum(cpu_seconds(pid, with_children=False) for pid in self.server_pids)
        reaped = sum(cpu_seconds(pid, with_children=True) for pid in self.server_pids) - own
        descendants = sum(
            cpu_seconds(pid, with_children=True)
            for pid in process_tree(self.server_pids)
            if pid not in self.server_pids
        )
        usage = resource.getrusage(resource.RUSAGE_SELF)
        client = usage.ru_utime + usage.ru_stime
        return own, reaped + descendants, client, machine_busy_seconds()


@dataclass
class PeerResult:
    system: str
    workload: str
    concurrency: int
    requests: int  # all, warm-up included
    failures: int  # all, warm-up included
    window_seconds: float
    ok_per_second: float  # correct answers completed inside the window, per second
    p50_ms: float  # client-measured, over the requests started inside the window
    p99_ms: float
    run_p50_ms: float  # the server's own execution_time, same requests
    run_p99_ms: float
    peak_rss_mib: float
    server_cpu_percent: float
    calls_cpu_percent: float
    client_cpu_percent: float
    other_cpu_percent: float
    cpu_ms_per_call: float  # server + calls + client, per request
    failure_examples: list[str] = field(default_factory=list)


async def measure(
    system: str,
    workload: Workload,
    concurrency: int,
    send: Send,
    server_pids: list[int],
    seconds: float,
    warmup: float,
) -> PeerResult:
    with CallCpuMeter(server_pids) as cpu, Sampler(server_pids) as sampler:
        window = await drive(send, concurrency, seconds, warmup)
    samples = window.samples
    measured = [s for s in samples if window.start <= s.started < window.end]
    ok_in_window = sum(
        1 for s in samples if window.start <= s.ended <= window.end and s.outcome.failure is None
    )
    failed = [s.outcome.failure for s in samples if s.outcome.failure is not None]
    length = window.end - window.start
    ms = 1000.0
    run_seconds = [s.outcome.run_seconds for s in measured if s.outcome.run_seconds is not None]
    server_cpu, calls_cpu, client_cpu, other_cpu = cpu.percent
    return PeerResult(
        system=system,
        workload=workload.name,
        concurrency=concurrency,
        requests=len(samples),
        failures=len(failed),
        window_seconds=round(length, 3),
        ok_per_second=ok_in_window / length if length > 0 else 0.0,
        p50_ms=percentile([s.ended - s.started for s in measured], 50) * ms,
        p99_ms=percentile([s.ended - s.started for s in measured], 99) * ms,
        run_p50_ms=percentile(run_seconds, 50) * ms,
        run_p99_ms=percentile(run_seconds, 99) * ms,
        peak_rss_mib=sampler.peak_rss / MiB,
        server_cpu_percent=server_cpu,
        calls_cpu_percent=calls_cpu,
        client_cpu_percent=client_cpu,
        other_cpu_percent=other_cpu,
        cpu_ms_per_call=ms * cpu.seconds / len(samples) if samples else 0.0,
        failure_examples=[f[:300] for f in failed[:3]],
    )


# ----------------------------------------------------------------------------- reporting

COLUMNS = (
    f"{'system':<14} {'load':<4} {'conc':>4} {'reqs':>6} {'fail':>5} {'window s':>8} "
    f"{'ok/s':>8} {'p50 ms':>9} {'p99 ms':>9} {'run p50':>8} {'run p99':>8} {'RSS MiB':>8} "
    f"{'srv%':>5} {'call%':>5} {'cli%':>5} {'oth%':>5} {'cpu ms':>7}"
)


def row(r: PeerResult) -> str:
    return (
        f"{r.system:<14} {r.workload:<4} {r.concurrency:>4} {r.requests:>6} {r.failures:>5} "
        f"{fmt(r.window_seconds):>8} {fmt(r.ok_per_second):>8} {fmt(r.p50_ms, 1):>9} "
        f"{fmt(r.p99_ms, 1):>9} {fmt(r.run_p50_ms, 1):>8} {fmt(r.run_p99_ms, 1):>8} "
        f"{fmt(r.peak_rss_mib, 0):>8} {fmt(r.server_cpu_percent, 0):>5} "
        f"{fmt(r.calls_cpu_percent, 0):>5} {fmt(r.client_cpu_percent, 0):>5} "
        f"{fmt(r.other_cpu_percent, 0):>5} {fmt(r.cpu_ms_per_call, 2):>7}"
    )


LEGEND = """\
  ok/s: answers with status Success and the expected stdout that arrived inside the window
    (after the warm-up; at least the measured seconds, longer until each client loop has had
    one whole request inside it), per second.
  p50/p99 ms: client-measured latency of the requests started inside the window.
  run p50/p99: the server's own run_result.execution_time for those requests.
  fail: every request (warm-up included) not answered HTTP 200, Success, expected stdout.
  RSS MiB: peak RSS summed over the server and everything under it (calls included).
  srv%/call%/cli%/oth%: CPU of the server process / its executors and calls / this client /
    everything else on the machine, in % of one core (200% = both cores of 2).
  cpu ms: CPU of server + calls + client per request."""


def ratio(ours: float, theirs: float) -> str:
    if theirs <= 0:
        return "inf" if ours > 0 else "-"
    return f"{ours / theirs:,.1f}x"


def markdown(results: list[PeerResult], concurrencies: Sequence[int]) -> list[str]:
    """One line per workload: calls/s per concurrency on each side, the ratio, p99, failures."""
    by = {(r.system, r.workload, r.concurrency): r for r in results}
    cs = "/".join(f"c{c}" for c in concurrencies)
    lines = [
        f"| workload | ours {cs} calls/s | theirs {cs} calls/s | ratio ours/theirs {cs} | "
        f"p99 ms ours {cs} | p99 ms theirs {cs} | CPU ms a call ours / theirs (c{concurrencies[0]})"
        " | failures ours / theirs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload in dict.fromkeys(r.workload for r in results):
        ours = [by[(OURS, workload, c)] for c in concurrencies]
        theirs = [by[(THEIRS, workload, c)] for c in concurrencies]
        ratios = [
            ratio(o.ok_per_second, t.ok_per_second) for o, t in zip(ours, theirs, strict=True)
        ]
        lines.append(
            f"| {workload} "
            f"| {' / '.join(fmt(r.ok_per_second) for r in ours)} "
            f"| {' / '.join(fmt(r.ok_per_second) for r in theirs)} "
            f"| {' / '.join(ratios)} "
            f"| {' / '.join(fmt(r.p99_ms, 0) for r in ours)} "
            f"| {' / '.join(fmt(r.p99_ms, 0) for r in theirs)} "
            f"| {fmt(ours[0].cpu_ms_per_call, 1)} / {fmt(theirs[0].cpu_ms_per_call, 1)} "
            f"| {sum(r.failures for r in ours):,} of {sum(r.requests for r in ours):,} / "
            f"{sum(r.failures for r in theirs):,} of {sum(r.requests for r in theirs):,} |"
        )
    return lines


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute)")
    parser.add_argument("--seconds", type=float, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per run (default 1)")
    parser.add_argument(
        "--concurrency",
        help="client concurrencies, comma-separated (default 8,64; with --quick 8: "
        "SandboxFusion answers W3 at 64 only after tens of seconds, which no quick run fits)",
    )
    parser.add_argument(
        "--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3"
    )
    parser.add_argument(
        "--executors", type=int, default=4, help="kubestar's executors (as sandbox_bench)"
    )
    parser.add_argument(
        "--peer-home",
        type=Path,
        default=PEER_HOME,
        help=f"SandboxFusion's virtualenv with its checkout in src/ (default {PEER_HOME})",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write a JSON summary here")
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 1.5 if args.quick else 5.0
    if args.warmup is None:
        args.warmup = 0.5 if args.quick else 1.0
    if args.concurrency is None:
        args.concurrency = "8" if args.quick else "8,64"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


async def run_all(
    ours: Service, theirs: PeerServer, http_port: int, args: argparse.Namespace
) -> list[PeerResult]:
    workloads = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    systems = [
        (OURS, f"http://127.0.0.1:{http_port}/run_code", ours.pids),
        (THEIRS, f"{theirs.url}/run_code", theirs.pids),
    ]
    results: list[PeerResult] = []
    # No connection cap: the loops set the concurrency. The servers' own time limit is 10 s;
    # a queued call may wait longer than that for its answer.
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=600),
        trust_env=False,
    ) as session:
        for workload in workloads:
            for concurrency in args.concurrency:
                for system, url, pids in systems:
                    result = await measure(
                        system,
                        workload,
                        concurrency,
                        run_code_sender(session, url, workload),
                        pids,
                        args.seconds,
                        args.warmup,
                    )
                    print(row(result), flush=True)
                    results.append(result)
    return results


def main() -> int:
    args = parse_args()
    home: Path = args.peer_home
    if not (home / "bin" / "python").exists() or not (home / "src" / "sandbox").is_dir():
        print(f"peer_bench: SandboxFusion is not installed in {home}: {SETUP}", file=sys.stderr)
        return 2
    # Both servers without a token: SandboxFusion has none.
    for name in (ENV_TOKEN, ENV_TOKEN_FILE):
        os.environ.pop(name, None)
    env = environment()
    isolation = {OURS: our_isolation(), THEIRS: peer_isolation(home)}
    print("kubestar vs SandboxFusion: POST /run_code on the same calls")
    print(f"  commit     {env['commit']}")
    print(f"  date       {env['date']}")
    print(
        f"  machine    {env['usable_cpus']} usable CPUs ({env['host_cpus']} online), "
        f"{env['cpu_model']}, {env['memory_gib']} GiB, kernel {env['kernel']}, "
        f"root={env['running_as_root']}"
    )
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    print(f"  load       {' '.join(load_before)} (1/5/15 min) before the run")
    print(f"  ours       kubestar {env['versions']['kubestar']}, sympy {env['versions']['sympy']}")
    print(f"  theirs     {peer_versions(home)}")
    print(
        f"  settings   {args.seconds:g}s measured + {args.warmup:g}s warm-up per run, "
        f"concurrency {', '.join(map(str, args.concurrency))}, {args.executors} executors"
    )
    for system, text in isolation.items():
        print(f"  isolation  {system}: {text}")
    print(flush=True)

    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    http_port = free_port()
    ours = Service(
        "kubestar",
        args.executors,
        False,
        log_dir,
        serve_args=("--http-listen", f"127.0.0.1:{http_port}"),
    )
    theirs = PeerServer(home, log_dir)
    try:
        ours.start()
        wait_for_ping(
            f"http://127.0.0.1:{http_port}",
            lambda: all(p.poll() is None for p in ours.processes),
            log_dir,
        )
        theirs.start()
        print(COLUMNS, flush=True)
        results = asyncio.run(run_all(ours, theirs, http_port, args))
    finally:
        ours.stop()
        theirs.stop()

    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print()
    print(LEGEND)
    print()
    print(*markdown(results, args.concurrency), sep="\n")
    print()
    for system, text in isolation.items():
        print(f"isolation, {system}: {text}")
    failures = [r for r in results if r.failures]
    print(
        f"failures: {sum(r.failures for r in results)} in {sum(r.requests for r in results)} "
        "requests"
    )
    for r in failures:
        for example in r.failure_examples:
            print(f"  {r.system} {r.workload} c{r.concurrency}: {example}")
    print(f"load {' '.join(load_after)} (1/5/15 min) after the run; logs in {log_dir}")
    total = time.monotonic() - started
    print(f"total time {total:.0f}s")
    if args.json:
        summary = {
            "environment": env,
            "peer": peer_versions(home),
            "isolation": isolation,
            "load_before": load_before,
            "load_after": load_after,
            "settings": {
                "seconds": args.seconds,
                "warmup": args.warmup,
                "concurrency": args.concurrency,
                "executors": args.executors,
                "quick": args.quick,
            },
            "results": [asdict(r) for r in results],
            "total_seconds": round(total, 1),
        }
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"JSON summary written to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
