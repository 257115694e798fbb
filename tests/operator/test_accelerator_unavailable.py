"""A trainer or an engine given GPUs that its torch cannot drive fails at once with
AcceleratorUnavailable, naming what it was given and what it saw: the run fails without a
retry, the fleet's Ready condition says so; `device: auto` never trains on the CPU of a pod
that asked for GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kubestar.api import trainer_contract
from kubestar.api.conditions import ConditionType, Phase, Reason
from kubestar.api.v1alpha1 import RolloutFleetSpec
from kubestar.common import accelerators
from kubestar.operator import build_fleet, build_trainer
from kubestar.operator import conditions as cond
from kubestar.operator import trainingrun as tr
from kubestar.operator.settings import OperatorSettings
from kubestar.training.distributed import AcceleratorUnavailable, World, device_for
from kubestar.training.entrypoints import exit_final

from tests.operator.support import parent
from tests.operator.test_builders import containers, tiny_run

AMD = {accelerators.ENV_GPUS: "8", accelerators.ENV_GPU_RESOURCE: "amd.com/gpu"}
CPU_TORCH = accelerators.TorchView(version="2.9.0+cpu")
ROCM_TORCH = accelerators.TorchView(version="2.9.0+rocm6.4", hip="6.4", devices=8)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_trainer_pods_are_told_the_gpus_their_resources_give_them() -> None:
    body, spec, fleet, pool = tiny_run()
    (cpu,) = containers(build_trainer.job(body, spec, fleet, pool, OperatorSettings()))
    assert accelerators.ENV_GPUS not in env_of(cpu)  # no GPUs: nothing to check
    trainer = spec.trainer.model_copy(
        update={
            "processes_per_worker": 8,
            "resources": spec.trainer.resources.model_copy(
                update={"limits": {"amd.com/gpu": 8, "memory": "64Gi"}}
            ),
        }
    )
    gpu = spec.model_copy(update={"trainer": trainer})
    (container,) = containers(build_trainer.job(body, gpu, fleet, pool, OperatorSettings()))
    assert accelerators.requested(env_of(container)) == (8, "amd.com/gpu")


@pytest.mark.parametrize(
    ("accelerator", "resource"), [("amd", "amd.com/gpu"), ("nvidia", "nvidia.com/gpu")]
)
def test_gpu_engines_check_their_gpus_before_vllm_starts(accelerator: str, resource: str) -> None:
    fleet = parent("RolloutFleet", "f")
    spec = RolloutFleetSpec.model_validate(
        {"accelerator": accelerator, "engine": {"tensorParallelSize": 4}}
    )
    (engine,) = containers(build_fleet.engine_deployment(fleet, spec, OperatorSettings()))
    command = engine["command"]
    assert command[: command.index("--")] == [
        "python3",
        f"{build_fleet.ENGINE_MODULES_DIR}/{build_fleet.ENGINE_ACCELERATORS_MODULE}.py",
        "--termination-log",
        "/dev/termination-log",
        "--python-path",
        build_fleet.ENGINE_MODULES_DIR,
    ]
    vllm = command[command.index("--") + 1 :]
    assert vllm[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert accelerators.requested(env_of(engine)) == (4, resource)
    assert engine["terminationMessagePath"] == "/dev/termination-log"
    modules = build_fleet.engine_modules_config(fleet)["data"]
    assert "def main(" in modules[f"{build_fleet.ENGINE_ACCELERATORS_MODULE}.py"]
    cpu = RolloutFleetSpec.model_validate({"accelerator": "cpu"})
    (cpu_engine,) = containers(build_fleet.engine_deployment(fleet, cpu, OperatorSettings()))
    assert cpu_engine["command"][:3] == ["kubestar", "engine", "serve"]
    assert accelerators.ENV_GPUS not in env_of(cpu_engine)


def test_auto_never_trains_on_the_cpu_of_a_pod_given_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accelerators, "torch_view", lambda: CPU_TORCH)
    for name in ("auto", "cuda", "cpu"):  # the pod's GPUs are checked whatever device says
        with pytest.raises(AcceleratorUnavailable) as raised:
            device_for(World(), name, AMD)
        assert str(raised.value).startswith(
            "8 amd.com/gpu requested; torch 2.9.0+cpu sees 0 devices (a CPU-only build"
        )
    assert AcceleratorUnavailable.reason == Reason.ACCELERATOR_UNAVAILABLE
    # trainer.device cuda in a pod given no GPUs.
    with pytest.raises(AcceleratorUnavailable, match=r"^trainer.device is cuda \(a GPU for local"):
        device_for(World(rank=3, size=4, local_rank=1), "cuda", {})
    # No GPUs given, none seen: the CPU, as before.
    assert device_for(World(), "auto", {}) == torch.device("cpu")

    monkeypatch.setattr(accelerators, "torch_view", lambda: ROCM_TORCH)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    world = World(rank=5, size=8, local_rank=5)
    assert device_for(world, "auto", AMD) == torch.device("cuda", 5)
    assert device_for(World(), "cpu", AMD) == torch.device("cpu")  # asked for explicitly


def test_the_run_fails_at_once_with_the_reason_in_trainer_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accelerators, "torch_view", lambda: CPU_TORCH)
    log = tmp_path / "termination-log"
    with pytest.raises(AcceleratorUnavailable) as raised:
        device_for(World(), "auto", AMD)
    with pytest.raises(SystemExit) as exited:
        exit_final(raised.value, str(log))
    assert exited.value.code == trainer_contract.EXIT_FINAL_FAILURE
    stated = log.read_text()
    assert stated.startswith("AcceleratorUnavailable: 8 amd.com/gpu requested; torch 2.9.0+cpu")

    pod = {
        "metadata": {"name": "run-trainer-x7", "labels": {}},
        "status": {
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 28, "message": stated}}}
            ]
        },
    }
    # Before the Job fails (no podFailurePolicy before Kubernetes 1.26) the run fails already.
    running_job: dict[str, Any] = {"metadata": {"uid": "job-uid"}, "status": {"active": 1}}
    outcome = tr.job_outcome(running_job, [pod])
    assert (outcome.state, outcome.reason) == ("failed", Reason.ACCELERATOR_UNAVAILABLE)
    decision = tr.decide(Phase.PROVISIONING, 1, None, None, True, outcome)
    assert decision.phase == Phase.FAILED
    (ready,) = [c for c in decision.conditions if c.type == ConditionType.TRAINER_READY]
    assert (ready.status, ready.reason) == ("False", Reason.ACCELERATOR_UNAVAILABLE)
    assert "8 amd.com/gpu requested; torch 2.9.0+cpu sees 0 devices" in ready.message


def test_an_engine_that_cannot_see_its_gpus_makes_the_fleet_say_so() -> None:
    stated = (
        "AcceleratorUnavailable: 2 nvidia.com/gpu requested; torch 2.9.0+cu128 sees 1 device "
        "(CUDA_VISIBLE_DEVICES=0 hides devices)\n"
    )
    pod = {
        "metadata": {"name": "f-engine-abc"},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": {"exitCode": 28, "message": stated}},
                }
            ]
        },
    }
    ready = cond.ready(1, 1, None, "starting", [pod])
    assert (ready.status, ready.reason) == ("False", Reason.ACCELERATOR_UNAVAILABLE)
    assert ready.message == (
        "pod f-engine-abc: AcceleratorUnavailable: container engine: 2 nvidia.com/gpu "
        "requested; torch 2.9.0+cu128 sees 1 device (CUDA_VISIBLE_DEVICES=0 hides devices)"
    )
