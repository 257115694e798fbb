"""Pod overrides on every kind (spec.podOverrides.<component>): each reaches its child's pod,
none replaces what kubestar set, what would break tenancy cannot be written, and the chart's
pull secrets reach every pod the operator makes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubestar.api.v1alpha1 import (
    ManifestError,
    RolloutFleetSpec,
    SandboxPoolSpec,
    TrainingRunSpec,
    parse_resource,
)
from kubestar.operator import build_fleet, build_sandbox, build_trainer
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings

from tests.operator.support import parent
from tests.operator.test_auth import helm_binary
from tests.operator.test_builders import tiny_run
from tests.operator.test_network_flows import rendered_settings

OVERRIDES: dict[str, Any] = {
    "nodeSelector": {"node.kubernetes.io/instance-type": "mi300x"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
    "priorityClassName": "rl-high",
    "schedulerName": "volcano",
    "labels": {"kueue.x-k8s.io/queue-name": "team-a"},
    "annotations": {"scheduling.volcano.sh/group-name": "run-1"},
    "env": [
        {"name": "NCCL_SOCKET_IFNAME", "value": "eth1"},
        {"name": "PYTHONUNBUFFERED", "value": "0"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ],
    "supplementalGroups": [44, 992],
    "imagePullSecrets": [{"name": "team-registry"}],
    "resources": {"limits": {"rdma/rdma_shared_device_a": 1}},
}

Workload = dict[str, Any]


def _run(overrides: dict[str, Any] | None, gpus: int = 0) -> Callable[..., Workload]:
    body, spec, fleet, pool = tiny_run()
    data = spec.model_dump(by_alias=True)
    if overrides is not None:
        data["podOverrides"] = {"trainer": overrides}
    if gpus:
        data["trainer"]["processesPerWorker"] = gpus
        data["trainer"]["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    run = TrainingRunSpec.model_validate(data)
    return lambda settings: build_trainer.job(body, run, fleet, pool, settings, 1, (1, 29))


def builders(overrides: dict[str, Any] | None) -> dict[str, Callable[[OperatorSettings], Workload]]:
    """Each component's workload builder, with `overrides` as its podOverrides."""
    fleet, pool = parent("RolloutFleet", "f"), parent("SandboxPool", "p")

    def fleet_spec(component: str) -> RolloutFleetSpec:
        data: dict[str, Any] = {"accelerator": "amd"}
        if overrides is not None:
            data["podOverrides"] = {component: overrides}
        return RolloutFleetSpec.model_validate(data)

    def pool_spec(component: str) -> SandboxPoolSpec:
        data: dict[str, Any] = {}
        if overrides is not None:
            data["podOverrides"] = {component: overrides}
        return SandboxPoolSpec.model_validate(data)

    return {
        "engine": lambda s: build_fleet.engine_deployment(fleet, fleet_spec("engine"), s),
        "scheduler": lambda s: build_fleet.scheduler_deployment(fleet, fleet_spec("scheduler"), s),
        "worker": lambda s: build_sandbox.worker_statefulset(pool, pool_spec("worker"), s),
        "dispatcher": lambda s: build_sandbox.dispatcher_deployment(
            pool, pool_spec("dispatcher"), s
        ),
        "trainer": _run(overrides),
    }


