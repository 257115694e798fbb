"""Nothing a call starts outlives it, in every mode; a call cannot signal the worker or the
executors, and cannot reach another call's files.

Hostile calls go through real workers started as root, as pods run them (a non-root uid in a
user namespace, tests.sandbox.unprivileged) and, for what holds without isolation, as that
uid with --no-isolation.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.executor import UID_RANGE_SIZE, uid_base_for
from kubestar.sandbox.limits import LimitPolicy
from kubestar.v1 import sandbox_pb2 as pb

from tests.real_parts import require_root
from tests.sandbox.support import (
    WORKER_MODES,
    ServerProcess,
    assert_still_serving,
    descendants,
    scratch_dir,
    start_worker,
    wait_for,
)

OK = pb.EXECUTION_STATUS_OK
EXECUTORS = 2


def running(pids: set[int]) -> dict[int, str]:
    """The state letter (R, S, T for stopped, ...) of each pid still running."""
    states: dict[int, str] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            states[pid] = state
    return states


def worker_processes(server: ServerProcess) -> set[int]:
    """The worker and every process below it: its executors and whatever calls left."""
    return {server.pid, *descendants(server.pid)}


@pytest.fixture(scope="module", params=WORKER_MODES)
def worker(request: pytest.FixtureRequest, log_dir: Path) -> Iterator[ServerProcess]:
    server = start_worker(log_dir, str(request.param), executors=EXECUTORS)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["root", "non-root"])
def isolated_worker(request: pytest.FixtureRequest, log_dir: Path) -> Iterator[ServerProcess]:
    server = start_worker(log_dir, str(request.param), executors=EXECUTORS)
    yield server
    server.stop()


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = scratch_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


# A child that outlives the call's main process and ignores SIGTERM, its child in a session of
# its own (the child still lives), and a daemon (double fork, setsid); each reports on a pipe
# once it runs, so the call ends only when all of them do.
LEFTOVERS = """
import os, signal, time
ready, report = os.pipe()
def linger(name):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(report, name)
    while True:
        time.sleep(60)
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        linger(b"G")
    linger(b"C")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        linger(b"D")
    os._exit(0)
seen = b""
while len(seen) < 3:
    seen += os.read(ready, 3)
print(sorted(seen.decode()))
"""


def test_nothing_a_call_starts_outlives_it(worker: ServerProcess) -> None:
    with SandboxClient(worker.endpoint, timeout=60) as client:
        assert_still_serving(client)  # every executor started; nothing else runs
        before = worker_processes(worker)
        # Repeated: which leftover becomes the executor's child first varies from call to
        # call (an executor that waited for a grandchild not yet killed hung, restarted).
        for _ in range(20):
            result = client.execute(Call(code=LEFTOVERS, timeout_seconds=20))
            # Answered when its main process ended (OK, not TIMEOUT) ...
            assert (result.status, result.stdout) == (OK, "['C', 'D', 'G']\n"), result
            # ... by which time the three it left were killed and reaped, by the same
            # executors (none restarted).
            assert set(running(worker_processes(worker))) == before
        assert_still_serving(client)


SIGNALS = """
import os, signal
targets = [(1, signal.SIGKILL), (1, signal.SIGTERM), (1, signal.SIGSTOP), (1, signal.SIGINT),
           (os.getppid(), signal.SIGSTOP), (os.getppid(), signal.SIGKILL),
           ({worker}, signal.SIGKILL), (-1, signal.SIGSTOP), (-1, signal.SIGKILL)]
for pid, number in targets:
    try:
        os.kill(pid, number)
    except OSError as error:
        pass
