"""Helpers of the sandbox tests: real servers, in this process or as separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kubestar.common.net import free_port, wait_serving
from kubestar.sandbox.client import SandboxClient
from kubestar.sandbox.executor import ExecutorConfig
from kubestar.sandbox.isolation import ROOT_CAPABILITIES
from kubestar.sandbox.limits import LimitPolicy
from kubestar.sandbox.pool import ExecutorPool
from kubestar.sandbox.server import SERVICE_NAME, SandboxServer, ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests import real_parts
from tests.real_parts import IS_ROOT, missing, require_root

T = TypeVar("T")

requires_root = real_parts.requires_root(
    "only as root does the sandbox get namespaces and a separate uid for calls"
)
REPO = Path(__file__).resolve().parents[2]
# The uid sandbox pods run as (the chart's default).
POD_UID = "65532"

# Calls run as an unprivileged uid that may not be able to read the interpreter's standard
# library (e.g. a pyenv Python under /root, mode 0700), so they can only use modules the
# executor imported before dropping privileges. Preload the few the tests' calls use; no
# numpy/sympy, so executors start in a fraction of a second.
TEST_PRELOAD: tuple[str, ...] = ("glob", "socket", "encodings.idna", "signal")

# Every server gets its own range of uids for its calls: RLIMIT_NPROC counts per uid, so
# servers (tests, benchmarks running beside them) must not share one.
_uid_bases = itertools.count(62000 + (os.getpid() % 64) * 64, 8)


def next_uid_base() -> int:
    return next(_uid_bases)


def executor_config(
    policy: LimitPolicy | None = None,
    preload: Sequence[str] = TEST_PRELOAD,
    hidden_paths: Sequence[str] = (),
) -> ExecutorConfig:
    return ExecutorConfig(
        preload=tuple(preload),
        warmup="",
        uid_base=next_uid_base(),
        hidden_paths=tuple(hidden_paths),
        policy=policy or LimitPolicy(),
    )


class ThreadedServer:
    """A SandboxServer in this process, on its own event loop in a background thread.

    Tests can then use the blocking client, or the async one on pytest's loop.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="sandbox-server", daemon=True
        )
        self._server: SandboxServer | None = None

    @property
    def server(self) -> SandboxServer:
        assert self._server is not None, "server not started"
        return self._server

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def start(self) -> ThreadedServer:
        self.thread.start()

        async def start() -> SandboxServer:
            server = SandboxServer(self.config)  # created on the loop that serves it
            await server.start()
            return server

        self._server = self.run(start(), timeout=120)
        return self

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the server's loop and wait for its value."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, grace_seconds: float = 2.0) -> None:
        async def shutdown(server: SandboxServer) -> None:
            await server.stop(grace_seconds)
            # As asyncio.run does: let every task left (gRPC's own included) finish cancelling.
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        try:
            if self._server is not None:
                self.run(shutdown(self._server), timeout=grace_seconds + 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first-level first), read from /proc."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(child) for child in handle.read().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def cli_command(*args: str) -> list[str]:
    """The `kubestar` command line, run with this interpreter."""
    return [sys.executable, "-m", "kubestar.cli.main", *args]


