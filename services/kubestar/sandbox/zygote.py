"""The executor process: isolates itself once, pre-imports modules, forks one child per call.

Started by the worker as `python -m kubestar.sandbox.zygote` with a scrubbed environment and
one end of a socketpair. Isolation is paid once per executor, not per call:

- as root: new network, mount, PID, IPC and UTS namespaces. The zygote becomes PID 1 of its
  namespace, so after a call it can kill every process the call left behind with one
  `kill(-1)`; the call sees only its own processes in /proc, no network interfaces but a down
  loopback, and private empty tmpfs on /tmp, /var/tmp, /dev/shm and over secret paths.
  Each call runs as this executor's own unprivileged uid, so it cannot signal the zygote,
  read the service's environment or files, or touch another executor's calls.
- not root: a user + network namespace where the kernel allows it (no network), else nothing;
  the worker logs which isolation is active.

Per call (in the forked child): new session, fresh private working directory, scrubbed
environment, rlimits (CPU, address space, processes, file size, open files, no core dumps).
The zygote enforces the wall-clock timeout and the output caps and reaps everything.

Wire format on the control socket: 4-byte big-endian length + `marshal`-encoded dict.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import ctypes
import functools
import importlib
import marshal
import os
import resource
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 * 1024 * 1024
# The zygote's heap is re-collapsed into huge pages after these many calls, then every
# COLLAPSE_EVERY calls (see _collapse_heap).
COLLAPSE_AFTER = (1, 4, 16)
COLLAPSE_EVERY = 64

HEADER = struct.Struct(">I")
READ_CHUNK = 65536
LEFTOVER_GRACE_SECONDS = 0.05
# Paths that commonly hold credentials; hidden behind an empty tmpfs when they exist.
# Root's home holds kubeconfigs, cloud and SSH credentials; the others are Kubernetes' and
# Docker's secret mounts.
SECRET_PATHS = ("/var/run/secrets", "/run/secrets", "/root")
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
# A call's whole environment, with HOME and TMPDIR (its working directory) added per call.
# The zygote adopts it once before serving, so that a call only sets those two.
CALL_ENV = {
    "PATH": CHILD_PATH,
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = marshal.dumps(message)
    sock.sendall(HEADER.pack(len(payload)) + payload)


def receive_message(sock: socket.socket) -> dict[str, Any] | None:
    header = _receive_exactly(sock, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    payload = _receive_exactly(sock, length)
    if payload is None:
        return None
    message: dict[str, Any] = marshal.loads(payload)
    return message


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


class Isolation:
    """What this executor achieved; reported to the worker, which logs it."""

    def __init__(self) -> None:
        self.network = False
        self.pid_namespace = False
        self.mount_namespace = False
        self.separate_uid = False
        self.notes: list[str] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "pid_namespace": self.pid_namespace,
            "mount_namespace": self.mount_namespace,
            "separate_uid": self.separate_uid,
            "notes": self.notes,
        }


def isolate(uid: int, hidden_paths: list[str]) -> Isolation:
    """Enter namespaces. As root this forks: the caller continues as PID 1 of a new namespace."""
    isolation = Isolation()
    if os.geteuid() == 0:
        flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if _libc.unshare(flags) != 0:
            isolation.notes.append(f"unshare failed: {os.strerror(ctypes.get_errno())}")
        else:
            _become_namespace_init()
            isolation.network = True
            isolation.pid_namespace = True
            _setup_mounts(isolation, hidden_paths)
        isolation.separate_uid = uid > 0
        if not isolation.separate_uid:
            isolation.notes.append("no unprivileged uid configured: calls run as root")
        return isolation

    isolation.notes.append("not root: calls run as the service's uid")
    real_uid, real_gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        for path, text in (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"{real_uid} {real_uid} 1"),
            ("/proc/self/gid_map", f"{real_gid} {real_gid} 1"),
        ):
            with open(path, "w") as handle:
                handle.write(text)
        isolation.network = True
    else:
        isolation.notes.append(
            "user namespaces unavailable "
            f"({os.strerror(ctypes.get_errno())}): calls can reach the network"
        )
    # Orphans of a call re-parent to the zygote so it can reap and kill them.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    return isolation


def _become_namespace_init() -> None:
    """Fork after unshare(CLONE_NEWPID): the child is PID 1; the parent only relays its exit."""
    pid = os.fork()
    if pid == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return
    # The outer process: holds nothing, waits, and mirrors the inner zygote's fate.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _runtime_paths() -> list[str]:
    """Directories the calls' Python needs: its prefixes and import path (top-most only)."""
    candidates = {
        sys.base_prefix,
        sys.prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        *(p for p in sys.path if p),
    }
    paths = sorted(os.path.realpath(p) for p in candidates if os.path.isdir(p))
    top: list[str] = []
    for path in paths:
        if not any(path == kept or path.startswith(kept + "/") for kept in top):
            top.append(path)
    return top