print("still running")
"""


def assert_own_pid_namespace(client: SandboxClient) -> None:
    """Calls of both zygotes have a PID namespace of their own (their parent is its PID 1).
    Checked before anything hostile is sent: a call in the host's PID namespace reaches with
    kill(-1) every process of its uid on this machine (a non-root worker's uid is mapped to
    the tests' own), the tests' included."""
    for code in ("import os; print(os.getppid())", "import os, signal; print(os.getppid())"):
        result = client.execute(code)
        assert (result.status, result.stdout) == (OK, "1\n"), (
            f"calls share the host's PID namespace, so no signals are sent from them: {result}"
        )


def test_a_call_cannot_signal_the_worker_or_the_executors(isolated_worker: ServerProcess) -> None:
    with SandboxClient(isolated_worker.endpoint, timeout=60) as client:
        assert_own_pid_namespace(client)
        before = worker_processes(isolated_worker)
        code = SIGNALS.format(worker=isolated_worker.pid)
        results = client.execute_batch([code] * EXECUTORS)  # from every executor at once
        for result in results:
            assert (result.status, result.stdout) == (OK, "still running\n"), result
        # The worker and every executor process still run, none of them stopped ...
        states = running(before)
        assert set(states) == before
        assert "T" not in states.values(), states
        # ... and every zygote, light and preloading, still serves.
        for result in client.execute_batch(
            ["print('served')", "import signal; print('served')"] * EXECUTORS
        ):
            assert (result.status, result.stdout) == (OK, "served\n"), result


def test_a_call_cannot_reach_another_calls_files(
    isolated_worker: ServerProcess, scratch: Path
) -> None:
    token = secrets.token_hex(8)
    written, done = scratch / "written", scratch / "done"
    # Leaves a file in its directory and in /tmp, /var/tmp and /dev/shm, and holds them there
    # until the snooper has looked.
    writer = f"""
import os, time
for folder in (".", "/tmp", "/var/tmp", "/dev/shm"):
    with open(os.path.join(folder, "notes-{token}.txt"), "w") as handle:
        handle.write("{token}")
open({str(written)!r}, "w").close()
while not os.path.exists({str(done)!r}):
    time.sleep(0.01)
"""
    # Looks wherever another call's files could be: the temporary folders, the executors'
    # call directories, and every process's working directory and root that /proc shows.
    snooper = f"""
import glob, os
name = "notes-{token}.txt"
places = [os.path.join(top, name) for top in ("/tmp", "/var/tmp", "/dev/shm")]
places += glob.glob("/tmp/kubestar-calls*/*/" + name)
for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
    places.append(f"/proc/{{pid}}/cwd/" + name)
    places += [f"/proc/{{pid}}/root{{top}}/" + name for top in ("/tmp", "/var/tmp", "/dev/shm")]
found = []
for path in places:
    try:
        with open(path) as handle:
            if handle.read() == "{token}":
                found.append(path)
    except OSError:
        pass
print(found)
"""
    with (
        SandboxClient(isolated_worker.endpoint, timeout=60) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        first = pool.submit(client.execute, Call(code=writer, timeout_seconds=30))
        wait_for(lambda: written.exists() or first.done(), timeout=30)
        second = client.execute(snooper)  # on the other executor: the writer holds its own
        done.touch()
        first_result = first.result()
    for top in ("/tmp", "/var/tmp", "/dev/shm"):  # where a call without namespaces leaves it
        Path(top, f"notes-{token}.txt").unlink(missing_ok=True)
    assert first_result.status == OK, first_result
    assert (second.status, second.stdout) == (OK, "[]\n"), second
    assert second.executor != first_result.executor


# Leaves a System V shared memory segment, message queue and semaphore set behind: they
# live in the executor's IPC namespace, not in a directory that is emptied.
IPC_LEFTOVERS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
ids = [
    libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600),
    libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o000),
    libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600),
]
print(min(ids) >= 0)
"""
IPC_LISTING = """
rows = []
for kind in ("shm", "msg", "sem"):
    with open("/proc/sysvipc/" + kind) as table:
        rows += [kind + ": " + line.strip() for line in table.readlines()[1:]]
print(rows)
"""


def test_a_call_finds_no_ipc_objects_an_earlier_call_left(
    isolated_worker: ServerProcess,
) -> None:
    with SandboxClient(isolated_worker.endpoint, timeout=60) as client:
        left = client.execute(IPC_LEFTOVERS)
        assert (left.status, left.stdout) == (OK, "True\n"), left
        # The next calls of the same executor (and zygote), and of the others.
        listings = [client.execute(IPC_LISTING) for _ in range(4 * EXECUTORS)]
    same = [result for result in listings if result.executor == left.executor]
    assert same, [result.executor for result in listings]
    for result in listings:
        assert (result.status, result.stdout) == (OK, "[]\n"), result


def capabilities(pid: int) -> tuple[int, int]:
    """A process's effective and permitted capability sets."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["CapEff"], 16), int(fields["CapPrm"], 16)


def test_zygotes_give_up_cap_sys_admin_once_isolated(isolated_worker: ServerProcess) -> None:
    """CAP_SYS_ADMIN makes the namespaces and mounts; the zygotes that serve the calls hold
    it no longer (a root zygote keeps what it serves with: CAP_SETUID, CAP_KILL, ...), and
    still empty what calls leave (test_a_call_finds_no_ipc_objects_an_earlier_call_left)."""
    sys_admin, setuid = 1 << 21, 1 << 7
    zygotes = [
        pid
        for pid in worker_processes(isolated_worker)
        if b"zygote.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(zygotes) >= EXECUTORS, zygotes
    root = capabilities(isolated_worker.pid)[0] & sys_admin  # the worker keeps it
    for pid in zygotes:
        effective, permitted = capabilities(pid)
        assert not effective & sys_admin and not permitted & sys_admin, (pid, hex(permitted))
        if root:
            assert effective & setuid, (pid, hex(effective))


HOLD_EVERY_PROCESS = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except BlockingIOError:
        break
time.sleep(60)
"""
FORK_ONCE = """
import os
try:
    pid = os.fork()
except BlockingIOError:
    print("refused")
else:
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    print("forked", os.getuid())
"""


def processes_of(uids: range) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            real_uid = int(status.split("\nUid:\t", 1)[1].split()[0])
            count += real_uid in uids
    return count


def test_pods_count_their_calls_processes_apart(log_dir: Path) -> None:
    """The kernel counts processes per uid across the node: a call holding every process its
    limit allows starves the calls of another pod whose calls share its uids, and not those
    of a pod with a uid range of its own (--uid-range-key, the pod's UID)."""
    require_root("per-uid counts apart: the calls' uids are set only by a root worker")
    servers: list[ServerProcess] = []
    try:
        for key in ("pod-a", "pod-b", "pod-a"):
            servers.append(start_worker(log_dir, "root", "--uid-range-key", key, executors=1))
        holder, apart, shared = servers
        held_uids = range(uid_base_for("pod-a"), uid_base_for("pod-a") + UID_RANGE_SIZE)
        apart_uids = range(uid_base_for("pod-b"), uid_base_for("pod-b") + UID_RANGE_SIZE)
        with (
            ThreadPoolExecutor(1) as background,
            SandboxClient(holder.endpoint, timeout=60) as holding,
        ):
            held = background.submit(holding.execute, Call(HOLD_EVERY_PROCESS, timeout_seconds=4))
            limit = LimitPolicy().max_processes
            wait_for(lambda: processes_of(held_uids) >= limit, timeout=4)
            with SandboxClient(apart.endpoint, timeout=60) as client:
                answer = client.execute(FORK_ONCE).stdout.split()
            assert answer[0] == "forked" and int(answer[1]) in apart_uids, answer
            with SandboxClient(shared.endpoint, timeout=60) as client:
                assert client.execute(FORK_ONCE).stdout == "refused\n"
            assert held.result().status == pb.EXECUTION_STATUS_TIMEOUT
    finally:
        for server in servers:
            server.stop()
