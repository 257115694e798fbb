"""SIGTERM (a node drain, an eviction, a preemption) costs no work: the trainer finishes the
step in progress, checkpoints it and exits with EXIT_STOPPED; run again, it resumes there and
every step happens exactly once. Real processes, as in test_train_session."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from kubestar.training.stopping import EXIT_STOPPED

from tests.training.test_train_session import rl_steps, train_command

pytestmark = pytest.mark.slow


def test_sigterm_checkpoints_the_step_in_progress_and_the_run_resumes(tmp_path: Path) -> None:
    command, env = train_command(tmp_path, steps=4)
    manifest = tmp_path / "run.yaml"
    # No periodic checkpoint before the end: any earlier one is the stop's.
    manifest.write_text(manifest.read_text().replace("everySteps: 2", "everySteps: 100"))
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and process.poll() is None:
        if rl_steps(tmp_path):
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.5)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == EXIT_STOPPED, stderr[-3000:]
    assert "run the same command again to resume" in stderr
    done = [m["step"] for m in rl_steps(tmp_path)]
    assert done in ([1], [1, 2]), done  # the step in progress when the signal came finished
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints[-1] == f"step-{done[-1]:06d}", checkpoints

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    steps = rl_steps(tmp_path)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # Each step's weights were pushed at the first try, and never again (no scheduler lost them).
    assert [(m["weights_push_attempts"], m["weights_pushed_again"]) for m in steps] == [(1, 0)] * 4
