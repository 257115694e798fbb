"""One trainer per run folder: a replacement trainer pod waits until the pod it replaces
has exited (however it exits), and a second local `kubestar train` of a folder is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kubestar.training.runlock import RunFolderBusy, hold_run_folder

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from pathlib import Path
from kubestar.training.runlock import hold_run_folder
with hold_run_folder(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes stdin or kills this process
"""


def start_holder(folder: Path, name: str = "trainer") -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    try:
        with (
            pytest.raises(RunFolderBusy, match=f"in use by pid {holder.pid} on "),
            hold_run_folder(tmp_path),
        ):
            pass
        # Another worker's lock is another file: both are held at once.
        with hold_run_folder(tmp_path, "trainer-worker-1"):
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run_folder(tmp_path):  # free once the holder is gone
        pass


def test_a_replacement_waits_until_the_holder_is_killed(tmp_path: Path) -> None:
    holder = start_holder(tmp_path, "trainer-worker-0")
    killed = threading.Event()
    acquired_after_kill: list[bool] = []

    def replacement() -> None:
        with hold_run_folder(tmp_path, "trainer-worker-0", wait=True):
            acquired_after_kill.append(killed.is_set())

    waiting = threading.Thread(target=replacement)
    waiting.start()
    # SIGKILL: nothing of the holder's runs; the kernel releases the lock.
    killed.set()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert acquired_after_kill == [True]
    assert f"pid {os.getpid()} " in (tmp_path / ".trainer-worker-0.lock").read_text()


def test_kubestar_train_refuses_a_folder_in_use(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    try:
        example = str(ROOT / "examples" / "tiny-cpu.yaml")
        command = [sys.executable, "-m", "kubestar.cli.main", "train", "-f", example]
        done = subprocess.run(
            [*command, "--run-dir", str(tmp_path), "--fresh"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"kubestar: error: {tmp_path} is in use by pid {holder.pid}"), line
    assert (tmp_path / ".trainer.lock").exists()  # --fresh removed nothing
