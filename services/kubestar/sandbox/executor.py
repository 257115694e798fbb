"""The worker's handle on one executor process (isolation.py, then zygote.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import marshal
import os
import re
import shutil
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

from kubestar.api.conditions import Reason
from kubestar.api.errors import KubestarError
from kubestar.sandbox import _forkserver, metrics
from kubestar.sandbox.limits import CallLimits, LimitPolicy
from kubestar.sandbox.zygote import HEADER_BYTES

# The zygote's call and answer headers (_forkserver.c; native byte order, same machine):
# timeout_seconds, memory_bytes, output_bytes, code bytes, stdin bytes; and wait status,
# flags, wall ms, CPU ms, stdout bytes, stderr bytes.
CALL_HEADER = struct.Struct("=dQQII")
ANSWER_HEADER = struct.Struct("=iIddII")
TIMED_OUT = _forkserver.ANSWER_TIMED_OUT
STDOUT_TRUNCATED = _forkserver.ANSWER_STDOUT_TRUNCATED
STDERR_TRUNCATED = _forkserver.ANSWER_STDERR_TRUNCATED
MEMORY_ERROR = _forkserver.ANSWER_MEMORY_ERROR

log = logging.getLogger(__name__)

# The only variables an executor inherits; the service's own environment (secrets, cluster
# credentials) never reaches it.
EXECUTOR_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
    # Resolve every symbol when the zygote starts, not lazily: a lazy binding first used in a
    # call is resolved (and its GOT page copied) again in every call (~14 faults, 6% of the
    # CPU of a light call). The calls themselves get a fresh environment (zygote.CALL_ENV).
    "LD_BIND_NOW": "1",
}
# How much longer than the call's own timeout the worker waits for the zygote's answer.
ANSWER_GRACE_SECONDS = 5.0
# Pods of one node share the kernel's counts per uid (RLIMIT_NPROC, message-queue bytes,
# pending signals): calls of two pods with the same uids would count against each other. A
# worker given a key (its pod's UID) takes a range of its own: UID_RANGE_SIZE uids (two per
# executor, at most 256 executors) at a slot the key's hash picks among the UID_RANGES slots
# between 2^20 and 2^31. Two pods of a node share a slot with probability n(n-1)/2 in 4.2
# million for n sandbox pods (1 in 93,000 for 10).
UID_RANGE_SIZE = 512
UID_RANGES_START = 1 << 20
UID_RANGES = ((1 << 31) - UID_RANGES_START) // UID_RANGE_SIZE


def uid_base_for(key: str) -> int:
    """The first uid of the range `key` (a pod's UID) picks."""
    slot = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % UID_RANGES
    return UID_RANGES_START + slot * UID_RANGE_SIZE


# What a zygote channel receives into; it grows for a large output and shrinks back after it.
CHANNEL_BUFFER_BYTES = 64 * 1024
START_TIMEOUT_SECONDS = 120.0


DEFAULT_WARMUP = """
import numpy, sympy
x, y = sympy.symbols("x y")
sympy.solve(x**2 - 5*x + 6, x)
sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2)
sympy.factorint(360); sympy.Rational(3, 4) + sympy.Rational(1, 6)
sympy.integrate(x**2, x); sympy.diff(sympy.exp(x) * x, x); sympy.expand((x + y)**3)
numpy.linalg.solve(numpy.eye(3), numpy.ones(3)); numpy.arange(10).sum()
"""


class ExecutorDied(RuntimeError):
    """The executor process went away while (or before) running a call."""


class IsolationUnavailable(KubestarError):
    """An executor could not set up the isolation its configuration asks for: the worker
    refuses to serve. The message names what is missing, which system call failed and why."""

    # How a worker's termination message starts (`kubestar sandbox serve --termination-log`),
    # so that the operator can name the cause in the SandboxPool's Ready condition.
    reason = Reason.ISOLATION_UNAVAILABLE

    def __init__(self, executor: str, missing: str) -> None:
        who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        super().__init__(
            f"sandbox isolation unavailable ({executor}, as {who}): {missing}; not serving "
            "without it (for development only: --no-isolation, or spec.isolation: Disabled "
            "in a SandboxPool)"
        )


@dataclass(frozen=True)
class ExecutorConfig:
    preload: tuple[str, ...] = ("numpy", "sympy")
    # Run once in each zygote after the imports: caches it fills are inherited by every call.
    warmup: str = DEFAULT_WARMUP
    # Beside each preloading zygote, a light one that imported nothing: a call on it costs
    # under half the CPU (a smaller address space to copy and tear down), and most tool calls of
    # a math policy (`print(123 * 456)`) never touch the preloaded modules. Calls that name
    # a preloaded module go to the preloading zygote. See `Executor.process_for`.
    light: bool = True
    isolation: bool = True
    # With isolation, calls run under the syscall filter (seccomp.py); off only to measure
    # what it costs, or to debug a call with tools it refuses (ptrace).
    syscall_filter: bool = True
    # First unprivileged uid; of a pool of N, executor i runs its calls as uid_base + i (only
    # as root), its light zygote as uid_base + N + i: 2N uids, none shared.
    uid_base: int = 61000
    hidden_paths: tuple[str, ...] = ()
    policy: LimitPolicy = field(default_factory=LimitPolicy)
    # Run executor i (and its calls) on usable CPU i mod n only. A fork-heavy executor that
    # stays on one CPU costs ~5% less CPU per call, and executors stop contending for the
    # same core. None: the pool decides (see ExecutorPool).
    pin_cpus: bool | None = None
    # Executors and their calls run this much nicer than the server: when the server's event
    # loop wakes (an answer to send, a call to hand out) it takes the CPU from a running call
    # at once instead of at the end of the call's time slice, and a CPU-bound call can never
    # starve the server (health checks, draining).
    nice: int = 5


class PendingCall:
    """A call sent to a zygote whose answer has not arrived yet."""

    __slots__ = ("answer", "deadline", "limits")

    def __init__(
        self,
        answer: asyncio.Future[dict[str, Any]],
        limits: CallLimits,
        deadline: asyncio.TimerHandle,
    ) -> None:
        self.answer = answer
        self.limits = limits
        self.deadline = deadline


class ZygoteChannel(asyncio.BufferedProtocol):
    """The worker's end of a zygote's control socket: first the zygote's ready message, then
    one answer per call, in order. A zygote runs one call at a time, so at most one is pending.

    A protocol rather than streams: the answer completes the call's future straight from
    `buffer_updated`, with no task, reader wake-up or timeout context per call (the server's
    event loop spends a good part of a small call's CPU on exactly those). Buffered: answers
    are received into one buffer that lives as long as the channel (a plain protocol gets a
    new 256 KiB bytes object per read: an mmap, an mremap and a munmap per call)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending: PendingCall | None = None
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(CHANNEL_BUFFER_BYTES)
        self._filled = 0
        self._closed_because = ""

    @property
    def open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def send(self, request: bytes, pending: PendingCall) -> None:
        assert self._transport is not None and self.pending is None
        self.pending = pending
        self._transport.write(request)

    def close(self, reason: str = "") -> None:
        if self._transport is not None:
            self._closed_because = reason
            self._transport.abort()  # connection_lost fails what is pending

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buffer) - self._filled < CHANNEL_BUFFER_BYTES // 4:  # a large output
            grown = bytearray(2 * len(self._buffer))
            grown[: self._filled] = self._buffer[: self._filled]
            self._buffer = grown
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if not self.ready.done() and not self._take_ready_message():
            return
        if self._filled < ANSWER_HEADER.size:
            return
        header = ANSWER_HEADER.unpack_from(self._buffer)
        end = ANSWER_HEADER.size + header[4] + header[5]
        if self._filled < end:
            return
        pending, self.pending = self.pending, None
        if pending is None or self._filled > end:
            self.close("it answered a call it was not given")  # no longer to be trusted
            return
        with memoryview(self._buffer) as view:
            output = bytes(view[ANSWER_HEADER.size : end])
        self._filled = 0
        if len(self._buffer) > CHANNEL_BUFFER_BYTES:
            self._buffer = bytearray(CHANNEL_BUFFER_BYTES)
        pending.deadline.cancel()
        if not pending.answer.done():
            answer = make_answer(header, output, pending.limits)
            answer["executor"] = self.name
            pending.answer.set_result(answer)

    def _take_ready_message(self) -> bool:
        if self._filled < HEADER_BYTES:
            return False
        end = HEADER_BYTES + int.from_bytes(self._buffer[:HEADER_BYTES], "big")
        if self._filled < end:
            return False
        self.ready.set_result(marshal.loads(self._buffer[HEADER_BYTES:end]))
        self._buffer[: self._filled - end] = self._buffer[end : self._filled]
        self._filled -= end
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        why = self._closed_because or (f"{exc!r}" if exc else "it closed its socket")
        died = ExecutorDied(f"{self.name} went away: {why}")
        if not self.ready.done():
            self.ready.set_exception(died)
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.deadline.cancel()
            if not pending.answer.done():
                pending.answer.set_exception(died)


class ZygoteProcess:
    """One zygote process (zygote.py) and the socket the worker talks to it over."""

    def __init__(
        self, name: str, config: ExecutorConfig, uid: int, cpu: int | None, light: bool
    ) -> None:
        self.name = name
        self.config = config
        self.uid = uid
        self.cpu = cpu
        self.light = light
        self.process: asyncio.subprocess.Process | None = None
        self.isolation: dict[str, Any] = {}
        # Bytes of the interpreter's code the zygote maps from huge pages (_forkserver.c).
        self.code_in_huge_pages = 0
        # The zygote's folder of calls on the shared /tmp ("" : on a private /tmp of its own).
        self.shared_work_root = ""
        self._channel: ZygoteChannel | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        policy = self.config.policy
        args = [
            sys.executable,
            "-m",
            "kubestar.sandbox.isolation",
            "--fd",
            str(theirs.fileno()),
            "--uid",
            str(self.uid),
            "--max-processes",
            str(policy.max_processes),
            "--max-file-bytes",
            str(policy.max_file_bytes),
            "--max-open-files",
            str(policy.max_open_files),
        ]
        if not self.light:
            args += ["--preload", ",".join(self.config.preload), "--warmup", self.config.warmup]
        if self.cpu is not None:
            args += ["--cpu", str(self.cpu)]
        if self.config.nice:
            args += ["--nice", str(self.config.nice)]
        for path in self.config.hidden_paths:
            args += ["--hide", path]
        if not self.config.isolation:
            args.append("--no-isolation")
        if not self.config.syscall_filter:
            args.append("--no-syscall-filter")
        env = dict(EXECUTOR_ENV)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.process = await asyncio.create_subprocess_exec(
            *args,
            pass_fds=[theirs.fileno()],
            env=env,
            cwd="/",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
        )
        theirs.close()
        loop = asyncio.get_running_loop()
        _, self._channel = await loop.create_connection(lambda: ZygoteChannel(self.name), sock=ours)
        ready = await asyncio.wait_for(self._channel.ready, START_TIMEOUT_SECONDS)
        if not ready["ready"]:
            await self.stop()
            raise IsolationUnavailable(self.name, ready["error"])
        self.isolation = ready["isolation"]
        self.code_in_huge_pages = ready["code_in_huge_pages"]
        self.shared_work_root = ready["shared_work_root"]

    def submit(self, code: str, stdin: str, limits: CallLimits) -> asyncio.Future[dict[str, Any]]:
        """Send one call; the future gets its answer (see `make_answer`), or ExecutorDied if the
        process is gone or does not answer in the call's timeout plus a grace period."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict[str, Any]] = loop.create_future()
        channel = self._channel
        if channel is None or not channel.open or channel.pending is not None:
            answer.set_exception(ExecutorDied(f"{self.name} is not running"))
            return answer
        source, given = code.encode(), stdin.encode()
        header = CALL_HEADER.pack(
            limits.timeout_seconds,
            limits.memory_bytes,
            limits.output_bytes,
            len(source),
            len(given),
        )
        wait = limits.timeout_seconds + ANSWER_GRACE_SECONDS
        deadline = loop.call_later(wait, channel.close, f"no answer within {wait:g}s")
        channel.send(header + source + given, PendingCall(answer, limits, deadline))
        return answer

    async def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        if self.shared_work_root:
            shutil.rmtree(self.shared_work_root, ignore_errors=True)
            self.shared_work_root = ""


def make_answer(header: tuple[Any, ...], output: bytes, limits: CallLimits) -> dict[str, Any]:
    """A call's answer from the zygote's answer header and output (see _forkserver.c)."""
    wait_status, flags, wall_ms, cpu_ms, stdout_bytes, _ = header
    exit_code = os.waitstatus_to_exitcode(wait_status)
    status, message = classify(exit_code, flags, cpu_ms, limits)
    return {
        "status": status,
        "message": message,
        "exit_code": exit_code,
        "stdout": output[:stdout_bytes],
        "stderr": output[stdout_bytes:],
        "stdout_truncated": bool(flags & STDOUT_TRUNCATED),
        "stderr_truncated": bool(flags & STDERR_TRUNCATED),
        "wall_ms": wall_ms,
        "cpu_ms": cpu_ms,
    }


def classify(exit_code: int, flags: int, cpu_ms: float, limits: CallLimits) -> tuple[str, str]:
    """A call's status and message from what the zygote saw (see _forkserver.c)."""
    if flags & TIMED_OUT:
        return "timeout", f"wall-clock limit of {limits.timeout_seconds:g}s passed"
    if flags & (STDOUT_TRUNCATED | STDERR_TRUNCATED):
        stream = "stdout" if flags & STDOUT_TRUNCATED else "stderr"
        return "output-limit", f"{stream} passed the output limit of {limits.output_bytes} bytes"
    if flags & MEMORY_ERROR:
        return "memory", "the memory limit was hit (MemoryError)"
    if exit_code == 0:
        return "ok", ""
    # The zygote sets RLIMIT_CPU to the timeout's whole seconds + 1 (SIGXCPU), and the hard
    # limit one second later (SIGKILL).
    cpu_limit_reached = cpu_ms >= (int(limits.timeout_seconds) + 1) * 1000.0
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_limit_reached):
        return "timeout", "CPU time limit passed"
    if exit_code == -signal.SIGXFSZ:
        return "error", "file size limit passed"
    if exit_code < 0:
        return "error", f"killed by signal {signal.Signals(-exit_code).name}"
    return "error", f"exited with code {exit_code}"


