"""A namespace-scoped install (operator.watchNamespaces): the chart grants the operator a Role
in each watched namespace and nothing in the others, and the operator reconciles only there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.local_cluster import (
    Api,
    ApiError,
    LocalCluster,
    OperatorProcess,
    apis,
    kubestar,
    temporary_directory,
    wait_for,
)
from tests.operator.support import CHART
from tests.operator.test_reconcile import condition, example
from tests.real_parts import missing

RELEASE = "scoped"
SYSTEM = "scoped-system"


@pytest.fixture(scope="module")
def scoped_cluster() -> Iterator[LocalCluster]:
    """A control plane of its own: the session's cluster-wide operator would reconcile every
    namespace there too."""
    reason = LocalCluster.ensure_binaries()
    if reason:
        missing(f"no local Kubernetes control plane: {reason}")
    with temporary_directory("kubestar-k8s-scoped-") as directory:
        local = LocalCluster(directory)
        try:
            local.start()
            yield local
        finally:
            local.stop()


@pytest.fixture(scope="module")
def watched(scoped_cluster: LocalCluster) -> tuple[str, str]:
    """The chart installed to watch one namespace (of two)."""
    team = scoped_cluster.namespace("scoped-team")
    other = scoped_cluster.namespace("scoped-other")
    scoped_cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM,
        "--create-namespace",
        "--set",
        "operator.replicas=0",
        "--set",
        f"operator.watchNamespaces={{{team}}}",
        "--wait",
        "--timeout",
        "60s",
    )
    return team, other


def test_a_namespaced_install_reconciles_only_its_namespaces(
    scoped_cluster: LocalCluster, watched: tuple[str, str]
) -> None:
    cluster = scoped_cluster
    team, other = watched
    token = cluster.service_account_token(SYSTEM, f"{RELEASE}-kubestar")
    as_operator = Api(cluster.server, token, cluster.ca_file)
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "probe"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "serviceName": "probe",
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "x:1"}]},
            },
        },
    }
    # RBAC itself: the operator's account may create children in the watched namespace only.
    as_operator.create(apis("apps/v1", team, "statefulsets"), statefulset)
    with pytest.raises(ApiError) as refused:
        as_operator.create(apis("apps/v1", other, "statefulsets"), statefulset)
    assert refused.value.status == 403

    kubeconfig = cluster.write_kubeconfig(cluster.directory / "scoped.kubeconfig", token, SYSTEM)
    operator = OperatorProcess(
        kubeconfig,
        {
            "resyncSeconds": 2,
            "probeSchedulers": False,
            "namespaces": [team],
            # The chart's default policy (closed) but for one runtime class.
            "policy": {"allowedRuntimeClasses": ["gvisor"]},
        },
        cluster.directory / "scoped-operator.log",
        lease_namespace=SYSTEM,
        lease_name=f"{RELEASE}-kubestar-operator",
    ).start()
    try:
        api = cluster.api()
        api.create(kubestar(other, "sandboxpools"), example("SandboxPool"))
        api.create(kubestar(team, "sandboxpools"), example("SandboxPool"))
        wait_for(
            "the watched namespace's pool reconciled",
            lambda: api.get(apis("apps/v1", team, "statefulsets", "tiny-sandbox-sandbox-worker")),
        )
        # The pool outside was never touched: no status, no children.
        untouched = api.get(kubestar(other, "sandboxpools", "tiny-sandbox")) or {}
        assert not untouched.get("status"), untouched.get("status")
        assert api.items(apis("apps/v1", other, "statefulsets")) == []
        assert "403" not in operator.log.read_text()

        # The admin's policy, closed by default: an image, a runtime class or a pool without
        # isolation it does not allow is refused, naming the field, and gets no pods; the
        # installation's own image (an empty field) and a listed runtime class are allowed.
        miner = example("SandboxPool", "miner")
        miner["spec"]["image"] = "someone/miner:1"
        kata = example("SandboxPool", "kata")
        kata["spec"]["runtimeClassName"] = "kata"
        open_pool = example("SandboxPool", "open")
        open_pool["spec"]["isolation"] = "Disabled"
        fleet = example("RolloutFleet", "fleet")
        fleet["spec"].setdefault("engine", {})["image"] = "someone/vllm:1"
        api.create(kubestar(team, "sandboxpools"), miner)
        api.create(kubestar(team, "sandboxpools"), kata)
        api.create(kubestar(team, "sandboxpools"), open_pool)
        api.create(kubestar(team, "rolloutfleets"), fleet)

        def ready(plural: str, name: str) -> dict[str, Any] | None:
            return condition(api.get(kubestar(team, plural, name)), "Ready")

        for plural, name, field in (
            ("sandboxpools", "miner", "spec.image 'someone/miner:1'"),
            ("sandboxpools", "kata", "spec.runtimeClassName 'kata'"),
            ("sandboxpools", "open", "spec.isolation Disabled"),
            ("rolloutfleets", "fleet", "spec.engine.image 'someone/vllm:1'"),
        ):
            verdict = wait_for(f"{name} refused", lambda: ready(plural, name))  # noqa: B023
            assert verdict["reason"] == "InvalidSpec", verdict
            assert verdict["message"].startswith(f"{field} is not allowed"), verdict["message"]
        assert api.get(apis("apps/v1", team, "statefulsets", "miner-sandbox-worker")) is None
        assert api.get(apis("apps/v1", team, "statefulsets", "open-sandbox-worker")) is None
        assert api.get(apis("apps/v1", team, "deployments", "fleet-engine")) is None
    finally:
        operator.stop()
