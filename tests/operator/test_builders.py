"""The builders of child objects are pure: checked here without a cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kubestar.api import trainer_contract
from kubestar.api.v1alpha1 import (
    CheckpointSpec,
    ModelSource,
    RolloutFleetSpec,
    SandboxPoolSpec,
    TrainingRunSpec,
    load_manifests,
)
from kubestar.cli.sandbox import call_policy, serve_command
from kubestar.engine.models import DEFAULT_MODEL
from kubestar.operator import build_fleet, build_sandbox, build_trainer
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings
from kubestar.sandbox.limits import LimitPolicy, MiB
from pydantic import ValidationError

from tests.operator.support import EXAMPLES, parent


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return list(spec["containers"])


def test_every_child_is_owned_labelled_and_hashed() -> None:
    settings = OperatorSettings()
    pool = parent("SandboxPool", "pool")
    fleet = parent("RolloutFleet", "fleet")
    run = parent("TrainingRun", "run")
    run_spec = TrainingRunSpec.model_validate(
        {
            "rolloutFleetRef": {"name": "fleet"},
            "sandboxPoolRef": {"name": "pool"},
            "stages": [
                {
                    "name": "s",
                    "maxResponseTokens": 64,
                    "steps": 1,
                    "dataset": {"generator": "basic_arithmetic"},
                }
            ],
        }
    )
    children = [
        *build_sandbox.children(pool, SandboxPoolSpec(), settings),
        *build_fleet.children(fleet, RolloutFleetSpec(), settings),
        build_trainer.config_map(run, run_spec),
        *build_trainer.rbac(run),
        build_trainer.job(run, run_spec, RolloutFleetSpec(), SandboxPoolSpec(), settings),
    ]
    for child in children:
        meta = child["metadata"]
        (ref,) = meta["ownerReferences"]
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
        assert ref["uid"].startswith("uid-")
        assert meta["labels"][o.LABEL_MANAGED_BY] == o.MANAGED_BY
        assert meta["annotations"][o.ANNOTATION_HASH] == o.spec_hash(child)
        assert len(meta["name"]) <= 63
    # Deterministic: building twice gives the same objects.
    again = build_sandbox.children(pool, SandboxPoolSpec(), settings)
    assert json.dumps(again, sort_keys=True) == json.dumps(children[: len(again)], sort_keys=True)


def test_sandbox_pods_are_locked_down() -> None:
    pool = parent("SandboxPool", "pool")
    spec = SandboxPoolSpec(replicas=3, executors_per_pod=8, runtime_class_name="gvisor")
    workers = build_sandbox.worker_statefulset(pool, spec, OperatorSettings())
    pod = workers["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (worker,) = pod["containers"]
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    # Isolation required, by capabilities (the default): root with exactly what the
    # executors use; the calls run as uids of their own with none.
    assert worker["securityContext"]["runAsUser"] == 0
    assert worker["securityContext"]["runAsNonRoot"] is False
    assert worker["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["SYS_ADMIN", "SETUID", "SETGID", "KILL", "CHOWN", "DAC_OVERRIDE"],
    }
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # The node's disk they may fill is bounded.
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert worker["resources"]["limits"]["ephemeral-storage"] == "2Gi"
    assert worker["command"][:3] == ["kubestar", "sandbox", "serve"]
    assert worker["command"][worker["command"].index("--executors") + 1] == "8"
    assert "hostNetwork" not in pod
    assert workers["spec"]["replicas"] == 3

    dispatcher = build_sandbox.dispatcher_deployment(pool, spec, OperatorSettings())
    assert containers(dispatcher)[0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "runAsUser" not in containers(dispatcher)[0]["securityContext"]
    command = containers(dispatcher)[0]["command"]
    targets = [command[i + 1] for i, arg in enumerate(command) if arg == "--worker"]
    assert targets == [
        f"pool-sandbox-worker-{i}.pool-sandbox-worker.team.svc.cluster.local:50052"
        for i in range(3)
    ]
    assert dispatcher["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert build_sandbox.endpoint("pool", "team", spec, OperatorSettings()) == (
        "pool-sandbox.team.svc.cluster.local:50051"
    )


def test_sandbox_servers_get_the_pools_call_limits_as_defaults() -> None:
    """spec.limits reach the workers and the dispatcher as the defaults of calls that set no
    limit (the HTTP dialects, `kubestar sandbox exec`), and a change of them rolls the pods."""
    pool = parent("SandboxPool", "pool")
    spec = SandboxPoolSpec.model_validate(
        {
            "httpPort": 8080,
            "limits": {"timeoutSeconds": 2.5, "memoryMib": 1024, "outputBytes": 4096},
        }
    )
    settings = OperatorSettings()
    workers = build_sandbox.worker_statefulset(pool, spec, settings)
    dispatcher = build_sandbox.dispatcher_deployment(pool, spec, settings)
    for server in (workers, dispatcher):
        command = containers(server)[0]["command"]
        context = serve_command.make_context("serve", command[3:])
        assert context.params["call_timeout"] == 2.5
        assert context.params["call_memory_mib"] == 1024
        assert context.params["call_max_output_bytes"] == 4096

    changed = spec.model_copy(
        update={"limits": spec.limits.model_copy(update={"timeout_seconds": 30.0})}
    )
    for build in (build_sandbox.worker_statefulset, build_sandbox.dispatcher_deployment):
        before, after = build(pool, spec, settings), build(pool, changed, settings)
        assert before["spec"]["template"] != after["spec"]["template"]
        command = containers(after)[0]["command"]
        assert command[command.index("--call-timeout") + 1] == "30"


def test_the_pools_call_limits_stay_within_the_sandboxs_ceilings() -> None:
    """The most spec.limits allows is what a sandbox server takes as a default: a pool the
    API server accepts never has workers that refuse to start over its limits."""
    ceiling = LimitPolicy().maximum
    highest = SandboxPoolSpec.model_validate(
        {
            "limits": {
                "timeoutSeconds": ceiling.timeout_seconds,
                "memoryMib": ceiling.memory_bytes // MiB,
                "outputBytes": ceiling.output_bytes,
            }
        }
    )
    for name, value in highest.limits.model_dump(by_alias=True).items():
        with pytest.raises(ValidationError, match=name):
            SandboxPoolSpec.model_validate({"limits": {name: value + 1}})
    command = containers(
        build_sandbox.worker_statefulset(parent("SandboxPool", "pool"), highest, OperatorSettings())
    )[0]["command"]
    context = serve_command.make_context("serve", command[3:])
    call_policy(
        context.params["call_timeout"],
        context.params["call_memory_mib"],
        context.params["call_max_output_bytes"],
    )


@pytest.mark.parametrize(
    ("mechanism", "isolation"), [("UserNamespace", "Required"), ("Capabilities", "Disabled")]
)
def test_sandbox_workers_run_as_non_root_without_capabilities_otherwise(
    mechanism: str, isolation: str
) -> None:
    settings = OperatorSettings.model_validate({"sandbox": {"isolationMechanism": mechanism}})
    spec = SandboxPoolSpec.model_validate({"isolation": isolation})
    workers = build_sandbox.worker_statefulset(parent("SandboxPool", "pool"), spec, settings)
    (worker,) = containers(workers)
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "runAsUser" not in worker["securityContext"]
    assert workers["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 65532


def _policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in objs if p["kind"] == "NetworkPolicy"}


def test_network_policies_close_every_plane() -> None:
    """Which flows the policies admit is tests/operator/test_network_flows.py's; here, what
    each resource makes and when."""
    settings = OperatorSettings.model_validate(
        {"networkPolicies": {"operatorNamespace": "kubestar-system"}}
    )
    pool = _policies(
        build_sandbox.children(parent("SandboxPool", "pool"), SandboxPoolSpec(), settings)
    )
    assert set(pool) == {"pool-sandbox-worker", "pool-sandbox"}
    # Workers: no egress at all.
    workers = pool["pool-sandbox-worker"]
    assert workers["podSelector"]["matchLabels"][o.LABEL_COMPONENT] == "sandbox-worker"
    assert workers["egress"] == []
    assert pool["pool-sandbox"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": 50052}]

    fleet = _policies(
        build_fleet.children(parent("RolloutFleet", "f"), RolloutFleetSpec(), settings)
    )
    assert set(fleet) == {"f-engine", "f-scheduler"}
    callers = fleet["f-scheduler"]["ingress"][0]["from"]
    assert {"matchLabels": {"kubernetes.io/metadata.name": "kubestar-system"}} in [
        peer.get("namespaceSelector") for peer in callers
    ]

    run_spec = tiny_run()[1]
    run = _policies(build_trainer.network_policies(parent("TrainingRun", "r"), run_spec, settings))
    assert set(run) == {"r-trainer", "r-trainer-rank0"}
    assert run["r-trainer-rank0"]["podSelector"]["matchLabels"][build_trainer.LABEL_WORKER] == "0"
    for spec in (*pool.values(), *fleet.values(), *run.values()):
        assert spec["policyTypes"] == ["Ingress", "Egress"]

    # Off, or on the host's network (where policies do not apply): none.
    for values in ({"networkPolicies": {"enabled": False}}, {"network": {"hostNetwork": True}}):
        other = OperatorSettings.model_validate(values)
        assert not _policies(
            build_sandbox.children(parent("SandboxPool", "p"), SandboxPoolSpec(), other)
        )
        assert not _policies(
            build_fleet.children(parent("RolloutFleet", "f"), RolloutFleetSpec(), other)
        )
        assert not build_trainer.network_policies(parent("TrainingRun", "r"), run_spec, other)


def test_the_scheduler_looks_its_api_server_up_only_by_name() -> None:
    fleet = parent("RolloutFleet", "f")
    for host, lookups in (("", False), ("10.0.0.1", False), ("[::1]", False), ("api.local", True)):
        settings = OperatorSettings.model_validate({"network": {"apiServerHost": host}})
        _, scheduler = build_fleet.network_policies(fleet, RolloutFleetSpec(), settings)
        assert (o.DNS_EGRESS in scheduler["spec"]["egress"]) is lookups, host


def test_host_network_is_a_setting() -> None:
    settings = OperatorSettings.model_validate({"network": {"hostNetwork": True}})
    pool = parent("SandboxPool", "pool")
    spec = SandboxPoolSpec()
    pod = build_sandbox.worker_statefulset(pool, spec, settings)["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert build_sandbox.endpoint("pool", "team", spec, settings) == "127.0.0.1:50051"
    (fleet,) = build_fleet.engine_deployments(
        parent("RolloutFleet", "f"), RolloutFleetSpec(), settings
    )
    assert fleet["spec"]["template"]["spec"]["hostNetwork"] is True


def test_on_the_host_network_each_engine_is_a_deployment_on_a_port_of_its_own() -> None:
    """Pods on a node's network share its ports: engine i serves on engine.port + i, from a
    Deployment of its own, so that a fleet scales on one node; an engine beyond
    spec.replicas keeps its Deployment at 0 (the operator never deletes)."""
    fleet = parent("RolloutFleet", "f")
    spec = RolloutFleetSpec.model_validate({"replicas": 2, "accelerator": "cpu"})
    host = OperatorSettings.model_validate({"network": {"hostNetwork": True}})
    engines = build_fleet.engine_deployments(fleet, spec, host)
    assert [e["metadata"]["name"] for e in engines] == ["f-engine-0", "f-engine-1"]
    assert [e["spec"]["replicas"] for e in engines] == [1, 1]
    common = build_fleet.engine_selector("f")
    for index, engine in enumerate(engines):
        port = 8000 + index
        (container,) = containers(engine)
        assert container["ports"] == [
            {"name": "http", "containerPort": port, "protocol": "TCP", "hostPort": port}
        ]
        assert container["command"][container["command"].index("--port") + 1] == str(port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == port
        own = engine["spec"]["selector"]["matchLabels"]
        labels = engine["spec"]["template"]["metadata"]["labels"]
        # Each Deployment selects its own pod; the fleet's selector (status.selector, the
        # scheduler's) all of them.
        assert own == {**common, build_fleet.LABEL_ENGINE_INDEX: str(index)}
        assert own.items() <= labels.items() and common.items() <= labels.items()
        assert engine["metadata"]["labels"][build_fleet.LABEL_ENGINE_INDEX] == str(index)
    # Scaled down to 1 with 3 engines' Deployments in the cluster: the others at 0.
    fewer = spec.model_copy(update={"replicas": 1})
    third = build_fleet.engine_deployment(fleet, spec, host, 2)
    count = build_fleet.engine_count([*engines, third])
    assert count == 3
    kept = build_fleet.engine_deployments(fleet, fewer, host, existing=count)
    assert [(e["metadata"]["name"], e["spec"]["replicas"]) for e in kept] == [
        ("f-engine-0", 1),
        ("f-engine-1", 0),
        ("f-engine-2", 0),
    ]
    children = build_fleet.children(fleet, fewer, host, existing=count)
    assert [c for c in children if c["metadata"]["name"].startswith("f-engine-")] == kept
    # With pod networking: one Deployment of every engine, all on engine.port.
    (one,) = build_fleet.engine_deployments(fleet, spec, OperatorSettings(), existing=3)
    assert (one["metadata"]["name"], one["spec"]["replicas"]) == ("f-engine", 2)
    assert one["spec"]["selector"]["matchLabels"] == common
    assert containers(one)[0]["ports"][0]["containerPort"] == 8000
    assert build_fleet.engine_count([one]) == 0


def test_a_deleted_engine_serves_until_the_scheduler_let_it_go() -> None:
    """A scale-down or a rolling update deletes an engine pod: it keeps serving for three of
    the scheduler's discovery rounds (which drop a terminating pod and move its turns)."""
    engine = build_fleet.engine_deployment(
        parent("RolloutFleet", "f"), RolloutFleetSpec(), OperatorSettings()
    )
    (container,) = containers(engine)
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause == ["sleep", str(build_fleet.ENGINE_DRAIN_SECONDS)]
    assert build_fleet.ENGINE_DRAIN_SECONDS >= 3 * build_fleet.DISCOVERY_INTERVAL_SECONDS
    grace = engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > build_fleet.ENGINE_DRAIN_SECONDS
    scheduler = containers(
        build_fleet.scheduler_deployment(
            parent("RolloutFleet", "f"), RolloutFleetSpec(), OperatorSettings()
        )
    )[0]["command"]
    interval = scheduler[scheduler.index("--k8s-interval") + 1]
    assert interval == str(build_fleet.DISCOVERY_INTERVAL_SECONDS)


