"""The operator's handlers against a real API server and controller-manager: children with
owner references, status and conditions that tell the truth, events, garbage collection."""

from __future__ import annotations

from functools import partial
from typing import Any

import yaml

from e2e.local_cluster import (
    FakeKubelet,
    LocalCluster,
    OperatorProcess,
    apis,
    core,
    kubestar,
    wait_for,
)
from tests.operator.support import EXAMPLES

INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"


def example(kind: str, name: str | None = None) -> dict[str, Any]:
    for document in yaml.safe_load_all((EXAMPLES / "tiny-cpu.yaml").read_text()):
        if document and document["kind"] == kind:
            if name:
                document["metadata"]["name"] = name
            return dict(document)
    raise KeyError(kind)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return None


def wait_condition(
    cluster: LocalCluster,
    path: str,
    type_: str,
    status: str,
    reason: str | None = None,
    timeout: float = 20.0,
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        found = condition(cluster.api().get(path), type_)
        if found and found["status"] == status and (reason is None or found["reason"] == reason):
            return found
        return None

    return wait_for(f"{path}: {type_}={status} {reason or ''}", check, timeout)


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    return any(
        ref["uid"] == owner["metadata"]["uid"] and ref["controller"]
        for ref in obj["metadata"].get("ownerReferences") or []
    )


def events(cluster: LocalCluster, namespace: str, name: str) -> list[tuple[str, str, str]]:
    items = cluster.api().items(core(namespace, "events"))
    return [
        (e["type"], e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == name
    ]


def test_sandbox_pool_children_status_and_ready(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    pool = api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    name = pool["metadata"]["name"]
    children = {
        "statefulset": apis("apps/v1", namespace, "statefulsets", f"{name}-sandbox-worker"),
        "deployment": apis("apps/v1", namespace, "deployments", f"{name}-sandbox"),
        "service": core(namespace, "services", f"{name}-sandbox"),
        "headless": core(namespace, "services", f"{name}-sandbox-worker"),
        "worker policy": apis(
            "networking.k8s.io/v1", namespace, "networkpolicies", f"{name}-sandbox-worker"
        ),
        "dispatcher policy": apis(
            "networking.k8s.io/v1", namespace, "networkpolicies", f"{name}-sandbox"
        ),
    }
    for what, path in children.items():
        child = wait_for(what, partial(api.get, path), timeout=10)
        assert owned_by(child, pool), what
    worker = api.get(children["statefulset"])
    assert worker is not None
    pod = worker["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    path = kubestar(namespace, "sandboxpools", name)
    progressing = wait_condition(cluster, path, "Ready", "False", "Progressing")
    assert "0/1 workers ready" in progressing["message"]
    status = (api.get(path) or {})["status"]
    assert status["endpoint"] == f"{name}-sandbox.{namespace}.svc.cluster.local:50051"
    assert status["observedGeneration"] == pool["metadata"]["generation"]

    kubelet.make_ready(namespace, f"{INSTANCE}={name},{COMPONENT}=sandbox-worker")
    kubelet.make_ready(namespace, f"{INSTANCE}={name},{COMPONENT}=sandbox-dispatcher")
    wait_condition(cluster, path, "Ready", "True", "Ready")
    status = (api.get(path) or {})["status"]
    assert status["readyReplicas"] == 1 and status["capacity"] == 4
    out = cluster.kubectl("get", "-n", namespace, "sbp", name).stdout.splitlines()
    assert out[1].split()[1:5] == ["True", "1", "1", "4"]
    wait_for(
        "events Progressing and Ready",
        lambda: {"Progressing", "Ready"} <= {e[1] for e in events(cluster, namespace, name)},
    )


def test_stuck_pods_are_surfaced(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    pool = example("SandboxPool", "stuck")
    pool["spec"]["image"] = "nope/missing:1"
    api.create(kubestar(namespace, "sandboxpools"), pool)
    (worker,) = wait_for(
        "the worker pod",
        lambda: kubelet.pods(namespace, f"{INSTANCE}=stuck,{COMPONENT}=sandbox-worker"),
    )
    kubelet.set_status(
        worker,
        kubelet.waiting(worker, "ImagePullBackOff", 'Back-off pulling image "nope/missing:1"'),
    )
    ready = wait_condition(
        cluster, kubestar(namespace, "sandboxpools", "stuck"), "Ready", "False", "ImagePullBackOff"
    )
    assert 'Back-off pulling image "nope/missing:1"' in ready["message"]
    assert worker["metadata"]["name"] in ready["message"]
    wait_for(
        "a Warning event ImagePullBackOff",
        lambda: (
            ("Warning", "ImagePullBackOff") in {e[:2] for e in events(cluster, namespace, "stuck")}
        ),
    )

    kubelet.set_status(
        worker,
        kubelet.waiting(
            worker,
            "CrashLoopBackOff",
            "back-off 5m0s restarting failed container",
            {"exitCode": 137, "reason": "OOMKilled"},
        ),
    )
    oom = wait_condition(
        cluster, kubestar(namespace, "sandboxpools", "stuck"), "Ready", "False", "OOMKilled"
    )
    assert "more memory than its limit" in oom["message"]

    fleet = example("RolloutFleet", "gpus")
    fleet["spec"]["accelerator"] = "amd"
    api.create(kubestar(namespace, "rolloutfleets"), fleet)
    (engine,) = wait_for(
        "the engine pod", lambda: kubelet.pods(namespace, f"{INSTANCE}=gpus,{COMPONENT}=engine")
    )
    assert engine["spec"]["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "1"
    kubelet.set_status(
        engine, kubelet.unschedulable("0/3 nodes are available: 3 Insufficient amd.com/gpu.")
    )
    gpu = wait_condition(
        cluster, kubestar(namespace, "rolloutfleets", "gpus"), "Ready", "False", "InsufficientGPU"
    )
    assert "amd.com/gpu" in gpu["message"]


def test_rollout_fleet_children_and_status(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    fleet = api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    name = fleet["metadata"]["name"]
    for path in (
        apis("apps/v1", namespace, "deployments", f"{name}-engine"),
        apis("apps/v1", namespace, "deployments", f"{name}-scheduler"),
        core(namespace, "services", f"{name}-scheduler"),
        core(namespace, "serviceaccounts", f"{name}-scheduler"),
        apis("rbac.authorization.k8s.io/v1", namespace, "roles", f"{name}-scheduler"),
        apis("rbac.authorization.k8s.io/v1", namespace, "rolebindings", f"{name}-scheduler"),
    ):
        child = wait_for(path, partial(api.get, path), timeout=10)
        assert owned_by(child, fleet), path
    kubelet.make_ready(namespace, f"{INSTANCE}={name},{COMPONENT}=engine")
    kubelet.make_ready(namespace, f"{INSTANCE}={name},{COMPONENT}=scheduler")
    path = kubestar(namespace, "rolloutfleets", name)
    wait_condition(cluster, path, "Ready", "True")
    status = (api.get(path) or {})["status"]
    assert status["readyReplicas"] == 1 and status["accelerator"] == "cpu"
    assert status["schedulerEndpoint"] == f"{name}-scheduler.{namespace}.svc.cluster.local:50061"
    assert [e["ready"] for e in status["engines"]] == [True]
    # The scheduler's service account may list pods, nothing more.
    who = f"--as=system:serviceaccount:{namespace}:{name}-scheduler"
    assert (
        cluster.kubectl(
            "auth", "can-i", "list", "pods", "-n", namespace, who, check=False
        ).stdout.strip()
        == "yes"
    )
    assert (
        cluster.kubectl(
            "auth", "can-i", "get", "secrets", "-n", namespace, who, check=False
        ).stdout.strip()
        == "no"
    )


def test_a_fleet_is_sized_through_its_scale_subresource(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    """spec.autoscaling's bounds are the operator's to keep, through the scale subresource
    (with the chart's RBAC: the operator may patch a fleet's scale, not its spec); then
    `kubectl scale`, as a user or a HorizontalPodAutoscaler would. The engines' Deployment
    follows each, and status.lastScale says who changed the size and why."""
    api = cluster.api()
    body = example("RolloutFleet", "elastic")
    body["spec"]["replicas"] = 1
    body["spec"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 3, "target": 4}
    api.create(kubestar(namespace, "rolloutfleets"), body)
    path = kubestar(namespace, "rolloutfleets", "elastic")
    engines = apis("apps/v1", namespace, "deployments", "elastic-engine")

    def replicas(want: int) -> dict[str, Any] | None:
        fleet, deployment = api.get(path) or {}, api.get(engines) or {}
        last = (fleet.get("status") or {}).get("lastScale") or {}
        done = (deployment.get("spec") or {}).get("replicas") == want == last.get("toReplicas")
        return fleet if done else None

    fleet = wait_for("the engines raised to minReplicas", lambda: replicas(2), timeout=30)
    status = fleet["status"]
    assert fleet["spec"]["replicas"] == 2
    assert status["lastScale"]["reason"] == "Autoscaled"
    assert status["lastScale"]["fromReplicas"] == 1
    assert status["lastScale"]["message"] == "minReplicas is 2"
    # No scheduler answers here (the operator's probe is off): no value, no other change.
    assert status["autoscaling"]["desiredReplicas"] == 2 and "value" not in status["autoscaling"]

    api.merge_patch(path, {"spec": {"autoscaling": None}})
    cluster.kubectl("scale", "rolloutfleet", "elastic", "-n", namespace, "--replicas=3")
    fleet = wait_for("the engines scaled to 3", lambda: replicas(3), timeout=30)
    last = fleet["status"]["lastScale"]
    assert (last["reason"], last["fromReplicas"], last["message"]) == ("SpecChanged", 2, "")
    assert "autoscaling" not in fleet["status"]
    # What a HorizontalPodAutoscaler reads: the size and the engine pods' selector.
    scale = api.get(kubestar(namespace, "rolloutfleets", "elastic") + "/scale") or {}
    assert scale["spec"]["replicas"] == 3
    template = (api.get(engines) or {})["spec"]["template"]["metadata"]["labels"]
    selector = dict(pair.split("=") for pair in scale["status"]["selector"].split(","))
    assert selector and selector.items() <= template.items()


def test_spec_change_rolls_out_and_deleted_child_is_recreated(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    api = cluster.api()
    pool = api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool", "grow"))
    sts = apis("apps/v1", namespace, "statefulsets", "grow-sandbox-worker")
    wait_for("the workers", lambda: api.get(sts))
    api.merge_patch(kubestar(namespace, "sandboxpools", "grow"), {"spec": {"replicas": 3}})
    wait_for("3 workers", lambda: (api.get(sts) or {})["spec"]["replicas"] == 3)

    def dispatcher_workers() -> int:
        # The StatefulSet is applied before the dispatcher's Deployment; read it once both are.
        dispatcher = api.get(apis("apps/v1", namespace, "deployments", "grow-sandbox")) or {
            "spec": {"template": {"spec": {"containers": [{"command": []}]}}}
        }
        command = dispatcher["spec"]["template"]["spec"]["containers"][0]["command"]
        return int(command.count("--worker"))

    wait_for("the dispatcher given 3 workers", lambda: dispatcher_workers() == 3)
    api.delete(core(namespace, "services", "grow-sandbox"))
    service = wait_for(
        "the Service re-created",
        lambda: (lambda s: s if s and s["metadata"]["uid"] else None)(
            api.get(core(namespace, "services", "grow-sandbox"))
        ),
    )
    assert owned_by(service, pool)


def test_a_field_the_operator_no_longer_wants_leaves_the_child(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    """Children are created with a POST and updated by server-side apply: what the create
    set and a later spec no longer asks for (the worker's root uid and capabilities, once
    isolation is off) is removed, not kept beside the new fields."""
    api = cluster.api()
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool", "calm"))
    sts = apis("apps/v1", namespace, "statefulsets", "calm-sandbox-worker")

    def security() -> dict[str, Any]:
        worker = api.get(sts) or {"spec": {"template": {"spec": {"containers": [{}]}}}}
        return dict(worker["spec"]["template"]["spec"]["containers"][0].get("securityContext", {}))

    wait_for("the workers", lambda: security() or None)
    assert security()["runAsUser"] == 0 and "SYS_ADMIN" in security()["capabilities"]["add"]
    api.merge_patch(
        kubestar(namespace, "sandboxpools", "calm"), {"spec": {"isolation": "Disabled"}}
    )
    wait_for("root and the capabilities gone", lambda: "runAsUser" not in security())
    assert security()["capabilities"] == {"drop": ["ALL"]}
    worker = api.get(sts)
    assert worker is not None
    assert "--no-isolation" in worker["spec"]["template"]["spec"]["containers"][0]["command"]


def test_deleting_a_resource_garbage_collects_its_children(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet", "gone"))
    selector = f"{INSTANCE}=gone"
    wait_for("engine pods", lambda: kubelet.pods(namespace, selector))
    wait_for("children", partial(api.items, apis("apps/v1", namespace, "deployments"), selector))
    assert not (api.get(kubestar(namespace, "rolloutfleets", "gone")) or {})["metadata"].get(
        "finalizers"
    )
    api.delete(kubestar(namespace, "rolloutfleets", "gone"))
    wait_for(
        "the garbage collector",
        lambda: (
            not api.items(apis("apps/v1", namespace, "deployments"), selector)
            and not api.items(core(namespace, "services"), selector)
            and not api.items(core(namespace, "serviceaccounts"), selector)
        ),
        # The collector finds owners of a custom resource kind by rediscovering the API,
        # every 30 s: a kind new to it may wait that long.
        timeout=90,
    )
    wait_for("pods gone", lambda: not kubelet.pods(namespace, selector), timeout=30)


def test_missing_dependencies_keep_the_run_pending(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    api = cluster.api()
    run = example("TrainingRun", "orphan")
    api.create(kubestar(namespace, "trainingruns"), run)
    path = kubestar(namespace, "trainingruns", "orphan")
    deps = wait_condition(cluster, path, "DependenciesReady", "False", "RolloutFleetNotFound")
    assert "RolloutFleet tiny-fleet and SandboxPool tiny-sandbox not found" in deps["message"]
    assert (api.get(path) or {})["status"]["phase"] == "Pending"