def _cover(path: str, options: str, read_only: bool) -> None:
    """Mount an empty tmpfs over `path`, keeping the Python runtime inside it visible read-only.

    Hiding root's home (where kubeconfigs and cloud credentials live) or giving calls a private
    /tmp would otherwise also hide an interpreter or virtualenv installed there (pyenv under
    /root, a checkout under /tmp).
    """
    inside = [p for p in _runtime_paths() if p.startswith(path.rstrip("/") + "/")]
    # Hold the runtime directories open: once the tmpfs covers them, /proc/self/fd/N still
    # names them as bind-mount sources.
    handles = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in inside]
    try:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for runtime, handle in zip(inside, handles, strict=True):
            os.makedirs(runtime, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{handle}", runtime, None, MS_BIND | MS_REC, None)
            _mount("none", runtime, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
        if read_only:
            _mount("none", path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    finally:
        for handle in handles:
            os.close(handle)


@functools.cache
def _runtime_entries(directory: str) -> frozenset[str]:
    """Top-level entries of `directory` that lead to the Python runtime (kept between calls)."""
    prefix = directory.rstrip("/") + "/"
    return frozenset(
        prefix + p[len(prefix) :].split("/", 1)[0] for p in _runtime_paths() if p.startswith(prefix)
    )


def _setup_mounts(isolation: Isolation, hidden_paths: list[str]) -> None:
    try:
        # Nothing mounted here propagates back to the host.
        _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
        isolation.mount_namespace = True
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        for path in PRIVATE_TMPFS:
            if os.path.isdir(path):
                _cover(path, "size=256m,mode=1777", read_only=False)
        for path in [*SECRET_PATHS, *hidden_paths]:
            if os.path.isdir(path):
                _cover(path, "size=64k,mode=0755", read_only=True)
            elif os.path.isfile(path):
                _mount("/dev/null", path, None, MS_BIND, None)
    except OSError as error:
        isolation.notes.append(f"mount setup incomplete: {error}")


class Zygote:
    def __init__(
        self,
        sock: socket.socket,
        uid: int,
        gid: int,
        isolation: Isolation,
        max_processes: int,
        max_file_bytes: int,
        max_open_files: int,
    ) -> None:
        self.sock = sock
        self.uid = uid
        self.gid = gid
        self.isolation = isolation
        self.max_processes = max_processes
        self.max_file_bytes = max_file_bytes
        self.max_open_files = max_open_files
        self.is_root = os.geteuid() == 0
        self.work_root = "/tmp/kubestar-calls" if isolation.mount_namespace else None
        self.calls = 0
        self.baseline_vm_bytes = 0

    def serve(self) -> None:
        if self.work_root is None:
            import tempfile

            self.work_root = tempfile.mkdtemp(prefix="kubestar-calls-")
        os.makedirs(self.work_root, mode=0o711, exist_ok=True)
        # Pages of the pre-imported modules stay shared with every forked child.
        import gc

        # Scrubbing the environment once here rather than in each call saves ~0.3 ms a call.
        os.environ.clear()
        os.environ.update(CALL_ENV)
        # The first compile() of a process is slow (~1 ms): pay it here, not in every call.
        compile("pass", "<zygote>", "exec")
        gc.collect()
        gc.freeze()
        self.baseline_vm_bytes = _virtual_memory_bytes()
        send_message(
            self.sock,
            {
                "ready": True,
                "isolation": self.isolation.as_dict(),
                "baseline_vm_bytes": self.baseline_vm_bytes,
                "pid": os.getpid(),
            },
        )
        while True:
            request = receive_message(self.sock)
            if request is None:
                return
            send_message(self.sock, self.run_call(request))
            if self.calls in COLLAPSE_AFTER or self.calls % COLLAPSE_EVERY == 0:
                _collapse_heap()

    def run_call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        assert self.work_root is not None
        workdir = os.path.join(self.work_root, f"call-{self.calls}")
        os.mkdir(workdir, 0o700)
        if self.is_root and self.uid:
            os.chown(workdir, self.uid, self.gid)
        try:
            return self._run_in_child(request, workdir)
        finally:
            self._kill_leftovers()
            try:
                os.rmdir(workdir)  # most calls write no files: one syscall
            except OSError:
                shutil.rmtree(workdir, ignore_errors=True)
            if self.isolation.mount_namespace:
                for path in PRIVATE_TMPFS:
                    _empty_directory(path, keep={self.work_root, *_runtime_entries(path)})

    def _run_in_child(self, request: dict[str, Any], workdir: str) -> dict[str, Any]:
        timeout = float(request["timeout_seconds"])
        output_cap = int(request["output_bytes"])
        stdin_fd = -1
        if request.get("stdin"):
            stdin_fd = os.memfd_create("stdin", 0)
            os.write(stdin_fd, request["stdin"].encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        report_read, report_write = os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which never returns
            self._child(request, workdir, stdin_fd, out_write, err_write, report_write)
        for fd in (out_write, err_write, report_write):
            os.close(fd)
        if stdin_fd >= 0:
            os.close(stdin_fd)

        status, message = "", ""
        captured = {out_read: bytearray(), err_read: bytearray()}
        truncated = {out_read: False, err_read: False}
        pidfd = os.pidfd_open(pid)
        selector = selectors.DefaultSelector()
        for fd in (out_read, err_read, pidfd):
            selector.register(fd, selectors.EVENT_READ)
        deadline = started + timeout
        child_exited = False
        try:
            open_pipes = 2
            # Until the call's main process exited and its pipes closed: a call that closes
            # (or redirects) its stdout and stderr goes on running until it exits.
            while open_pipes or not child_exited:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if child_exited:  # leftovers still hold the pipes: stop listening
                        break
                    status = "timeout"
                    message = f"wall-clock limit of {timeout:g}s passed"
                    break
                for key, _ in selector.select(remaining):
                    fd = key.fd
                    if fd == pidfd:
                        # The call's main process is gone; leftovers holding the pipes get
                        # a short grace to flush, then are killed with the rest.
                        child_exited = True
                        selector.unregister(pidfd)
                        deadline = min(deadline, time.monotonic() + LEFTOVER_GRACE_SECONDS)
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    if not chunk:
                        selector.unregister(fd)
                        open_pipes -= 1
                        continue
                    buffer = captured[fd]
                    room = output_cap - len(buffer)
                    buffer += chunk[:room]
                    if len(chunk) > room:
                        truncated[fd] = True
                if any(truncated.values()):
                    status = "output-limit"
                    stream = "stdout" if truncated[out_read] else "stderr"
                    message = f"{stream} passed the output limit of {output_cap} bytes"
                    break
        finally:
            selector.close()
            if not child_exited or status:
                _kill_quietly(-pid)  # the call's process group
                _kill_quietly(pid)
            _, wait_status, usage = os.wait4(pid, 0)
            os.close(pidfd)
            for fd in (out_read, err_read):
                os.close(fd)
        wall_ms = (time.monotonic() - started) * 1000.0
        cpu_ms = (usage.ru_utime + usage.ru_stime) * 1000.0
        os.set_blocking(report_read, False)  # leftovers may still hold its write end
        try:
            report = os.read(report_read, 16)
        except BlockingIOError:
            report = b""
        os.close(report_read)
        exit_code = os.waitstatus_to_exitcode(wait_status)
        if not status:
            status, message = _classify(exit_code, report, cpu_ms, timeout)
        return {
            "status": status,
            "message": message,
            "exit_code": exit_code,
            "stdout": bytes(captured[out_read]),
            "stderr": bytes(captured[err_read]),
            "stdout_truncated": truncated[out_read],
            "stderr_truncated": truncated[err_read],
            "wall_ms": wall_ms,
            "cpu_ms": cpu_ms,
        }

    def _child(
        self,
        request: dict[str, Any],
        workdir: str,
        stdin_fd: int,
        out_write: int,
        err_write: int,
        report_write: int,
    ) -> None:
        exit_code = 1
        try:
            os.setsid()
            if stdin_fd < 0:
                stdin_fd = os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin_fd, 0)
            os.dup2(out_write, 1)
            os.dup2(err_write, 2)
            report = os.dup2(report_write, 3)
            os.closerange(4, 65536)
            os.chdir(workdir)
            timeout = float(request["timeout_seconds"])
            cpu_seconds = int(timeout) + 1
            limits = [
                (resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1)),
                (resource.RLIMIT_AS, (self.baseline_vm_bytes + int(request["memory_bytes"]),) * 2),
                (resource.RLIMIT_FSIZE, (self.max_file_bytes,) * 2),
                (resource.RLIMIT_NOFILE, (self.max_open_files,) * 2),
                (resource.RLIMIT_CORE, (0, 0)),
            ]
            if (self.is_root and self.uid) or not self.is_root:
                # Counted per uid: only meaningful when the uid is the call's own.
                limits.append((resource.RLIMIT_NPROC, (self.max_processes,) * 2))
            for which, value in limits:
                resource.setrlimit(which, value)
            if self.is_root and self.uid:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
            # The zygote's environment is CALL_ENV already (see serve).
            os.environ["HOME"] = workdir
            os.environ["TMPDIR"] = workdir
            sys.argv = ["<tool_call>"]
            sys.path = [workdir, *[p for p in sys.path if p]]
            code = compile(request["code"], "<tool_call>", "exec")
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            exit_code = 0
            try:
                exec(code, namespace)
            except SystemExit as stop:
                exit_code = _system_exit_code(stop)
            except MemoryError as error:
                os.write(report, b"M")
                _print_user_traceback(error)
                exit_code = 1
            except BaseException as error:
                _print_user_traceback(error)
                exit_code = 1
        except BaseException:
            traceback.print_exc()
            exit_code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                pass
            os._exit(exit_code)

    def _kill_leftovers(self) -> None:
        """Kill and reap every process a call left behind (background jobs, daemons)."""
        if not _has_children():
            return
        if self.isolation.pid_namespace:
            _kill_quietly(-1)  # as PID 1: everything else in this namespace
        else:
            for pid in _children_of(os.getpid()):
                _kill_quietly(-pid)
                _kill_quietly(pid)
        while True:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                return


def _classify(exit_code: int, report: bytes, cpu_ms: float, timeout: float) -> tuple[str, str]:
    if b"M" in report:
        return "memory", "the memory limit was hit (MemoryError)"
    if exit_code == 0:
        return "ok", ""
    cpu_limit_reached = cpu_ms >= (int(timeout) + 1) * 1000.0
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_limit_reached):
        return "timeout", "CPU time limit passed"
    if exit_code == -signal.SIGXFSZ:
        return "error", "file size limit passed"
    if exit_code < 0:
        return "error", f"killed by signal {signal.Signals(-exit_code).name}"
    return "error", f"exited with code {exit_code}"


def _system_exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _print_user_traceback(error: BaseException) -> None:
    # Drop the zygote's own frame so the traceback starts at the tool call's code.
    tb = error.__traceback__.tb_next if error.__traceback__ else None
    traceback.print_exception(type(error), error, tb)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _has_children() -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)  # may reap one zombie; any child at all means leftovers
    except ChildProcessError:
        return False
    return True