def metrics_ports(obj: dict[str, Any]) -> list[int]:
    return [
        port["containerPort"]
        for container in containers(obj)
        for port in container.get("ports", [])
        if port["name"] == "metrics"
    ]


def test_pools_and_fleets_on_the_hosts_network_get_metrics_ports_of_their_own() -> None:
    """On the host's network two pools (and two fleets' schedulers) of a node would share
    one metrics port, and the second pod would not start: each takes its serving port's."""

    def ports(settings: OperatorSettings) -> list[int]:
        found = []
        for port in (50051, 50151):
            pool = parent("SandboxPool", f"p{port}")
            spec = SandboxPoolSpec(port=port)
            found += metrics_ports(build_sandbox.worker_statefulset(pool, spec, settings))
            found += metrics_ports(build_sandbox.dispatcher_deployment(pool, spec, settings))
        for port in (50061, 50071):
            fleet = parent("RolloutFleet", f"f{port}")
            spec_f = RolloutFleetSpec.model_validate({"scheduler": {"port": port}})
            found += metrics_ports(build_fleet.scheduler_deployment(fleet, spec_f, settings))
        return found

    host = ports(OperatorSettings.model_validate({"network": {"hostNetwork": True}}))
    assert host == [51052, 51051, 51152, 51151, 51061, 51071]
    defaults = OperatorSettings().ports
    pods = ports(OperatorSettings())
    assert set(pods) == {
        defaults.sandbox_worker_metrics,
        defaults.sandbox_dispatcher_metrics,
        defaults.scheduler_metrics,
    }