class Executor:
    """One slot of a worker's capacity: runs one call at a time, on its preloading zygote or,
    for calls that need none of the preloaded modules, on its light zygote."""

    def __init__(
        self, index: int, config: ExecutorConfig, name_prefix: str = "", pool_size: int = 1
    ) -> None:
        self.index = index
        self.config = config
        self.name = f"{name_prefix}executor-{index}"
        is_root = os.geteuid() == 0
        cpu = None
        if config.pin_cpus:
            cpus = sorted(os.sched_getaffinity(0))
            cpu = cpus[index % len(cpus)]
        self.zygote = ZygoteProcess(
            self.name, config, config.uid_base + index if is_root else 0, cpu, light=False
        )
        self.light: ZygoteProcess | None = None
        self._preloaded: re.Pattern[str] | None = None
        if config.light and config.preload:
            light_uid = config.uid_base + pool_size + index if is_root else 0
            self.light = ZygoteProcess(f"{self.name}/light", config, light_uid, cpu, light=True)
            roots = sorted({module.split(".")[0] for module in config.preload})
            self._preloaded = re.compile(r"\b(?:" + "|".join(map(re.escape, roots)) + r")\b")

    @property
    def pid(self) -> int | None:
        """The preloading zygote's process."""
        return self.zygote.pid

    @property
    def processes(self) -> list[ZygoteProcess]:
        return [self.zygote] if self.light is None else [self.zygote, self.light]

    @property
    def isolation(self) -> dict[str, Any]:
        return self.zygote.isolation

    def process_for(self, code: str) -> ZygoteProcess:
        """The light zygote unless the code names a preloaded module (in an import, or any
        other way: a false match only costs speed). Code that imports one by a computed name
        still works on the light zygote; it pays the import."""
        if self.light is None or (self._preloaded and self._preloaded.search(code)):
            return self.zygote
        return self.light

    async def start(self) -> None:
        # Both zygotes finish starting (or failing) before a failure is raised, so that
        # stopping the executor then stops every process it started.
        started = await asyncio.gather(
            *(process.start() for process in self.processes), return_exceptions=True
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome

    def submit(self, code: str, stdin: str, limits: CallLimits) -> asyncio.Future[dict[str, Any]]:
        """Send one call to the zygote it suits; its answer names that zygote (`executor`).
        The future fails with ExecutorDied if that zygote is gone or stops answering."""
        process = self.process_for(code)
        (metrics.LIGHT_CALLS if process.light else metrics.PRELOADED_CALLS).inc()
        return process.submit(code, stdin, limits)

    async def stop(self) -> None:
        await asyncio.gather(*(process.stop() for process in self.processes))
