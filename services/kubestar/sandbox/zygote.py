"""The executor process, part two: the zygote. Pre-imports modules, forks one child per call.

Exec'd by isolation.py inside the namespaces it set up, as
`python [-S] zygote.py FD SETTINGS` (SETTINGS: marshal-encoded dict, hex). Every page of this
process is paid for by each call three times (the fork copies its page-table entry, the call's
exit drops it, and the zygote's first write to it after a fork is a fault), so it imports only
the few standard modules below (the light zygote, started with -S, stays about as small as an
interpreter can be), and its serving loop is C (_forkserver.c): between two forks it writes no
page of the Python heap. A forked call runs its code from C too, as the `__main__` of a
script, and exits: it never returns into this module.

Per call (in the forked child): own process group, fresh private working directory, scrubbed
environment, rlimits (CPU, address space, processes, file size, open files, no core dumps),
oom_score_adj 1000, the executor's unprivileged uid, not dumpable (the zygote is not either,
from before its first call on: no call can open its /proc/PID/mem or ptrace it). The zygote
enforces the wall-clock timeout and the output caps and reaps everything.

Wire format on the control socket: the ready message is a 4-byte big-endian length +
a `marshal`-encoded dict; calls and answers use _forkserver's fixed headers (see executor.py).
"""

from __future__ import annotations

import gc
import marshal
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and its 30 modules)
if TYPE_CHECKING:
    from typing import Any

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
    # No call faults the interpreter's code in again: it is mapped from huge pages (_forkserver.c).
    code_in_huge_pages = _forkserver.move_code_to_huge_pages()
    # What a process sets up on first use (the compiler, print's argument parser, the method
    # cache entries of the standard streams) is set up here once, not written in every call.
    exec(compile("print(end='')", "<zygote>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    sys.stderr.flush()
    # Pages of the pre-imported modules stay shared with every forked child.
    gc.collect()
    if settings["preload"]:
        _take_free_allocator_blocks()
    gc.freeze()
    baseline_vm_bytes = _virtual_memory_bytes()
    ready = {
        "ready": True,
        "isolation": isolation,
        "baseline_vm_bytes": baseline_vm_bytes,
        "code_in_huge_pages": code_in_huge_pages,
        # On the shared /tmp, the worker removes it when this zygote is gone.
        "shared_work_root": "" if isolation["mount_namespace"] else work_root,
    }
    os.write(fd, encode_message({**ready, "pid": os.getpid()}))
    _forkserver.serve(
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


# Blocks taken by _take_free_allocator_blocks, held for the life of the zygote.
_TAKEN_BLOCKS: list[bytes] = []
# A bytes object of length n is an allocation of n + 33 bytes (header and terminator).
_BYTES_OVERHEAD = 33


def _take_free_allocator_blocks() -> None:
    """Take every free block of the object allocator's partly used pools, so that what a call
    allocates comes from fresh pools (a few pages it writes anyway) rather than from free
    blocks scattered over the preloaded heap, each on a page the call must copy first.
    A sympy call: ~70 fewer page faults, ~5% less CPU. Best effort: the counts are CPython's
    allocator statistics (sys._debugmallocstats, which writes them to fd 2)."""
    if not hasattr(sys, "_debugmallocstats"):  # not CPython: nothing to go by
        return
    stats = os.memfd_create("mallocstats")
    saved_stderr = os.dup(2)
    try:
        os.dup2(stats, 2)
        sys._debugmallocstats()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    size = os.lseek(stats, 0, os.SEEK_CUR)
    text = os.pread(stats, size, 0).decode("ascii", "replace")
    os.close(stats)
    for line in text.splitlines():
        # "class  size  num pools  blocks in use  avail blocks"
        fields = line.split()
        if len(fields) == 5 and all(field.isdigit() for field in fields):
            block_size, free_blocks = int(fields[1]), int(fields[4])
            if block_size > _BYTES_OVERHEAD + 8:  # smaller blocks: no bytes object fits
                length = block_size - _BYTES_OVERHEAD
                _TAKEN_BLOCKS.extend(bytes(length) for _ in range(free_blocks))


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
