"""Engines' IPC folders left by a process killed with SIGKILL are removed by the next engine
start on the machine; a living process's folder, and anything else, is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kubestar.engine.launch import RPC_DIR_PREFIX, remove_orphaned_rpc_dirs


def test_only_the_folders_of_processes_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    orphan = tmp_path / f"{RPC_DIR_PREFIX}{gone.stdout.strip()}-abc123"
    living = tmp_path / f"{RPC_DIR_PREFIX}{os.getpid()}-def456"
    unnamed = tmp_path / f"{RPC_DIR_PREFIX}xyz"  # an older name, without a PID
    other = tmp_path / "kubestar-calls-0123"
    for folder in (orphan, living, unnamed, other):
        (folder / "socket-dir").mkdir(parents=True)
    assert remove_orphaned_rpc_dirs(tmp_path) == [orphan]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (living, unnamed, other)
    )