@pytest.mark.parametrize(
    ("accelerator", "resource", "image"),
    [
        ("amd", "amd.com/gpu", "rocm/vllm"),
        ("nvidia", "nvidia.com/gpu", "vllm/vllm-openai"),
        ("cpu", None, "kubestar-engine-cpu"),
    ],
)
def test_engines_by_accelerator(accelerator: str, resource: str | None, image: str) -> None:
    spec = RolloutFleetSpec.model_validate(
        {
            "accelerator": accelerator,
            "replicas": 2,
            "engine": {"tensorParallelSize": 2 if resource else 1, "maxModelLen": 8192},
        }
    )
    deployment = build_fleet.engine_deployment(
        parent("RolloutFleet", "f"), spec, OperatorSettings()
    )
    (engine,) = containers(deployment)
    assert engine["image"].startswith(image)
    assert deployment["spec"]["replicas"] == 2
    # Replaced a quarter at a time, with no extra engine (it could not get the GPUs).
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "25%"},
    }
    command = engine["command"]
    assert command[command.index("--max-model-len") + 1] == "8192"
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert "VLLM_SERVER_DEV_MODE" not in env  # weights come through kubestar's route
    if resource:
        assert engine["resources"]["limits"] == {resource: "2"}
        assert command[command.index("--") + 1 :][:3] == [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
        ]
        assert command[command.index("--tensor-parallel-size") + 1] == "2"
        tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
        assert tolerations[0]["key"] == resource
    else:
        assert "resources" not in engine or not engine["resources"].get("limits")
        assert command[:3] == ["kubestar", "engine", "serve"]
        assert "--device" in command and command[command.index("--device") + 1] == "cpu"
        # Eager only: no torch.compile at run time (no C++ compiler in the engine image).
        assert env["TORCHDYNAMO_DISABLE"] == "1"


def test_model_from_a_pvc() -> None:
    spec = RolloutFleetSpec.model_validate(
        {
            "accelerator": "amd",
            "model": {"name": "Qwen3-14B", "pvcClaimName": "models", "pvcSubPath": "Qwen3-14B"},
        }
    )
    deployment = build_fleet.engine_deployment(
        parent("RolloutFleet", "f"), spec, OperatorSettings()
    )
    (engine,) = containers(deployment)
    assert engine["command"][engine["command"].index("--model") + 1] == "/models/Qwen3-14B"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (volumes)


