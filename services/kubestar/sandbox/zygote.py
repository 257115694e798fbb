"""The executor process, part two: the zygote. Pre-imports modules, forks one child per call.

Exec'd by isolation.py inside the namespaces it set up, as
`python [-S] zygote.py FD SETTINGS` (SETTINGS: marshal-encoded dict, hex). Runs as a script and
imports nothing but the few standard modules below: every page of this process is paid for by
each call three times (the fork copies its page-table entry, the call's exit drops it, and the
zygote's first write to it after a fork is a fault), so the zygote that imports nothing (the
light one, started with -S) stays about as small as an interpreter can be, and the serving
loop does as little as it can between the fork and the call's exit.

Per call (in the forked child): own process group, fresh private working directory, scrubbed
environment, rlimits (CPU, address space, processes, file size, open files, no core dumps),
the executor's unprivileged uid. The zygote enforces the wall-clock timeout and the output
caps and reaps everything.

Wire format on the control socket: 4-byte big-endian length + `marshal`-encoded dict.
"""

from __future__ import annotations

import builtins
import gc
import marshal
import os
import resource
import select
import signal
import sys
import time
import warnings

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and its 30 modules)
if TYPE_CHECKING:
    from types import CodeType
    from typing import Any

READ_CHUNK = 65536
LEFTOVER_GRACE_SECONDS = 0.05
WORK_ROOT = "/tmp/kubestar-calls"
# A call's whole environment, with HOME and TMPDIR (its working directory) added per call.
CALL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
HEADER_BYTES = 4
# Code up to this size is compiled by the zygote before the fork: compiling in the child costs
# it ~100 page faults (~0.25 ms), and compile() is bounded for small sources (nesting limits,
# capped constant folding; ~2 ms for 8 KB). Larger code, and code that fails or warns, is
# compiled in the child, which reports the error or warning as the call's own.
ZYGOTE_COMPILE_LIMIT = 8192
POLL_READ = select.POLLIN | select.POLLHUP | select.POLLERR
MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 * 1024 * 1024
# The preloading zygote's heap is re-collapsed into huge pages after these many calls, then
# every COLLAPSE_EVERY calls (see _collapse_heap).
COLLAPSE_AFTER = (1, 4, 16)
COLLAPSE_EVERY = 64


def encode_message(message: dict[str, Any]) -> bytes:
    payload = marshal.dumps(message)
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = os.read(fd, size)
    while 0 < len(data) < size:
        more = os.read(fd, size - len(data))
        if not more:
            return None
        data += more
    return data if len(data) == size else None


def receive_message(fd: int) -> dict[str, Any] | None:
    header = _read_exactly(fd, HEADER_BYTES)
    if header is None:
        return None
    payload = _read_exactly(fd, int.from_bytes(header, "big"))
    if payload is None:
        return None
    message: dict[str, Any] = marshal.loads(payload)
    return message


def send_message(fd: int, message: dict[str, Any]) -> None:
    data = encode_message(message)
    while data:
        data = data[os.write(fd, data) :]