def _children_of(parent: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(entry))
    return children


def _empty_directory(path: str, keep: set[str]) -> None:
    try:
        entries = os.listdir(path)
    except OSError:
        return
    for entry in entries:
        full = os.path.join(path, entry)
        if full in keep:
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(full)


def _collapse_heap() -> None:
    """Map the heap with huge pages again, so that forking a call stays cheap.

    fork() copies one page-table entry per 4 KiB page but one per 2 MiB huge page, and the
    call's exit unmaps as many. The pre-imported heap starts on huge pages
    (glibc.malloc.hugetlb=1), but each huge page the zygote writes while a call is running is
    split into 4 KiB entries for good: within a few calls most of the heap is split and a
    fork+exit costs about twice as much. MADV_COLLAPSE (Linux 6.1+) merges them back; it
    copies at most the heap (a few ms), so it runs now and then between calls. Best effort:
    an older kernel just says EINVAL.
    """
    try:
        with open("/proc/self/maps") as handle:
            lines = handle.readlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue  # only private anonymous memory: the heap and malloc's mmapped chunks
        start, end = (int(value, 16) for value in fields[0].split("-"))
        start = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end &= ~(HUGE_PAGE - 1)
        if end - start >= HUGE_PAGE:
            _libc.madvise(start, end - start, MADV_COLLAPSE)