def test_trainer_pods_read_the_model_from_its_claim() -> None:
    body, spec, fleet, pool = tiny_run()
    job = build_trainer.job(body, spec, fleet, pool, OperatorSettings())
    assert "model" not in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}
    claimed = spec.model_copy(
        update={"model": ModelSource(name="Qwen3-14B", pvc_claim_name="models", pvc_sub_path="q")}
    )
    pod = build_trainer.job(body, claimed, fleet, pool, OperatorSettings())["spec"]["template"]
    (trainer,) = pod["spec"]["containers"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in trainer["volumeMounts"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["spec"]["volumes"]
    # Where the trainer (`kubestar train --in-cluster`) and the engines load it from.
    assert claimed.model.location() == "/models/q"
    assert ModelSource(path="/opt/m", name="x").location() == "/opt/m"


def test_a_model_that_names_none_is_the_embedded_default_and_shows_no_name() -> None:
    """A claim's model is not shown as SmolLM2's in `kubectl get -o yaml` (the name's default
    is empty); a source that gives nothing is the embedded model, here and in a local run."""
    claimed = ModelSource(pvc_claim_name="models", pvc_sub_path="Qwen3-14B")
    assert claimed.name == "" and claimed.location() == "/models/Qwen3-14B"
    assert "name" not in claimed.model_dump(by_alias=True, exclude_defaults=True)
    assert ModelSource().location() == ModelSource().local_location() == DEFAULT_MODEL
    assert ModelSource(name="tiny-random-llama").local_location() == "tiny-random-llama"
    # A local run cannot mount the claim: its path is where the same model is found.
    assert ModelSource(pvc_claim_name="m", path="/opt/q").local_location() == "/opt/q"
    # A fleet serves it under its location when it has no name.
    spec = RolloutFleetSpec.model_validate(
        {"model": {"pvcClaimName": "models", "pvcSubPath": "q"}, "scheduler": {"openaiPort": 8001}}
    )
    (container,) = containers(
        build_fleet.scheduler_deployment(parent("RolloutFleet", "f"), spec, OperatorSettings())
    )
    command = container["command"]
    assert command[command.index("--served-model-name") + 1] == "/models/q"


def test_an_operator_upgrade_leaves_gpu_engines_alone() -> None:
    """A new kubestar image (a chart or operator upgrade) changes nothing in GPU engines,
    which run vLLM's own image, so they are not restarted; CPU engines run kubestar's
    engine image, which the same upgrade leaves as it is."""
    fleet = parent("RolloutFleet", "f")
    before, after = OperatorSettings(), OperatorSettings()
    after.images.kubestar = "kubestar:0.2.0"
    for accelerator in ("nvidia", "amd", "cpu"):
        spec = RolloutFleetSpec.model_validate({"accelerator": accelerator, "replicas": 8})
        old = build_fleet.engine_deployment(fleet, spec, before)
        new = build_fleet.engine_deployment(fleet, spec, after)
        assert o.spec_hash(old) == o.spec_hash(new), accelerator
    scheduler_old = build_fleet.scheduler_deployment(fleet, spec, before)
    assert o.spec_hash(scheduler_old) != o.spec_hash(
        build_fleet.scheduler_deployment(fleet, spec, after)
    )


def test_one_pod_deployments_roll_without_a_deadlock_on_the_hosts_network() -> None:
    """The scheduler and the dispatcher: a new pod first with pod networking (no gap); on
    the host's network the old one goes first, since the new one needs the same host ports
    (a surge pod stayed Pending beside the old one for good, and an upgrade never rolled)."""
    fleet, pool = parent("RolloutFleet", "f"), parent("SandboxPool", "p")
    fleet_spec, pool_spec = RolloutFleetSpec(), SandboxPoolSpec()
    for host_network, surge, unavailable in ((False, 1, 0), (True, 0, 1)):
        settings = OperatorSettings.model_validate({"network": {"hostNetwork": host_network}})
        for deployment in (
            build_fleet.scheduler_deployment(fleet, fleet_spec, settings),
            build_sandbox.dispatcher_deployment(pool, pool_spec, settings),
        ):
            assert deployment["spec"]["strategy"] == {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
            }, (host_network, deployment["metadata"]["name"])


def test_scheduler_is_wired_to_the_engines() -> None:
    fleet = parent("RolloutFleet", "f")
    spec = RolloutFleetSpec.model_validate(
        {
            "scheduler": {"policy": "least-requests", "weightsReloadTimeoutSeconds": 120},
            "engine": {"port": 8100},
        }
    )
    scheduler = build_fleet.scheduler_deployment(fleet, spec, OperatorSettings())
    command = containers(scheduler)[0]["command"]
    selector = command[command.index("--k8s-selector") + 1]
    engine_labels = build_fleet.engine_deployment(fleet, spec, OperatorSettings())["spec"][
        "template"
    ]["metadata"]["labels"]
    for item in selector.split(","):
        key, value = item.split("=")
        assert engine_labels[key] == value
    assert command[command.index("--k8s-port") + 1] == "8100"
    assert command[command.index("--policy") + 1] == "least-requests"
    assert command[command.index("--weights-reload-timeout") + 1] == "120"
    assert scheduler["spec"]["template"]["spec"]["serviceAccountName"] == "f-scheduler"
    role = build_fleet.scheduler_rbac(fleet)[1]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_the_openai_port_serves_the_fleets_model_through_the_scheduler() -> None:
    fleet = parent("RolloutFleet", "f")
    off = RolloutFleetSpec.model_validate({"model": {"name": "SmolLM2-135M-Instruct"}})
    assert (
        "--openai-listen"
        not in containers(build_fleet.scheduler_deployment(fleet, off, OperatorSettings()))[0][
            "command"
        ]
    )
    assert build_fleet.openai_endpoint("f", "ns", off, OperatorSettings()) == ""
    spec = RolloutFleetSpec.model_validate(
        {"model": {"name": "SmolLM2-135M-Instruct"}, "scheduler": {"openaiPort": 8001}}
    )
    (container,) = containers(build_fleet.scheduler_deployment(fleet, spec, OperatorSettings()))
    command = container["command"]
    assert command[command.index("--openai-listen") + 1] == "0.0.0.0:8001"
    assert command[command.index("--tokenizer") + 1] == "SmolLM2-135M-Instruct"
    assert command[command.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"
    assert {"name": "openai", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    service = build_fleet.scheduler_service(fleet, spec)
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc", "openai"]
    assert build_fleet.openai_endpoint("f", "ns", spec, OperatorSettings()) == (
        "http://f-scheduler.ns.svc.cluster.local:8001/v1"
    )
    # Its callers run wherever the user runs them (the API requires the token).
    _, scheduler_policy = build_fleet.network_policies(fleet, spec, OperatorSettings())
    assert {"ports": [{"protocol": "TCP", "port": "openai"}]} in scheduler_policy["spec"]["ingress"]
    _, closed = build_fleet.network_policies(fleet, RolloutFleetSpec(), OperatorSettings())
    assert len(closed["spec"]["ingress"]) == 2


def test_the_http_port_serves_the_sandbox_dialects_from_the_dispatcher() -> None:
    pool = parent("SandboxPool", "pool")
    off = SandboxPoolSpec()
    (container,) = containers(build_sandbox.dispatcher_deployment(pool, off, OperatorSettings()))
    assert "--http-listen" not in container["command"]
    assert [p["name"] for p in container["ports"]] == ["grpc", "metrics"]
    assert build_sandbox.http_endpoint("pool", "team", off, OperatorSettings()) == ""
    _, closed = build_sandbox.network_policies(pool, off, OperatorSettings())
    assert len(closed["spec"]["ingress"]) == 2

    spec = SandboxPoolSpec.model_validate({"httpPort": 8080})
    (container,) = containers(build_sandbox.dispatcher_deployment(pool, spec, OperatorSettings()))
    command = container["command"]
    assert command[command.index("--http-listen") + 1] == "0.0.0.0:8080"
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    service = build_sandbox.dispatcher_service(pool, spec)
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc", "http"]
    assert build_sandbox.http_endpoint("pool", "team", spec, OperatorSettings()) == (
        "http://pool-sandbox.team.svc.cluster.local:8080"
    )
    # Its callers run wherever the user runs verl (the APIs require the token); the workers
    # stay reachable by the dispatcher only.
    workers, dispatcher = build_sandbox.network_policies(pool, spec, OperatorSettings())
    assert {"ports": [{"protocol": "TCP", "port": "http"}]} in dispatcher["spec"]["ingress"]
    assert workers == build_sandbox.network_policies(pool, off, OperatorSettings())[0]
    with pytest.raises(ValidationError, match="httpPort must differ from port"):
        SandboxPoolSpec.model_validate({"httpPort": 50051})


def tiny_run() -> tuple[dict[str, Any], TrainingRunSpec, RolloutFleetSpec, SandboxPoolSpec]:
    resources = {type(r).__name__: r for r in load_manifests(EXAMPLES / "tiny-cpu.yaml")}
    run = resources["TrainingRun"]
    body = parent("TrainingRun", run.metadata.name)
    spec = TrainingRunSpec.model_validate(run.model_dump(by_alias=True)["spec"])
    fleet = RolloutFleetSpec.model_validate(
        resources["RolloutFleet"].model_dump(by_alias=True)["spec"]
    )
    pool = SandboxPoolSpec.model_validate(
        resources["SandboxPool"].model_dump(by_alias=True)["spec"]
    )
    return body, spec, fleet, pool


def test_trainer_job_follows_the_contract() -> None:
    body, spec, fleet, pool = tiny_run()
    job = build_trainer.job(body, spec, fleet, pool, OperatorSettings())
    assert job["spec"]["backoffLimit"] == 6  # checkpoints on the run's own claim
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "tiny-cpu-trainer"
    (trainer,) = pod["containers"]
    assert trainer["command"] == [
        "kubestar",
        "train",
        "-f",
        "/etc/kubestar/run.yaml",
        "--in-cluster",
        "--log-level",
        "info",
    ]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    parsed = trainer_contract.TrainerEnvironment.from_env(env)
    assert parsed.name == "tiny-cpu" and parsed.namespace == "team"
    assert parsed.scheduler_endpoint == "tiny-fleet-scheduler.team.svc.cluster.local:50061"
    assert parsed.sandbox_endpoint == "tiny-sandbox-sandbox.team.svc.cluster.local:50051"
    assert parsed.sandbox_limits == {"timeoutSeconds": 5.0, "memoryMib": 512, "outputBytes": 65536}
    assert parsed.checkpoint_dir == "/var/lib/kubestar/checkpoints"
    assert (parsed.workers, parsed.worker_index, parsed.processes) == (1, 0, 1)
    assert parsed.rendezvous == ""  # a world of one process meets nobody
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    assert mounts["config"] == "/etc/kubestar"

    config = build_trainer.config_map(body, spec)
    document = yaml.safe_load(config["data"]["run.yaml"])
    assert document["kind"] == "TrainingRun" and document["metadata"]["name"] == "tiny-cpu"
    assert TrainingRunSpec.model_validate(document["spec"]) == spec


def test_trainer_role_is_limited_to_its_own_run() -> None:
    body, _, _, _ = tiny_run()
    role = build_trainer.role(body)
    named = {
        (rule["apiGroups"][0], rule["resources"][0]): rule["resourceNames"]
        for rule in role["rules"]
    }
    assert named == {
        ("kubestar.dev", "trainingruns"): ["tiny-cpu"],
        ("kubestar.dev", "trainingruns/status"): ["tiny-cpu"],
        ("", "configmaps"): ["tiny-cpu-metrics"],  # its metrics log, nothing else
    }
    verbs = {rule["resources"][0]: rule["verbs"] for rule in role["rules"]}
    assert verbs == {
        "trainingruns": ["get"],
        "trainingruns/status": ["get", "patch"],
        "configmaps": ["get", "patch"],
    }
    binding = build_trainer.role_binding(body)
    assert binding["subjects"][0]["name"] == "tiny-cpu-trainer"


def test_several_workers_make_a_job_each() -> None:
    """2 workers x 2 processes: a world of 4, worker 1's first process is rank 2, both find
    worker 0 at the headless Service, which selects worker 0's pod alone."""
    body, spec, fleet, pool = tiny_run()
    trainer = spec.trainer.model_copy(update={"workers": 2, "processes_per_worker": 2})
    spec = spec.model_copy(update={"trainer": trainer})
    settings = OperatorSettings()
    jobs = build_trainer.jobs(body, spec, fleet, pool, settings)
    assert [job["metadata"]["name"] for job in jobs] == ["tiny-cpu-trainer", "tiny-cpu-trainer-1"]
    environments = [
        trainer_contract.TrainerEnvironment.from_env(
            {e["name"]: e["value"] for e in containers(job)[0]["env"]}
        )
        for job in jobs
    ]
    assert [(e.worker_index, e.workers, e.processes) for e in environments] == [
        (0, 2, 2),
        (1, 2, 2),
    ]
    assert {e.rendezvous for e in environments} == {"tiny-cpu-trainer.team.svc.cluster.local:29500"}
    pod_labels = [job["spec"]["template"]["metadata"]["labels"] for job in jobs]
    service = build_trainer.rendezvous_service(body, settings)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    selector = service["spec"]["selector"].items()
    assert selector <= pod_labels[0].items() and not selector <= pod_labels[1].items()
    assert service["spec"]["ports"][0]["port"] == settings.ports.trainer_rendezvous
    # Every rank writes a checkpoint shard: several pods need one volume they all mount.
    problem = build_trainer.spec_problem(spec, settings)
    assert problem is not None and "spec.trainer.workers is 2" in problem
    shared = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"pvc_claim_name": "shared"})}
    )
    assert build_trainer.spec_problem(shared, settings) is None


