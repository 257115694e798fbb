"""A restarted trainer's status: while it verifies the checkpoints it reports the step the run
had reached (from the metrics log), not step 0, and once resumed the checkpoint's step with
that step's metrics, so that `status.step` never goes back further than the checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kubestar.api.v1alpha1 import TrainingRun, TrainingRunStatus, parse_resource
from kubestar.training import checkpoint
from kubestar.training.checkpoint import RunState
from kubestar.training.endpoints import Endpoints
from kubestar.training.progress import MetricsListener, MetricsLog
from kubestar.training.session import TrainingSession
from kubestar.training.telemetry import TrainerMetrics

RUN = {
    "apiVersion": "kubestar.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "restarted"},
    "spec": {
        "rolloutFleetRef": {"name": "fleet"},
        "sandboxPoolRef": {"name": "pool"},
        "model": {"name": "tiny-random-llama"},
        "stages": [
            {
                "name": "only",
                "maxResponseTokens": 48,
                "steps": 4,
                "problemsPerStep": 2,
                "dataset": {"generator": "basic_arithmetic", "size": 20, "seed": 3},
            }
        ],
    },
}


class Recording:
    def __init__(self) -> None:
        self.statuses: list[TrainingRunStatus] = []

    def report(self, status: TrainingRunStatus) -> None:
        self.statuses.append(status.model_copy(deep=True))


def logged_step(step: int) -> dict[str, Any]:
    """A step's entry as the session's _record_step writes it."""
    return {
        "step": step,
        "stage": "only",
        "stage_step": step,
        "time": 1_700_000_000.0 + step,
        "reward": step / 10,
        "step_seconds": 8.0,
        "rollout_attempts": 1.0,
    }


def restarted_session(
    tmp_path: Path, logged: int, telemetry: Sequence[MetricsListener] = ()
) -> tuple[TrainingSession, Recording]:
    """A session on a run folder whose metrics log has an SFT entry and steps 1..`logged`."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0, "stage": "sft", "loss": 1.0})
    for step in range(1, logged + 1):
        log.append(logged_step(step))
    run = parse_resource(RUN)
    assert isinstance(run, TrainingRun)
    reporter = Recording()
    session = TrainingSession(
        run,
        Endpoints(scheduler="", sandbox=""),
        tmp_path,
        tmp_path / "model",
        reporter,
        telemetry=telemetry,
    )
    return session, reporter


@pytest.mark.parametrize("checkpointed", [2, 3])
def test_a_resumed_trainer_reports_no_step_before_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpointed: int
) -> None:
    """Killed after step 3 was logged; its checkpoint is step 3 (a SIGTERM's) or step 2 (a
    SIGKILL after the periodic one)."""
    exported = TrainerMetrics("resumed")
    session, reporter = restarted_session(tmp_path, logged=3, telemetry=[exported])
    newest = tmp_path / "checkpoints" / f"step-{checkpointed:06d}"
    pushed: list[tuple[int, Path | None]] = []
    monkeypatch.setattr(checkpoint, "newest_good", lambda directory, world: newest)
    monkeypatch.setattr(
        checkpoint,
        "load",
        lambda path, policy: RunState(global_step=checkpointed, stage_step=checkpointed),
    )

    def push(policy: object, worker: object, version: int, folder: Path | None = None) -> Path:
        pushed.append((version, folder))
        session.reporter.report(session.status)  # as the push's activity is reported
        return newest / "weights"

    monkeypatch.setattr(session, "_push_weights", push)

    state = session._resume(policy=None, worker=None)  # type: ignore[arg-type]

    assert state.global_step == checkpointed
    assert pushed == [(checkpointed, newest / "weights")]
    # While verifying: the step the status showed before the restart, with its metrics.
    verifying = reporter.statuses[0]
    assert verifying.activity is not None and verifying.activity.what == "verifying checkpoints"
    assert (verifying.step, verifying.stage, verifying.metrics.reward) == (3, "only", 0.3)
    assert verifying.progress.percentage == 75
    # Resumed: the checkpoint's step and that step's metrics; steps after it are redone.
    steps = [status.step for status in reporter.statuses]
    assert steps == sorted(steps, reverse=True) and steps[-1] == checkpointed, steps
    assert min(steps) == checkpointed
    assert session.status.metrics.reward == checkpointed / 10
    assert session.status.last_checkpoint == str(newest)
    logged = [e["step"] for e in MetricsLog(tmp_path / "metrics.jsonl").read()]
    assert logged == list(range(checkpointed + 1))
    # Rank 0's Prometheus series restart at the checkpoint too.
    labels = {"run": "resumed", "stage": "only"}
    assert exported.registry.get_sample_value("kubestar_trainer_step", labels) == checkpointed
    assert exported.registry.get_sample_value("kubestar_trainer_steps_total", labels) == (
        checkpointed
    )


def test_a_trainer_with_no_checkpoint_to_resume_from_starts_at_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session, reporter = restarted_session(tmp_path, logged=1)
    monkeypatch.setattr(checkpoint, "newest_good", lambda directory, world: None)

    state = session._resume(policy=None, worker=None)  # type: ignore[arg-type]

    assert state.global_step == 0 and session.resumed_from is None
    assert [status.step for status in reporter.statuses] == [1]  # while verifying
    assert session.status.step == 0 and session.status.metrics.reward is None
