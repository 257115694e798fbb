"""The executor process, part two: the zygote. Pre-imports modules, forks one child per call.

Exec'd by isolation.py inside the namespaces it set up, as
`python [-S] zygote.py FD SETTINGS` (SETTINGS: marshal-encoded dict, hex). Every page of this
process is paid for by each call three times (the fork copies its page-table entry, the call's
exit drops it, and the zygote's first write to it after a fork is a fault), so it imports only
the few standard modules below (the light zygote, started with -S, stays about as small as an
interpreter can be), and its serving loop is C (_forkserver.c): between two forks it writes no
page of the Python heap. The loop returns into Python only in a forked call (`run_call`).

Per call (in the forked child): own process group, fresh private working directory, scrubbed
environment, rlimits (CPU, address space, processes, file size, open files, no core dumps),
the executor's unprivileged uid. The zygote enforces the wall-clock timeout and the output
caps and reaps everything.

Wire format on the control socket: the ready message is a 4-byte big-endian length +
a `marshal`-encoded dict; calls and answers use _forkserver's fixed headers (see executor.py).
"""

from __future__ import annotations

import builtins
import gc
import marshal
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and its 30 modules)
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from kubestar.sandbox import _forkserver
else:
    try:
        # Run as the zygote: from this script's directory (sys.path[0], the package's
        # folder), without importing the kubestar package into every call.
        import _forkserver
    except ImportError:  # imported by the worker for its constants
        from kubestar.sandbox import _forkserver

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
# The call's report channel (fd 3): "M" when it ran out of memory.
REPORT_FD = 3


def encode_message(message: dict[str, Any]) -> bytes:
    payload = marshal.dumps(message)
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def serve(fd: int, settings: dict[str, Any]) -> None:
    isolation: dict[str, Any] = settings["isolation"]
    if isolation["mount_namespace"]:
        work_root = WORK_ROOT  # on this zygote's private /tmp
        os.makedirs(work_root, mode=0o711, exist_ok=True)
    else:
        # On the shared /tmp: a new, unguessable directory (mkdir fails on anything already
        # there, symlinks included), without importing tempfile (random, hashlib, shutil, ...).
        work_root = f"/tmp/kubestar-calls-{os.urandom(8).hex()}"
        os.mkdir(work_root, 0o700)
    is_root = os.geteuid() == 0
    # Calls run as their own uid only as root; not as root they run as the service's uid.
    call_uid = settings["uid"] if is_root and settings["uid"] else 0
    # Each call runs in this directory, made afresh for it and removed after it.
    workdir = f"{work_root}/call"
    os.environ.clear()
    os.environ.update(CALL_ENV, HOME=workdir, TMPDIR=workdir)
    sys.argv = ["<tool_call>"]
    sys.path.insert(0, workdir)
    # The first compile() of a process is slow (~1 ms): pay it here, not in every call.
    compile("pass", "<zygote>", "exec")
    # Pages of the pre-imported modules stay shared with every forked child.
    gc.collect()
    gc.freeze()
    baseline_vm_bytes = _virtual_memory_bytes()
    ready = {"ready": True, "isolation": isolation, "baseline_vm_bytes": baseline_vm_bytes}
    os.write(fd, encode_message({**ready, "pid": os.getpid()}))
    code = _forkserver.serve(
        fd=fd,
        workdir=workdir,
        call_uid=call_uid,
        # PID 1 of a PID namespace: kill(-1) reaches everything a call left behind.
        kill_all=isolation["pid_namespace"],
        # The preloading zygote's heap is big: keep it in huge pages (see _forkserver.c).
        collapse=bool(settings["preload"]),
        baseline_vm_bytes=baseline_vm_bytes,
        max_file_bytes=settings["max_file_bytes"],
        max_open_files=settings["max_open_files"],
        # Counted per uid: only meaningful when the uid is the call's own.
        max_processes=settings["max_processes"] if call_uid or not is_root else -1,
        # Emptied after each call but for the call directories and the runtime shown there.
        private_dirs={path: [work_root, *keep] for path, keep in settings["private_tmpfs"].items()},
    )
    if code is not None:  # in a forked call
        run_call(code)


def run_call(code: bytes) -> NoReturn:
    """Run the call's code in this forked process (its set-up is done) and exit."""
    exit_code = 1
    try:
        try:
            compiled = compile(code.decode(), "<tool_call>", "exec")
        except SyntaxError as error:
            sys.__excepthook__(type(error), error, None)  # as Python shows it for a script
            os._exit(1)
        exit_code = 0
        try:
            exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as stop:
            exit_code = _system_exit_code(stop)
        except MemoryError as error:
            os.write(REPORT_FD, b"M")
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
    serve(fd, settings)


if __name__ == "__main__":
    main()