def test_accelerators_per_pod_equal_processes_per_pod() -> None:
    from kubestar.api.v1alpha1 import TrainerSpec
    from pydantic import ValidationError

    TrainerSpec.model_validate(
        {"processesPerWorker": 8, "resources": {"limits": {"amd.com/gpu": 8}}}
    )
    with pytest.raises(ValidationError, match=r"resources.limits\[nvidia.com/gpu\] is 4"):
        TrainerSpec.model_validate(
            {"processesPerWorker": 8, "resources": {"limits": {"nvidia.com/gpu": 4}}}
        )


def test_long_names_are_shortened_uniquely() -> None:
    long_a = "a" * 60 + "-one"
    long_b = "a" * 60 + "-two"
    assert o.base_name(long_a) != o.base_name(long_b)
    assert len(build_sandbox.worker_name(long_a)) <= 52
    assert len(o.label_value("x" * 200)) <= 63
    assert o.base_name("short") == "short"


def test_trainer_patch_carries_only_trainer_fields() -> None:
    from kubestar.api.v1alpha1 import TrainingMetrics, TrainingRunStatus

    status = TrainingRunStatus(
        phase="Training",
        stage="s1",
        step=3,
        total_steps=10,
        metrics=TrainingMetrics(reward=0.5),
        conditions=[],
    )
    body = trainer_contract.trainer_patch(status)["status"]
    assert body["phase"] == "Training" and body["step"] == 3 and body["totalSteps"] == 10
    assert body["metrics"]["reward"] == 0.5
    assert "conditions" not in body and "observedGeneration" not in body
    pending = trainer_contract.trainer_patch(TrainingRunStatus(phase="Pending"))["status"]
    assert "phase" not in pending


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_children_listen_on_the_bind_address() -> None:
    # Default: every interface of the pod (pod networking).
    pool, fleet = parent("SandboxPool", "pool"), parent("RolloutFleet", "f")
    default = OperatorSettings()
    worker = containers(build_sandbox.worker_statefulset(pool, SandboxPoolSpec(), default))[0]
    assert _flag(worker["command"], "--listen") == "0.0.0.0:50052"
    # hostNetwork on a node whose address is 127.0.0.1: nothing may listen beyond loopback.
    settings = OperatorSettings.model_validate(
        {"network": {"hostNetwork": True, "bindAddress": "127.0.0.1"}}
    )
    assert settings.network.loopback_only and not default.network.loopback_only
    body, spec, fleet_spec, pool_spec = tiny_run()
    commands = [
        containers(build_sandbox.worker_statefulset(pool, pool_spec, settings))[0]["command"],
        containers(build_sandbox.dispatcher_deployment(pool, pool_spec, settings))[0]["command"],
        containers(build_fleet.scheduler_deployment(fleet, fleet_spec, settings))[0]["command"],
    ]
    for command in commands:
        assert _flag(command, "--listen").startswith("127.0.0.1:")
        assert _flag(command, "--metrics-address") == "127.0.0.1"
    for accelerator in ("cpu", "amd"):
        engine_spec = fleet_spec.model_copy(update={"accelerator": accelerator})
        engine = containers(build_fleet.engine_deployment(fleet, engine_spec, settings))[0]
        assert _flag(engine["command"], "--host") == "127.0.0.1"
    job = build_trainer.job(body, spec, fleet_spec, pool_spec, settings)
    env = {e["name"]: e["value"] for e in containers(job)[0]["env"]}
    # Ray (local, in the trainer pod) takes the loopback address as the node's.
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    default_job = build_trainer.job(body, spec, fleet_spec, pool_spec, default)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in {
        e["name"] for e in containers(default_job)[0]["env"]
    }
    ipv6 = OperatorSettings.model_validate({"network": {"bindAddress": "::1"}})
    dispatcher = build_sandbox.dispatcher_deployment(pool, pool_spec, ipv6)
    assert _flag(containers(dispatcher)[0]["command"], "--listen") == "[::1]:50051"