class ServerProcess:
    """`kubestar sandbox serve` in a separate process (own environment; can be killed)."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        executors: int = 2,
        preload: Sequence[str] = TEST_PRELOAD,
        worker: bool = True,
        port: int | None = None,
        terminal: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """`terminal`: a terminal device to start the server on, as its controlling
        terminal (as from an interactive shell). `prefix`: a command that runs the server
        (tests.sandbox.unprivileged)."""
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        command = [
            *prefix,
            *cli_command(
                "sandbox", "serve", "--listen", self.endpoint, "--log-level", "info", *args
            ),
        ]
        if worker:
            command += [
                "--executors",
                str(executors),
                "--preload",
                ",".join(preload),
                "--uid-base",
                str(next_uid_base()),
            ]
        self.log_path = Path(tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)[1])

        def on_terminal() -> None:
            assert terminal is not None
            os.setsid()
            os.close(os.open(terminal, os.O_RDWR))  # a session leader's first tty is its own

        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                preexec_fn=on_terminal if terminal else None,
            )
        self.pid = self.process.pid
        self._descendants: set[int] = set()

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        try:
            wait_serving(
                self.endpoint,
                self.process,
                what="sandbox server",
                timeout=timeout,
                service=SERVICE_NAME,
                interval=0.1,
            )
        except Exception:
            self.stop()
            raise RuntimeError(f"server did not start; its log:\n{self.log()}") from None
        self._descendants.update(descendants(self.pid))
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the server process itself (its executors are left to notice)."""
        self._descendants.update(descendants(self.pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """Graceful stop (SIGTERM); then SIGKILL, by pid, whatever it left behind."""
        if self.process.poll() is None:
            self._descendants.update(descendants(self.pid))
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self._descendants:
            if process_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def unprivileged(*options: str) -> list[str]:
    """The command prefix that runs a server with `options` (see tests.sandbox.unprivileged):
    as a pod runs it. Where this machine cannot do that the test is skipped (failed in CI)."""
    prefix = [sys.executable, "-m", "tests.sandbox.unprivileged", *options, "--"]
    probe = subprocess.run(
        [*prefix, "true"], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        missing(probe.stderr.strip() or f"{prefix} failed")
    return prefix


def pod_root(*options: str) -> list[str]:
    """The prefix that runs a server as the chart's worker pods run it: root with exactly the
    capabilities the operator grants the container (ROOT_CAPABILITIES), and no_new_privs."""
    return unprivileged("--capabilities", ",".join(map(str, ROOT_CAPABILITIES)), *options)


# How a worker runs: as root, as the chart's pods run it (namespaces, a uid per executor, only
# the capabilities the container is granted), as a non-root uid that makes a user namespace,
# or as that uid without isolation (development only).
WORKER_MODES = ("root", "non-root", "no-isolation")


def start_worker(
    log_dir: Path,
    mode: str,
    *args: str,
    preload: Sequence[str] = TEST_PRELOAD,
    executors: int = 2,
) -> ServerProcess:
    """`kubestar sandbox serve` (with `args`) started in `mode` (see WORKER_MODES), serving."""
    if mode == "root":
        require_root("a root worker needs the tests to run as root")
    prefix = pod_root() if mode == "root" else unprivileged("--uid", POD_UID)
    options = ("--no-isolation", *args) if mode == "no-isolation" else args
    server = ServerProcess(log_dir, *options, prefix=prefix, preload=preload, executors=executors)
    return server.wait_ready()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Until `condition()` holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def scratch_dir() -> Path:
    """A fresh directory calls can see and write (mode 1777), on the host's filesystem.

    Calls get private /tmp, /var/tmp and /dev/shm (as root, and not as root in a user
    namespace), so pytest's tmp_path is invisible to them; this lives elsewhere instead.
    """
    candidates = ["/var/lib", "/srv", "/opt"] if IS_ROOT else [str(Path.home()), str(REPO)]
    private = ("/tmp", "/var/tmp", "/dev/shm")
    for base in candidates:
        real = os.path.realpath(base)
        if any(real == top or real.startswith(top + "/") for top in private):
            continue
        if os.access(base, os.W_OK | os.X_OK):
            path = Path(tempfile.mkdtemp(prefix="kubestar-sandbox-test-", dir=base))
            path.chmod(0o1777)
            return path
    missing("no writable directory outside /tmp, /var/tmp and /dev/shm for files calls see")


def assert_still_serving(client: SandboxClient) -> None:
    """A normal call still succeeds (after something hostile or a failure)."""
    result = client.execute("print('still serving')")
    assert result.status == pb.EXECUTION_STATUS_OK, result
    assert result.stdout == "still serving\n"


def pool_of(threaded: ThreadedServer) -> ExecutorPool:
    backend = threaded.server.backend
    assert isinstance(backend, ExecutorPool)
    return backend


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def zygote_pids(pool: ExecutorPool) -> list[int]:
    """The processes that fork the calls: as root, PID 1 of each executor's namespace."""
    pids: list[int] = []
    for process in (process for executor in pool.executors for process in executor.processes):
        assert process.pid is not None
        if process.isolation.get("pid_namespace"):
            pids += children(process.pid)
        else:
            pids.append(process.pid)
    return pids


def leftover_processes(pool: ExecutorPool) -> list[int]:
    """Live processes below the zygotes, i.e. anything a finished call left running."""
    return [
        pid for zygote in zygote_pids(pool) for pid in descendants(zygote) if process_alive(pid)
    ]