COMPONENTS = ["engine", "scheduler", "worker", "dispatcher", "trainer"]
CHART_SECRETS = OperatorSettings.model_validate({"images": {"pullSecrets": [{"name": "regcred"}]}})


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_override_reaches_its_component(component: str) -> None:
    plain = builders(None)[component](CHART_SECRETS)
    built = builders(OVERRIDES)[component](CHART_SECRETS)
    template = built["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == OVERRIDES["nodeSelector"]
    before = plain["spec"]["template"]["spec"].get("tolerations", [])
    assert pod["tolerations"] == [
        *before,  # kubestar's (an engine's GPU toleration) stay first
        {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    assert pod["affinity"] == OVERRIDES["affinity"]
    assert (pod["priorityClassName"], pod["schedulerName"]) == ("rl-high", "volcano")
    labels = template["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert labels.items() >= plain["spec"]["template"]["metadata"]["labels"].items()
    annotations = template["metadata"]["annotations"]
    assert annotations["scheduling.volcano.sh/group-name"] == "run-1"
    assert pod["securityContext"]["supplementalGroups"][-2:] == [44, 992]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "team-registry"}]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == {"name": "NCCL_SOCKET_IFNAME", "value": "eth1"}
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "k"}}
    assert env["NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))  # a name kubestar sets too is replaced, not repeated
    if "PYTHONUNBUFFERED" in {e["name"] for e in plain_container(plain)["env"]}:
        assert env["PYTHONUNBUFFERED"]["value"] == "0"
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert built["metadata"]["annotations"][o.ANNOTATION_HASH] == o.spec_hash(built)
    assert o.spec_hash(built) != o.spec_hash(plain)


def plain_container(workload: Workload) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.mark.parametrize("component", COMPONENTS)
def test_no_override_replaces_kubestars_command_probes_or_security(component: str) -> None:
    plain = builders(None)[component](OperatorSettings())
    built = builders(OVERRIDES)[component](OperatorSettings())
    before, after = plain_container(plain), plain_container(built)
    for key in (
        "command",
        "image",
        "securityContext",
        "volumeMounts",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "ports",
    ):
        assert after.get(key) == before.get(key), key
    pod_before, pod_after = plain["spec"]["template"]["spec"], built["spec"]["template"]["spec"]
    for key in ("serviceAccountName", "automountServiceAccountToken", "volumes", "hostNetwork"):
        assert pod_after.get(key) == pod_before.get(key), key
    security = dict(pod_after["securityContext"])
    security.pop("supplementalGroups")
    assert security == {
        k: v for k, v in pod_before["securityContext"].items() if k != "supplementalGroups"
    }
    # kubestar's limits and requests stay beside the extra resource.
    for section in ("requests", "limits"):
        extra = {"rdma/rdma_shared_device_a"}
        assert {
            k: v for k, v in after.get("resources", {}).get(section, {}).items() if k not in extra
        } == before.get("resources", {}).get(section, {})


MANIFEST: dict[str, Any] = {
    "apiVersion": "kubestar.dev/v1alpha1",
    "kind": "RolloutFleet",
    "metadata": {"name": "f"},
    "spec": {},
}


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"hostPath": {"path": "/"}}, "spec.podOverrides.engine.hostPath: unknown field"),
        ({"privileged": True}, "spec.podOverrides.engine.privileged: unknown field"),
        ({"hostNetwork": True}, "spec.podOverrides.engine.hostNetwork: unknown field"),
        ({"hostPID": True}, "spec.podOverrides.engine.hostPID: unknown field"),
        ({"hostIPC": True}, "spec.podOverrides.engine.hostIPC: unknown field"),
        ({"securityContext": {}}, "spec.podOverrides.engine.securityContext: unknown field"),
        ({"capabilities": {}}, "spec.podOverrides.engine.capabilities: unknown field"),
        ({"serviceAccountName": "x"}, "spec.podOverrides.engine.serviceAccountName: unknown"),
        ({"volumes": []}, "spec.podOverrides.engine.volumes: unknown field"),
        ({"command": ["sh"]}, "spec.podOverrides.engine.command: unknown field"),
        ({"runtimeClassName": "x"}, "spec.podOverrides.engine.runtimeClassName: unknown"),
        (
            {"labels": {"app.kubernetes.io/component": "scheduler"}},
            "spec.podOverrides.engine.labels: Value error, app.kubernetes.io/component is a "
            "label kubestar sets",
        ),
        (
            {"labels": {"kubestar.dev/engine-index": "0"}},
            "spec.podOverrides.engine.labels: Value error, kubestar.dev/engine-index",
        ),
        (
            {"annotations": {"kubestar.dev/spec-hash": "x"}},
            "spec.podOverrides.engine.annotations: Value error, kubestar.dev/spec-hash is an "
            "annotation kubestar sets",
        ),
        (
            {"env": [{"name": "KUBESTAR_GPUS", "value": "0"}]},
            "spec.podOverrides.engine.env: Value error, KUBESTAR_GPUS is set by kubestar",
        ),
        (
            {"env": [{"name": "PYTHONPATH", "value": "/x"}]},
            "spec.podOverrides.engine.env: Value error, PYTHONPATH is set by kubestar",
        ),
        (
            {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
            "spec.podOverrides.engine.env: Value error, CUDA_VISIBLE_DEVICES is set by kubestar",
        ),
        (
            {"env": [{"name": "A"}]},
            "spec.podOverrides.engine.env.0: Value error, env A: set exactly one of value",
        ),
        (
            {"resources": {"limits": {"nvidia.com/gpu": 1}}},
            "spec.podOverrides.engine.resources: Value error, nvidia.com/gpu: GPUs come from",
        ),
        (
            {"affinity": {"nodeName": "n1"}},
            "spec.podOverrides.engine.affinity: Value error, ['nodeName']",
        ),
    ],
)
def test_what_would_break_tenancy_or_kubestar_is_refused_by_name(
    override: dict[str, Any], named: str
) -> None:
    manifest = copy.deepcopy(MANIFEST)
    manifest["spec"]["podOverrides"] = {"engine": override}
    with pytest.raises(ManifestError) as refused:
        parse_resource(manifest)
    assert named in str(refused.value), str(refused.value)


def test_the_charts_pull_secrets_reach_every_pod_the_operator_makes() -> None:
    run_body, run, fleet_spec, pool_spec = tiny_run()
    fleet, pool = parent("RolloutFleet", "tiny-fleet"), parent("SandboxPool", "tiny-sandbox")
    amd = RolloutFleetSpec.model_validate({"accelerator": "amd"})
    children = [
        *build_sandbox.children(pool, pool_spec, CHART_SECRETS),
        *build_fleet.children(fleet, fleet_spec, CHART_SECRETS),
        *build_fleet.children(fleet, amd, CHART_SECRETS),
        *build_trainer.jobs(run_body, run, fleet_spec, pool_spec, CHART_SECRETS),
    ]
    pods = [c["spec"]["template"]["spec"] for c in children if "template" in c.get("spec", {})]
    assert len(pods) == 7  # workers, dispatcher, 2 x (engines, scheduler), trainer
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    without = build_sandbox.children(pool, pool_spec, OperatorSettings())
    assert all(
        "imagePullSecrets" not in c.get("spec", {}).get("template", {}).get("spec", {})
        for c in without
    )


def test_trainer_pods_tolerate_their_accelerators_taint() -> None:
    job = _run(None, gpus=8)(OperatorSettings())
    pod = job["spec"]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert "tolerations" not in _run(None)(OperatorSettings())["spec"]["template"]["spec"]


def test_the_chart_gives_the_operator_its_pull_secrets(tmp_path: Path) -> None:
    helm_binary(tmp_path)  # skips without helm
    settings = rendered_settings(tmp_path, {"images": {"pullSecrets": [{"name": "regcred"}]}})
    assert settings.images.pull_secret_names == ["regcred"]
    assert rendered_settings(tmp_path, {}).images.pull_secret_names == []