def test_shared_checkpoints_reach_the_engines_of_a_volume_fleet() -> None:
    body, spec, fleet_spec, pool_spec = tiny_run()
    fleet = parent("RolloutFleet", "tiny-fleet")
    broadcast = fleet_spec
    fleet_spec = fleet_spec.model_copy(update={"weight_sync": "volume"})
    # Without a shared volume: the run's own claim; engines mount nothing of it.
    job = build_trainer.job(body, spec, fleet_spec, pool_spec, OperatorSettings())
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "tiny-cpu-checkpoints"},
    }
    engine = build_fleet.engine_deployment(fleet, fleet_spec, OperatorSettings())
    assert "checkpoints" not in {v["name"] for v in engine["spec"]["template"]["spec"]["volumes"]}

    settings = OperatorSettings.model_validate(
        {"trainer": {"sharedCheckpoints": {"hostPath": "/srv/kubestar"}}}
    )
    job = build_trainer.job(body, spec, fleet_spec, pool_spec, settings)
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["hostPath"] == {"path": "/srv/kubestar", "type": "Directory"}
    (trainer,) = pod["containers"]
    mounts = {m["name"]: m for m in trainer["volumeMounts"]}
    env = trainer_contract.TrainerEnvironment.from_env(
        {e["name"]: e["value"] for e in trainer["env"]}
    )
    # A folder per run on the shared volume, below the path the engines mount it at; the
    # trainer mounts only that folder (subPath), so it cannot reach another run's.
    assert env.checkpoint_dir == "/var/lib/kubestar/checkpoints/team/tiny-cpu"
    assert mounts["checkpoints"] == {
        "name": "checkpoints",
        "mountPath": "/var/lib/kubestar/checkpoints/team/tiny-cpu",
        "subPath": "team/tiny-cpu",
    }
    other = dict(body, metadata={**body["metadata"], "name": "other"})
    other_job = build_trainer.job(other, spec, fleet_spec, pool_spec, settings)
    (other_trainer,) = other_job["spec"]["template"]["spec"]["containers"]
    other_mounts = {m["name"]: m for m in other_trainer["volumeMounts"]}
    assert other_mounts["checkpoints"]["subPath"] == "team/other"
    engine_pod = build_fleet.engine_deployment(fleet, fleet_spec, settings)["spec"]["template"][
        "spec"
    ]
    (engine,) = engine_pod["containers"]
    engine_mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert engine_mounts["checkpoints"] == {
        "name": "checkpoints",
        "mountPath": "/var/lib/kubestar/checkpoints",
        "readOnly": True,
    }
    assert {v["name"]: v for v in engine_pod["volumes"]}["checkpoints"]["hostPath"]["path"] == (
        "/srv/kubestar"
    )
    # Weights broadcast: the engines mount nothing of the trainers', shared volume or not.
    engine_pod = build_fleet.engine_deployment(fleet, broadcast, settings)["spec"]["template"]
    assert "checkpoints" not in {v["name"] for v in engine_pod["spec"]["volumes"]}
    assert build_fleet.spec_problem(fleet_spec, settings) is None
    assert build_fleet.spec_problem(fleet_spec, OperatorSettings()) == (
        "spec.weightSync is volume, but this installation has no shared checkpoint volume "
        "for the engines to read the trainers' weights from: set spec.weightSync to "
        "broadcast, or the chart's trainer.sharedCheckpoints"
    )

    # A ReadWriteMany claim instead; engines mount it read-only.
    settings = OperatorSettings.model_validate(
        {"trainer": {"sharedCheckpoints": {"pvcClaimName": "weights"}}}
    )
    engine_pod = build_fleet.engine_deployment(fleet, fleet_spec, settings)["spec"]["template"][
        "spec"
    ]
    assert {v["name"]: v for v in engine_pod["volumes"]}["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }
    # A run with its own checkpoint PVC keeps it (and its own path).
    own = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"pvc_claim_name": "mine"})}
    )
    job = build_trainer.job(body, own, fleet_spec, pool_spec, settings)
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "mine"}
    with pytest.raises(ValueError, match="at most one"):
        OperatorSettings.model_validate(
            {"trainer": {"sharedCheckpoints": {"pvcClaimName": "a", "hostPath": "/b"}}}
        )


