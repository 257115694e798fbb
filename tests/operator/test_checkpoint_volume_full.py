"""A full checkpoint volume on a cluster: the trainer states CheckpointVolumeFull in its
termination message and exits with its own code; the Job fails at once (no retry would find
more space); the operator shows the trainer's words in TrainerReady, naming the volume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubestar.api import trainer_contract
from kubestar.api.conditions import ConditionType, Phase, Reason
from kubestar.operator import build_trainer
from kubestar.operator import trainingrun as tr
from kubestar.operator.settings import OperatorSettings
from kubestar.training.checkpoint import CheckpointVolumeFull
from kubestar.training.entrypoints import exit_final

from tests.operator.test_builders import containers, tiny_run

MESSAGE = (
    "checkpoint volume full: /var/lib/kubestar/checkpoints (PersistentVolumeClaim "
    "tiny-cpu-checkpoints): writing step-000012 failed on rank 0 (OSError: [Errno 28] No space "
    "left on device: /var/lib/kubestar/checkpoints/.tmp-step-000012-7/trainer/__0_0.distcp); "
    "the partial checkpoint was removed; 1.2 GiB free of 50.0 GiB. Give the run a bigger "
    "volume (spec.checkpoint.storage, or a larger claim in spec.checkpoint.pvcClaimName) or "
    "keep fewer checkpoints (spec.checkpoint.keep, now 3)"
)


def test_the_trainer_job_names_its_volume_and_fails_at_once_when_it_is_full() -> None:
    body, spec, fleet, pool = tiny_run()
    settings = OperatorSettings()
    job = build_trainer.job(body, spec, fleet, pool, settings, server_version=(1, 29))
    (trainer,) = containers(job)
    env = {e["name"]: e["value"] for e in trainer["env"]}
    parsed = trainer_contract.TrainerEnvironment.from_env(env)
    assert parsed.checkpoint_volume == "PersistentVolumeClaim tiny-cpu-checkpoints"
    assert trainer["terminationMessagePath"] == trainer_contract.TERMINATION_LOG
    assert trainer["terminationMessagePolicy"] == "File"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[1] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [28]},
    }
    assert trainer_contract.EXIT_FINAL_FAILURE == 28
    # Where the checkpoints lie otherwise.
    named = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"pvc_claim_name": "mine"})}
    )
    assert build_trainer.checkpoint_volume(body, named, settings) == "PersistentVolumeClaim mine"
    shared = OperatorSettings.model_validate(
        {"trainer": {"sharedCheckpoints": {"hostPath": "/srv/kubestar"}}}
    )
    assert "trainer.sharedCheckpoints" in build_trainer.checkpoint_volume(body, spec, shared)
    ephemeral = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"ephemeral": True})}
    )
    assert "emptyDir" in build_trainer.checkpoint_volume(body, ephemeral, settings)


def test_the_trainers_words_reach_trainer_ready(tmp_path: Path) -> None:
    """What `kubestar train --in-cluster` writes as it exits is what TrainerReady says."""
    log = tmp_path / "termination-log"
    with pytest.raises(SystemExit) as exited:
        exit_final(CheckpointVolumeFull(MESSAGE), str(log))
    assert exited.value.code == trainer_contract.EXIT_FINAL_FAILURE
    assert log.read_text() == f"CheckpointVolumeFull: {MESSAGE}\n"
    assert CheckpointVolumeFull.reason == Reason.CHECKPOINT_VOLUME_FULL

    failed_job: dict[str, Any] = {
        "metadata": {"uid": "job-uid"},
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]
        },
    }
    pod = {
        "metadata": {"name": "tiny-cpu-trainer-x7", "labels": {}},
        "status": {
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {"terminated": {"exitCode": 28, "message": log.read_text()}},
                }
            ]
        },
    }
    outcome = tr.job_outcome(failed_job, [pod])
    assert (outcome.state, outcome.reason) == ("failed", Reason.CHECKPOINT_VOLUME_FULL)
    decision = tr.decide(Phase.TRAINING, 1, None, None, True, outcome)
    assert decision.phase == Phase.FAILED
    (ready,) = [c for c in decision.conditions if c.type == ConditionType.TRAINER_READY]
    assert (ready.status, ready.reason) == ("False", Reason.CHECKPOINT_VOLUME_FULL)
    assert ready.message == (
        "trainer Job failed (PodFailurePolicy): pod tiny-cpu-trainer-x7: CheckpointVolumeFull: "
        f"container trainer: {MESSAGE}"
    )
