"""One trainer per run folder (per worker, on a cluster) at a time.

A trainer pod that is deleted (a drain, an eviction, `kubectl delete pod`) finishes its step
and checkpoints it within its grace period. Before Kubernetes 1.26 its Job does not wait for
that: it starts the replacement pod at once, which would resume from the previous checkpoint
in the same run folder while the old pod still writes there (and remove the weights the old
pod is pushing to the engines). So the first process of each trainer holds an exclusive lock
on a file in the run folder for as long as it lives; the kernel releases it when the process
ends, however it ends. A replacement waits for it; a second local `kubestar train` of the same
folder is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from kubestar.api.errors import KubestarError

log = logging.getLogger(__name__)


class RunFolderBusy(KubestarError):
    """Another trainer holds the run folder."""


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
    return "another process"


@contextlib.contextmanager
def hold_run_folder(directory: Path, name: str = "trainer", wait: bool = False) -> Iterator[None]:
    """Hold `directory/.NAME.lock` until the block ends; wait for the holder or raise
    RunFolderBusy naming it."""
    path = directory / f".{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not wait:
                raise RunFolderBusy(
                    f"{directory} is in use by {holder} (it holds {path}): stop that run "
                    "first, or use another --run-dir"
                ) from None
            log.warning("waiting for %s to finish with %s (it holds %s)", holder, directory, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