def test_sandbox_workers_carry_the_isolation_setting() -> None:
    pool = parent("SandboxPool", "pool")
    settings = OperatorSettings()
    required = containers(build_sandbox.worker_statefulset(pool, SandboxPoolSpec(), settings))[0]
    assert SandboxPoolSpec().isolation == "Required"
    assert "--no-isolation" not in required["command"]
    # Why a worker could not start (one line) reaches the pod's status.
    assert _flag(required["command"], "--termination-log") == required["terminationMessagePath"]
    assert required["terminationMessagePolicy"] == "File"
    # Its calls' uids are a range of the pod's own (the kernel's per-uid counts are node-wide).
    assert _flag(required["command"], "--uid-range-key") == "$(POD_UID)"
    pod_uid = {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
    assert pod_uid in required["env"]

    disabled = SandboxPoolSpec.model_validate({"isolation": "Disabled"})
    worker = containers(build_sandbox.worker_statefulset(pool, disabled, settings))[0]
    assert "--no-isolation" in worker["command"]
    dispatcher = containers(build_sandbox.dispatcher_deployment(pool, disabled, settings))[0]
    assert "--no-isolation" not in dispatcher["command"]
    # What the operator passes is what `kubestar sandbox serve` takes.
    for command in (required["command"], worker["command"], dispatcher["command"]):
        assert command[:3] == ["kubestar", "sandbox", "serve"]
        serve_command.make_context("serve", command[3:])
    with pytest.raises(ValidationError, match="isolation"):
        SandboxPoolSpec.model_validate({"isolation": "off"})


def test_checkpoints_go_to_a_claim_of_the_runs_own_by_default() -> None:
    body, spec, _, _ = tiny_run()
    settings = OperatorSettings()
    claim = build_trainer.checkpoint_claim(body, spec, settings)
    assert claim is not None
    assert claim["metadata"]["name"] == "tiny-cpu-checkpoints"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "tiny-cpu"  # deleted with it
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "50Gi"}},
    }
    sized = spec.model_copy(
        update={
            "checkpoint": spec.checkpoint.model_copy(
                update={"storage": "200Gi", "storage_class_name": "fast"}
            )
        }
    )
    claim = build_trainer.checkpoint_claim(body, sized, settings)
    assert claim is not None and claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    # None where the run names a claim or shares the engines' volume.
    named = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"pvc_claim_name": "mine"})}
    )
    assert build_trainer.checkpoint_claim(body, named, settings) is None
    shared = OperatorSettings.model_validate(
        {"trainer": {"sharedCheckpoints": {"hostPath": "/srv/kubestar"}}}
    )
    assert build_trainer.checkpoint_claim(body, spec, shared) is None
    with pytest.raises(ValidationError, match="storage"):
        CheckpointSpec.model_validate({"storage": "lots"})
    with pytest.raises(ValidationError, match=r"ephemeral and checkpoint\.pvcClaimName"):
        CheckpointSpec.model_validate({"ephemeral": True, "pvcClaimName": "c"})