class Zygote:
    def __init__(self, fd: int, settings: dict[str, Any]) -> None:
        self.fd = fd
        self.uid: int = settings["uid"]
        self.isolation: dict[str, Any] = settings["isolation"]
        self.preloaded = bool(settings["preload"])
        self.private_tmpfs: dict[str, set[str]] = {
            path: {WORK_ROOT, *keep} for path, keep in settings["private_tmpfs"].items()
        }
        self.is_root = os.geteuid() == 0
        # Calls run as their own uid only as root; not as root they run as the service's uid.
        self.call_uid = self.uid if self.is_root and self.uid else 0
        self.work_root = WORK_ROOT if self.isolation["mount_namespace"] else ""
        self.calls = 0
        self.fixed_limits = [
            (resource.RLIMIT_FSIZE, (settings["max_file_bytes"],) * 2),
            (resource.RLIMIT_NOFILE, (settings["max_open_files"],) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if self.call_uid or not self.is_root:
            # Counted per uid: only meaningful when the uid is the call's own.
            self.fixed_limits.append((resource.RLIMIT_NPROC, (settings["max_processes"],) * 2))
        self.baseline_vm_bytes = 0
        self.poller = select.poll()

    def serve(self) -> None:
        if not self.work_root:
            import tempfile

            self.work_root = tempfile.mkdtemp(prefix="kubestar-calls-")
        os.makedirs(self.work_root, mode=0o711, exist_ok=True)
        os.environ.clear()
        os.environ.update(CALL_ENV)
        sys.argv = ["<tool_call>"]
        # Slot 0 of the import path is each call's working directory (set before each fork).
        sys.path.insert(0, self.work_root)
        # The first compile() of a process is slow (~1 ms): pay it here, not in every call.
        compile("pass", "<zygote>", "exec")
        # Pages of the pre-imported modules stay shared with every forked child.
        gc.collect()
        gc.freeze()
        self.baseline_vm_bytes = _virtual_memory_bytes()
        send_message(
            self.fd,
            {
                "ready": True,
                "isolation": self.isolation,
                "baseline_vm_bytes": self.baseline_vm_bytes,
                "pid": os.getpid(),
            },
        )
        while True:
            request = receive_message(self.fd)
            if request is None:
                return
            send_message(self.fd, self.run_call(request))
            if self.preloaded and (
                self.calls in COLLAPSE_AFTER or self.calls % COLLAPSE_EVERY == 0
            ):
                _collapse_heap()

    def run_call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        workdir = f"{self.work_root}/call-{self.calls}"
        os.mkdir(workdir, 0o700)
        if self.call_uid:
            os.chown(workdir, self.call_uid, self.call_uid)
        # Set here, before the fork, so that the child inherits them instead of paying for them.
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        sys.path[0] = workdir
        try:
            return self._run_in_child(request, workdir)
        finally:
            self._kill_leftovers()
            try:
                os.rmdir(workdir)  # most calls write no files: one syscall
            except OSError:
                _remove_tree(workdir)
            for path, keep in self.private_tmpfs.items():
                _empty_directory(path, keep)

    def _run_in_child(self, request: dict[str, Any], workdir: str) -> dict[str, Any]:
        timeout = float(request["timeout_seconds"])
        output_cap = int(request["output_bytes"])
        cpu_seconds = int(timeout) + 1
        limits = [
            (resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1)),
            (resource.RLIMIT_AS, (self.baseline_vm_bytes + int(request["memory_bytes"]),) * 2),
            *self.fixed_limits,
        ]
        stdin_fd = -1
        if request.get("stdin"):
            stdin_fd = os.memfd_create("stdin", 0)
            os.write(stdin_fd, request["stdin"].encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        report_read, report_write = os.pipe()
        started = time.monotonic()
        code: str = request["code"]
        compiled = _compile_quietly(code) if len(code) <= ZYGOTE_COMPILE_LIMIT else None
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which never returns
            self._child(
                compiled or code, limits, workdir, stdin_fd, out_write, err_write, report_write
            )
        for fd in (out_write, err_write, report_write):
            os.close(fd)
        if stdin_fd >= 0:
            os.close(stdin_fd)

        status, message = "", ""
        stdout, stderr = bytearray(), bytearray()
        stdout_truncated = stderr_truncated = False
        pidfd = os.pidfd_open(pid)
        poller = self.poller
        for fd in (out_read, err_read, pidfd):
            poller.register(fd, POLL_READ)
        deadline = started + timeout
        child_exited = False
        open_pipes = 2
        try:
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
                for fd, _ in poller.poll(remaining * 1000.0):
                    if fd == pidfd:
                        # The call's main process is gone; leftovers holding the pipes get
                        # a short grace to flush, then are killed with the rest.
                        child_exited = True
                        poller.unregister(pidfd)
                        deadline = min(deadline, time.monotonic() + LEFTOVER_GRACE_SECONDS)
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    if not chunk:
                        poller.unregister(fd)
                        open_pipes -= 1
                        continue
                    buffer = stdout if fd == out_read else stderr
                    room = output_cap - len(buffer)
                    buffer += chunk[:room]
                    if len(chunk) > room:
                        if fd == out_read:
                            stdout_truncated = True
                        else:
                            stderr_truncated = True
                if stdout_truncated or stderr_truncated:
                    status = "output-limit"
                    stream = "stdout" if stdout_truncated else "stderr"
                    message = f"{stream} passed the output limit of {output_cap} bytes"
                    break
        finally:
            for fd in (out_read, err_read, pidfd):
                try:
                    poller.unregister(fd)
                except KeyError:
                    pass
            if not child_exited or status:
                _kill_quietly(-pid)  # the call's process group
                _kill_quietly(pid)
            _, wait_status, usage = os.wait4(pid, 0)
            for fd in (pidfd, out_read, err_read):
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
            "stdout": bytes(stdout),
            "stderr": bytes(stderr),
            "stdout_truncated": stdout_truncated,
            "stderr_truncated": stderr_truncated,
            "wall_ms": wall_ms,
            "cpu_ms": cpu_ms,
        }

    def _child(
        self,
        code: str | CodeType,
        limits: list[tuple[int, tuple[int, int]]],
        workdir: str,
        stdin_fd: int,
        out_write: int,
        err_write: int,
        report_write: int,
    ) -> None:
        exit_code = 1
        try:
            # A process group of its own (the timeout kills the group), not a session: with
            # the kernel's autogroup scheduling every new session is a new scheduling group,
            # and a call in a group born a moment ago sat runnable for 0.1-1 s while other
            # calls ran (at c64 ~0.5% of calls); in the executor's session it runs at the
            # executor's nice level, as intended.
            os.setpgid(0, 0)
            os.dup2(stdin_fd if stdin_fd >= 0 else os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out_write, 1)
            os.dup2(err_write, 2)
            report = os.dup2(report_write, 3)
            os.closerange(4, 65536)
            os.chdir(workdir)
            for which, value in limits:
                resource.setrlimit(which, value)
            if self.call_uid:
                os.setgroups([])
                os.setgid(self.call_uid)
                os.setuid(self.call_uid)
            compiled = compile(code, "<tool_call>", "exec") if isinstance(code, str) else code
            exit_code = 0
            try:
                exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
            except SystemExit as stop:
                exit_code = _system_exit_code(stop)
            except MemoryError as error:
                os.write(report, b"M")
                _print_user_traceback(error)
                exit_code = 1
            except BaseException as error:
                _print_user_traceback(error)
                exit_code = 1
        except BaseException as error:
            sys.__excepthook__(type(error), error, error.__traceback__)
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
        if self.isolation["pid_namespace"]:
            _kill_quietly(-1)  # as PID 1: everything else in this namespace
        else:
            for pid in _children_of(os.getpid()):
                _kill_quietly(-pid)
                _kill_quietly(pid)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return


def _compile_quietly(code: str) -> CodeType | None:
    """The call's code compiled here, or None if compiling it fails or warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning becomes SyntaxError: the child shows it
        try:
            return compile(code, "<tool_call>", "exec")
        except Exception:
            return None


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
    # Drop the zygote's own frame so the traceback starts at the tool call's code. The
    # interpreter's own printer: the traceback module is not imported here (see the top).
    tb = error.__traceback__.tb_next if error.__traceback__ else None
    sys.__excepthook__(type(error), error.with_traceback(tb), tb)


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def _remove_tree(path: str) -> None:
    """shutil.rmtree without importing shutil; never follows symlinks out of `path`."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        entries = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _empty_directory(path: str, keep: set[str]) -> None:
    try:
        entries = os.listdir(path)
    except OSError:
        return
    for entry in entries:
        full = f"{path}/{entry}"
        if full in keep:
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            _remove_tree(full)
        else:
            try:
                os.unlink(full)
            except OSError:
                pass


def _collapse_heap() -> None:
    """Map the heap with huge pages, so that forking a call stays cheap.

    fork() copies one page-table entry per 4 KiB page but one per 2 MiB huge page, and the
    call's exit unmaps as many. MADV_COLLAPSE (Linux 6.1+) merges the preloading zygote's
    heap (Python's arenas, malloc's heap) into huge pages; each huge page the zygote writes
    while a call is running is split again, so this runs after a few calls and then now and
    then (it copies at most the heap, a few ms). Measured with numpy and sympy loaded: the
    zygote's side of a call 2.3-2.8 -> 1.7 ms. Best effort: an older kernel says EINVAL.
    Only for the preloading zygote (ctypes is big).
    """
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
            madvise(start, end - start, MADV_COLLAPSE)


def _virtual_memory_bytes() -> int:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[0])
    return pages * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    del sys.path[0]  # this script's directory: not a place to import from
    fd = int(sys.argv[1])
    settings: dict[str, Any] = marshal.loads(bytes.fromhex(sys.argv[2]))
    notes = settings["isolation"]["notes"]
    for module in settings["preload"]:
        try:
            __import__(module)
        except ImportError as error:
            notes.append(f"could not pre-import {module}: {error}")
    if settings["warmup"]:
        try:
            exec(compile(settings["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
        except Exception as error:
            notes.append(f"warm-up failed: {error!r}")
    Zygote(fd, settings).serve()


if __name__ == "__main__":
    main()
