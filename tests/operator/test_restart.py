"""Restarting the operator changes nothing and loses nothing; with two replicas one leads
(a Lease) and the other takes over when the leader dies."""

from __future__ import annotations

import signal
import time
from typing import Any

from e2e.local_cluster import (
    FakeKubelet,
    LocalCluster,
    OperatorProcess,
    apis,
    core,
    kubestar,
    wait_for,
)
from tests.operator.test_reconcile import example
from tests.operator.test_trainingrun import ready_dependencies, wait_phase

MANAGED = "app.kubernetes.io/managed-by=kubestar-operator"
LISTS = [
    apis("apps/v1", "{ns}", "deployments"),
    apis("apps/v1", "{ns}", "statefulsets"),
    apis("batch/v1", "{ns}", "jobs"),
    core("{ns}", "services"),
    core("{ns}", "configmaps"),
    core("{ns}", "serviceaccounts"),
    apis("rbac.authorization.k8s.io/v1", "{ns}", "roles"),
    apis("rbac.authorization.k8s.io/v1", "{ns}", "rolebindings"),
]


def snapshot(cluster: LocalCluster, namespace: str) -> dict[str, str]:
    api = cluster.api()
    versions: dict[str, str] = {}
    for template in LISTS:
        for item in api.items(template.format(ns=namespace), MANAGED):
            versions[f"{template}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    for plural in ("sandboxpools", "rolloutfleets", "trainingruns"):
        for item in api.items(kubestar(namespace, plural)):
            versions[f"{plural}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return versions


def stable_snapshot(cluster: LocalCluster, namespace: str, timeout: float = 30.0) -> dict[str, str]:
    """A snapshot that did not change over 2.5 s (the operator has converged)."""
    deadline = time.monotonic() + timeout
    last = snapshot(cluster, namespace)
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = snapshot(cluster, namespace)
        if now == last:
            return now
        last = now
    raise AssertionError("the resources kept changing")


def event_count(cluster: LocalCluster, namespace: str) -> int:
    return len(cluster.api().items(core(namespace, "events")))


def test_restart_mid_run_changes_nothing(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    for kind, plural in (
        ("SandboxPool", "sandboxpools"),
        ("RolloutFleet", "rolloutfleets"),
        ("TrainingRun", "trainingruns"),
    ):
        api.create(kubestar(namespace, plural), example(kind))
    ready_dependencies(kubelet, namespace)
    wait_for(
        "the trainer Job", lambda: api.get(apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer"))
    )
    kubelet.make_ready(namespace, "app.kubernetes.io/instance=tiny-cpu")
    api.merge_patch(
        kubestar(namespace, "trainingruns", "tiny-cpu", "status"),
        {"status": {"phase": "Training", "step": 2, "totalSteps": 6}},
    )
    wait_for(
        "step 2/6",
        lambda: (
            (api.get(kubestar(namespace, "trainingruns", "tiny-cpu")) or {})["status"].get(
                "stepSummary"
            )
            == "2/6"
        ),
    )
    before = stable_snapshot(cluster, namespace)
    events_before = event_count(cluster, namespace)
    assert len(before) >= 17

    operator.restart()
    # Let the new process see everything and resync twice (every 2 s in the tests).
    wait_for(
        "a first pass over the resources",
        lambda: operator.metric("kubestar_operator_reconcile_seconds_count") >= 3,
    )
    time.sleep(4.5)
    assert snapshot(cluster, namespace) == before
    assert event_count(cluster, namespace) == events_before
    applies = operator.metrics()
    written = sum(
        v
        for k, v in applies.items()
        if k.startswith("kubestar_operator_child_applies_total")
        and ('"created"' in k or '"updated"' in k)
    )
    assert written == 0, applies
    assert operator.metric("kubestar_operator_status_patches_total") == 0
    # The run goes on where it was.
    wait_phase(cluster, namespace, "tiny-cpu", "Training")


def test_leader_election_and_takeover(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    api = cluster.api()
    second = OperatorProcess(
        operator.kubeconfig,
        _settings(operator),
        operator.log.with_name("second.log"),
        lease_namespace=operator.lease_namespace,
        lease_name=operator.lease_name,
    ).start()
    try:
        assert operator.metric("kubestar_operator_leader") == 1
        assert second.metric("kubestar_operator_leader") == 0
        api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool", "first"))
        wait_for(
            "children of the first pool",
            lambda: api.get(apis("apps/v1", namespace, "deployments", "first-sandbox")),
        )
        assert second.metric("kubestar_operator_reconcile_seconds_count") == 0

        operator.stop(signal.SIGKILL)  # dies without giving the lease back
        started = time.monotonic()
        wait_for(
            "the second replica to lead",
            lambda: second.metric("kubestar_operator_leader") == 1,
            timeout=30,
        )
        took = time.monotonic() - started
        assert took < 25, took
        api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool", "second"))
        wait_for(
            "children of the second pool",
            lambda: api.get(apis("apps/v1", namespace, "deployments", "second-sandbox")),
        )
    finally:
        second.stop()
        operator.start()


def _settings(operator: OperatorProcess) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load(operator.settings_file.read_text())
    return loaded