def test_trainer_pods_are_retried_only_where_checkpoints_outlive_them() -> None:
    """A retry resumes from the newest checkpoint: the Job retries where checkpoints outlive
    the pod (the shared volume or the run's claim), never with an emptyDir; SIGTERM gets the
    grace to checkpoint; from Kubernetes 1.26 a drain or eviction does not count."""
    body, spec, fleet, pool = tiny_run()
    settings = OperatorSettings()
    development = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"ephemeral": True})}
    )
    ephemeral = build_trainer.job(body, development, fleet, pool, settings)
    assert ephemeral["spec"]["backoffLimit"] == 0
    pod = ephemeral["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert build_trainer.checkpoint_claim(body, development, settings) is None
    assert pod["terminationGracePeriodSeconds"] == settings.trainer.termination_grace_seconds
    claimed = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"pvc_claim_name": "ckpt"})}
    )
    retried = build_trainer.job(body, claimed, fleet, pool, settings)
    assert retried["spec"]["backoffLimit"] == settings.trainer.backoff_limit == 6
    assert "podFailurePolicy" not in retried["spec"]  # Kubernetes 1.20 has none
    newer = build_trainer.job(body, claimed, fleet, pool, settings, server_version=(1, 29))
    rule, _ = newer["spec"]["podFailurePolicy"]["rules"]  # then a full volume's FailJob
    assert rule == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the Pod Security Standard "restricted" refuses (its checks as
    of Kubernetes 1.30, less those on fields the operator never sets)."""
    found: list[str] = []
    security = pod.get("securityContext") or {}
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        found.append("host namespaces")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    for container in pod["containers"]:
        own = container.get("securityContext") or {}
        name = container["name"]
        if not own.get("runAsNonRoot", security.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if own.get("runAsUser", security.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        profile = own.get("seccompProfile") or security.get("seccompProfile") or {}
        if profile.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
    return found


def pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    return dict((spec.get("jobTemplate", {}).get("spec") or spec)["template"]["spec"])


@pytest.mark.parametrize("accelerator", ["cpu", "nvidia", "amd"])
def test_every_pod_meets_the_restricted_pod_security_standard(accelerator: str) -> None:
    """Every pod the operator makes but one: a sandbox worker that isolates its calls by
    capabilities (the chart's default) runs as root with them (see docs/security.md)."""
    settings = OperatorSettings()
    pool_spec = SandboxPoolSpec()
    fleet_spec = RolloutFleetSpec.model_validate({"accelerator": accelerator})
    run = parent("TrainingRun", "run")
    run_spec = TrainingRunSpec.model_validate(
        {
            "rolloutFleetRef": {"name": "fleet"},
            "sandboxPoolRef": {"name": "pool"},
            "trainer": {"workers": 2},
            "checkpoint": {"pvcClaimName": "ckpt"},
            "stages": [
                {
                    "name": "s",
                    "steps": 1,
                    "maxResponseTokens": 64,
                    "dataset": {"generator": "basic_arithmetic"},
                }
            ],
        }
    )
    children = [
        *build_sandbox.children(parent("SandboxPool", "pool"), pool_spec, settings),
        *build_fleet.children(parent("RolloutFleet", "fleet"), fleet_spec, settings),
        *build_trainer.jobs(run, run_spec, fleet_spec, pool_spec, settings),
    ]
    pods = {
        child["metadata"]["name"]: pod_of(child)
        for child in children
        if child["kind"] in ("Deployment", "StatefulSet", "Job")
    }
    assert len(pods) == 6, sorted(pods)
    violations = {name: restricted_violations(pod) for name, pod in pods.items()}
    assert violations.pop("pool-sandbox-worker") == [
        "worker: runAsNonRoot",
        "worker: runAsUser 0",
        "worker: capabilities added",
    ]
    assert not any(violations.values()), violations
    by_user_namespace = OperatorSettings.model_validate(
        {"sandbox": {"isolationMechanism": "UserNamespace"}}
    )
    workers = build_sandbox.worker_statefulset(
        parent("SandboxPool", "p"), pool_spec, by_user_namespace
    )
    assert restricted_violations(pod_of(workers)) == []


def test_rank_0_alone_serves_metrics_through_a_service_and_scrape_annotations() -> None:
    body, spec, fleet, pool = tiny_run()
    spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"workers": 2})})
    settings = OperatorSettings()
    workers = build_trainer.jobs(body, spec, fleet, pool, settings)
    templates = [job["spec"]["template"] for job in workers]
    port = settings.ports.trainer_metrics
    environments = [
        trainer_contract.TrainerEnvironment.from_env(
            {e["name"]: e["value"] for e in containers(job)[0]["env"]}
        )
        for job in workers
    ]
    assert [e.metrics_listen for e in environments] == [f":{port}", ""]
    annotations = templates[0]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert "annotations" not in templates[1]["metadata"]
    assert containers(workers[0])[0]["ports"][0]["containerPort"] == port
    # On the host's network no port is declared (it would be a host port, and a replacement
    # trainer pod could not be scheduled beside the pod it replaces); the annotations say it.
    host = OperatorSettings.model_validate({"network": {"hostNetwork": True}})
    (on_host, _) = build_trainer.jobs(body, spec, fleet, pool, host)
    assert "ports" not in containers(on_host)[0]
    assert on_host["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
        host.ports.trainer_metrics
    )
    log, service = build_trainer.telemetry(body, settings)
    assert (log["kind"], log["metadata"]["name"]) == ("ConfigMap", "tiny-cpu-metrics")
    assert "data" not in log and "binaryData" not in log  # the trainer's to fill
    assert service["spec"]["selector"][build_trainer.LABEL_WORKER] == "0"
    assert service["spec"]["ports"][0]["targetPort"] == port
