"""A worker serves with the isolation its configuration asks for, or not at all.

Workers run here as sandbox pods run them: as a non-root uid, under a seccomp filter that
refuses new namespaces as container runtimes' default profiles do (tests.sandbox.unprivileged).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubestar.sandbox.client import SandboxClient
from kubestar.sandbox.isolation import ROOT_CAPABILITIES
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import (
    POD_UID,
    ServerProcess,
    descendants,
    process_alive,
    requires_root,
    unprivileged,
)

# Long enough for executors to start (no numpy or sympy); a worker still running then serves.
EXIT_WITHIN_SECONDS = 30.0


def wait_for_exit(server: ServerProcess) -> tuple[int, set[int]]:
    """The server's exit code, and every process it started on the way; fails the test if it
    is still running (serving) after EXIT_WITHIN_SECONDS."""
    started: set[int] = set()
    deadline = time.monotonic() + EXIT_WITHIN_SECONDS
    while (code := server.process.poll()) is None:
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"the worker did not refuse to serve; its log:\n{server.log()}")
        started.update(descendants(server.pid))
        time.sleep(0.02)
    return code, started


@pytest.mark.parametrize(
    ("options", "missing"),
    [
        (["--uid", POD_UID, "--deny-namespaces"], "user and network namespaces"),
        pytest.param(
            ["--deny-namespaces"],
            "network, mount, PID, IPC and UTS namespaces",
            marks=requires_root,
        ),
    ],
    ids=["non-root", "root"],
)
def test_a_worker_that_cannot_isolate_refuses_to_serve(
    log_dir: Path, tmp_path: Path, options: list[str], missing: str
) -> None:
    reason = refusal(log_dir, tmp_path, options)
    # Which isolation is missing, which system call failed, and why.
    assert missing in reason, reason
    assert "unshare(CLONE_NEW" in reason and "EPERM (Operation not permitted" in reason, reason
    assert "seccomp" in reason and "--no-isolation" in reason, reason


@pytest.mark.parametrize(
    ("options", "failed"),
    [
        (["--deny-seccomp"], "prctl(PR_SET_SECCOMP) failed: EPERM (Operation not permitted)"),
        (["--without-libseccomp"], "libseccomp.so.2 cannot be loaded"),
    ],
    ids=["seccomp-refused", "no-libseccomp"],
)
@pytest.mark.parametrize(
    "uid", [POD_UID, pytest.param(None, marks=requires_root)], ids=["non-root", "root"]
)
def test_a_worker_that_cannot_load_the_syscall_filter_refuses_to_serve(
    log_dir: Path, tmp_path: Path, options: list[str], failed: str, uid: str | None
) -> None:
    """Under a filter that refuses seccomp(), or with no libseccomp (an image without it), a
    worker gets its namespaces but not the calls' syscall filter: it does not serve."""
    reason = refusal(log_dir, tmp_path, [*(["--uid", uid] if uid else []), *options])
    assert f"syscall filter for calls: {failed}" in reason, reason
    assert "--no-isolation" in reason, reason


def refusal(log_dir: Path, tmp_path: Path, options: list[str]) -> str:
    """Starts a worker under `options` (tests.sandbox.unprivileged) and checks that it
    refuses to serve as it should; returns the one line that says why."""
    termination_log = tmp_path / "termination-log"
    server = ServerProcess(
        log_dir, "--termination-log", str(termination_log), prefix=unprivileged(*options)
    )
    code, started = wait_for_exit(server)
    log = server.log()
    assert code != 0, log
    assert "sandbox serving" not in log and "Traceback" not in log, log
    (error,) = [line for line in log.splitlines() if line.startswith("kubestar: error: ")]
    reason = error.removeprefix("kubestar: error: ")
    assert reason.startswith("sandbox isolation unavailable"), reason
    # What the kubelet passes on to the pod's status, and the operator to the condition.
    assert termination_log.read_text() == f"IsolationUnavailable: {reason}\n"
    # The executors that did start were stopped with the worker: a killed executor's own
    # children die of their parent's death, which may land a moment after the worker exits.
    deadline = time.monotonic() + EXIT_WITHIN_SECONDS
    while (alive := [pid for pid in started if process_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert alive == []
    return reason


@requires_root
def test_a_root_worker_missing_a_capability_it_needs_refuses_to_serve(
    log_dir: Path, tmp_path: Path
) -> None:
    """A container that drops CAP_KILL would start executors that die on their first call
    (they cannot kill what a call leaves behind): the worker names it and does not serve."""
    kept = [str(number) for number, name in ROOT_CAPABILITIES.items() if name != "CAP_KILL"]
    reason = refusal(log_dir, tmp_path, ["--capabilities", ",".join(kept)])
    assert "capabilities CAP_KILL: a worker running as root needs CAP_SYS_ADMIN" in reason, reason


def test_without_isolation_when_told(log_dir: Path) -> None:
    server = ServerProcess(
        log_dir, "--no-isolation", prefix=unprivileged("--uid", POD_UID, "--deny-namespaces")
    )
    try:
        server.wait_ready()
        with SandboxClient(server.endpoint, timeout=30) as client:
            result = client.execute("import os\nprint(os.geteuid())")
        assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, f"{POD_UID}\n")
        assert "sandbox isolation is off (--no-isolation)" in server.log()
    finally:
        server.stop()


def test_non_root_with_user_namespaces_keeps_calls_off_the_network(log_dir: Path) -> None:
    server = ServerProcess(log_dir, prefix=unprivileged("--uid", POD_UID))
    try:
        server.wait_ready()
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as error:\n"
            "    print(type(error).__name__)\n"
        )
        with SandboxClient(server.endpoint, timeout=30) as client:
            result = client.execute(code)
        assert result.status == pb.EXECUTION_STATUS_OK, result
        assert result.stdout != "connected\n", result
        assert "isolation is off" not in server.log()
    finally:
        server.stop()