def _virtual_memory_bytes() -> int:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[0])
    return pages * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="control socket file descriptor")
    parser.add_argument("--uid", type=int, default=0, help="unprivileged uid for calls (as root)")
    parser.add_argument("--preload", default="", help="comma-separated modules to pre-import")
    parser.add_argument("--warmup", default="", help="code run once after the imports")
    parser.add_argument("--hide", action="append", default=[], help="extra path to hide")
    parser.add_argument("--no-isolation", action="store_true")
    parser.add_argument("--max-processes", type=int, default=32)
    parser.add_argument("--max-file-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--max-open-files", type=int, default=256)
    parser.add_argument("--cpu", type=int, default=-1, help="run (with all calls) on this CPU")
    args = parser.parse_args()
    if args.cpu >= 0:
        with contextlib.suppress(OSError):  # a CPU gone offline: run anywhere
            os.sched_setaffinity(0, {args.cpu})

    sock = socket.socket(fileno=args.fd)
    if args.no_isolation:
        isolation = Isolation()
        isolation.notes.append("isolation disabled by configuration")
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    else:
        isolation = isolate(args.uid, args.hide)
    for module in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(module)
        except ImportError as error:
            isolation.notes.append(f"could not pre-import {module}: {error}")
    if args.warmup:
        try:
            exec(compile(args.warmup, "<warmup>", "exec"), {"__name__": "__warmup__"})
        except Exception as error:
            isolation.notes.append(f"warm-up failed: {error!r}")
    Zygote(
        sock,
        uid=args.uid,
        gid=args.uid,
        isolation=isolation,
        max_processes=args.max_processes,
        max_file_bytes=args.max_file_bytes,
        max_open_files=args.max_open_files,
    ).serve()


if __name__ == "__main__":
    main()
