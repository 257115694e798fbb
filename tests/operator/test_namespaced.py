"""A namespace-scoped install (operator.watchNamespaces): the chart grants the operator a Role
in each watched namespace and nothing in the others, and the operator reconciles only there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.local_cluster import (
    Api,
    ApiError,
    LocalCluster,
    OperatorProcess,
    apis,
    kubestar,
    wait_for,
)
from tests.operator.support import CHART
from tests.operator.test_reconcile import example

RELEASE = "scoped"
SYSTEM = "scoped-system"


@pytest.fixture(scope="module")
def watched(cluster: LocalCluster) -> Iterator[tuple[str, str]]:
    """A second release of the chart (its CRDs are the first's) that watches one namespace."""
    team, other = cluster.namespace("scoped-team"), cluster.namespace("scoped-other")
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM,
        "--create-namespace",
        "--skip-crds",
        "--set",
        "operator.replicas=0",
        "--set",
        f"operator.watchNamespaces={{{team}}}",
        "--wait",
        "--timeout",
        "60s",
    )
    try:
        yield team, other
    finally:
        cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM, check=False)


def test_a_namespaced_install_reconciles_only_its_namespaces(
    cluster: LocalCluster, watched: tuple[str, str]
) -> None:
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
        {"resyncSeconds": 2, "probeSchedulers": False, "namespaces": [team]},
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
    finally:
        operator.stop()
