"""The trainer's status reports (kubestar.training.progress.StatusPatcher) through kubestar's
API client, against a stand-in API server: what the trainer pod sends, with what credentials,
and that a failed report never stops training."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from kubestar.api import trainer_contract
from kubestar.api.v1alpha1 import TrainingMetrics, TrainingRunStatus
from kubestar.common import kube
from kubestar.common.net import free_port
from kubestar.training.progress import StatusPatcher, duration_summary, step_progress

from tests.common.fake_api_server import Certificate, FakeApiServer, in_cluster

STATUS_PATH = "/apis/kubestar.dev/v1alpha1/namespaces/team/trainingruns/run/status"


def training_status(step: int) -> TrainingRunStatus:
    return TrainingRunStatus(
        phase="Training",
        stage="warmup",
        step=step,
        total_steps=6,
        progress=step_progress(step, 6, 60.0 * (6 - step), TrainingMetrics(reward=0.25)),
        metrics=TrainingMetrics(reward=0.25, accuracy=0.5),
        observed_generation=3,  # the operator's field: never in the trainer's patch
    )


def test_the_trainer_pod_patches_its_runs_status_with_its_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeApiServer(Certificate.create(tmp_path)) as server:
        token = in_cluster(monkeypatch, tmp_path, server)
        server.answer("PATCH", STATUS_PATH, {"kind": "TrainingRun"})
        env = trainer_contract.TrainerEnvironment.from_env(
            {trainer_contract.ENV_NAME: "run", trainer_contract.ENV_NAMESPACE: "team"}
        )
        patcher = StatusPatcher.in_cluster(env)
        status = training_status(3)  # once: its progress carries the time it was made
        patcher.report(status)
        token.write_text("rotated\n")
        patcher.report(training_status(4))

        first, second = server.requests
        assert (first.method, first.path) == ("PATCH", STATUS_PATH)
        assert first.headers["Content-Type"] == "application/merge-patch+json"
        assert first.headers["Authorization"] == "Bearer service-account-token"
        assert second.headers["Authorization"] == "Bearer rotated"
        assert first.body == trainer_contract.trainer_patch(status)
        assert first.body["status"]["step"] == 3 and second.body["status"]["step"] == 4
        assert "observedGeneration" not in first.body["status"]


def test_a_failed_report_is_logged_once_and_training_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with FakeApiServer() as server:
        server.answer(
            "PATCH", STATUS_PATH, {"reason": "Forbidden", "message": "not yours"}, status=403
        )
        patcher = StatusPatcher("run", "team", kube.Connection(server=server.url, token="t"))
        with caplog.at_level(logging.WARNING, "kubestar.training.progress"):
            patcher.report(training_status(1))
        assert len(server.requests) == 1  # not retried: the next report carries it all
        assert "status patch failed" in caplog.text and "403" in caplog.text
        with pytest.raises(kube.ApiError, match="403"):
            patcher.patch({"status": {"step": 1}})

    nobody = kube.Connection(server=f"http://127.0.0.1:{free_port()}")
    StatusPatcher("run", "team", nobody, timeout=5).report(training_status(1))


def test_progress_reports_steps_done_time_left_and_metrics_as_a_list() -> None:
    progress = step_progress(2, 3, 3725.4, TrainingMetrics(reward=0.5, tool_error_rate=0.125))
    assert progress.percentage == 66  # rounded down: 100 only once the last step is done
    assert progress.estimated_remaining_seconds == 3725
    assert progress.estimated_remaining_time_summary == "1h2m"
    dumped = progress.model_dump(by_alias=True)
    assert dumped["metrics"] == [
        {"name": "reward", "value": "0.5"},
        {"name": "toolErrorRate", "value": "0.125"},
    ]
    assert step_progress(3, 3, 0.0, TrainingMetrics()).percentage == 100
    assert [duration_summary(s) for s in (0, 42.4, 200, 7200)] == ["0s", "42s", "3m20s", "2h0m"]
