"""Fixtures of the operator tests that need a real API server: one local control plane for
all of them (e2e/local; stopped when the last operator test ends, not at the end of the
session), the Helm chart installed into it, and the operator running as a subprocess with
the chart's service account (so the chart's RBAC is what it gets)."""

from __future__ import annotations

import base64
import itertools
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.local_cluster import (
    FakeKubelet,
    LocalCluster,
    OperatorProcess,
    core,
    temporary_directory,
)
from tests.operator.support import CHART
from tests.real_parts import missing

SYSTEM = "kubestar-system"
RELEASE = "kubestar"
_counter = itertools.count()


@pytest.fixture(scope="package")
def cluster() -> Iterator[LocalCluster]:
    reason = LocalCluster.ensure_binaries()
    if reason:
        missing(f"no local Kubernetes control plane: {reason}")
    with temporary_directory("kubestar-k8s-") as directory:
        local = LocalCluster(directory)
        try:
            local.start()
        except subprocess.CalledProcessError:
            local.stop()
            logs = "\n".join(
                f"{p.name}: {p.read_text()[-1500:]}" for p in (directory / "logs").glob("*.log")
            )
            raise AssertionError(f"the local control plane did not start:\n{logs}") from None
        try:
            local.apply_crds()
            yield local
        finally:
            local.stop()


@pytest.fixture(scope="package")
def chart(cluster: LocalCluster) -> str:
    """The chart installed with Helm (CRDs, RBAC, settings, the operator Deployment scaled
    to 0: there is no node to run it; the tests run the operator as a process instead)."""
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM,
        "--create-namespace",
        "--set",
        "operator.replicas=0",
        "--set",
        "operator.clusterWide=true",
        "--wait",
        "--timeout",
        "60s",
    )
    return SYSTEM


@pytest.fixture(scope="package")
def auth_token(cluster: LocalCluster, chart: str) -> str:
    """The installation's token, from the Secret the chart made."""
    secret = cluster.api().get(core(chart, "secrets", f"{RELEASE}-auth"))
    assert secret is not None, "the chart made no auth Secret"
    return base64.b64decode(secret["data"]["token"]).decode()


@pytest.fixture(scope="package")
def operator(cluster: LocalCluster, chart: str, auth_token: str) -> Iterator[OperatorProcess]:
    token = cluster.service_account_token(chart, RELEASE)
    kubeconfig = cluster.write_kubeconfig(cluster.directory / "operator.kubeconfig", token, chart)
    # As the chart's operator pod has it: the chart's Secret, mounted.
    token_file = cluster.directory / "auth-token"
    token_file.write_text(auth_token)
    process = OperatorProcess(
        kubeconfig,
        {
            "resyncSeconds": 2,
            "probeSchedulers": False,
            "auth": {"tokenFile": str(token_file)},
            "clusterWide": True,
            # Every test makes a namespace of its own; some ask for a pool without isolation
            # or an image of their own (the closed policy has its test: test_namespaced).
            "policy": {"allowedImages": ["*"], "allowIsolationDisabled": True},
        },
        cluster.directory / "operator.log",
        lease_namespace=chart,
        lease_name=f"{RELEASE}-operator",
    ).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> str:
    label = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40]
    name = f"t{next(_counter)}-{label}".rstrip("-")
    return cluster.namespace(name)


@pytest.fixture
def kubelet(cluster: LocalCluster) -> FakeKubelet:
    return FakeKubelet(cluster.api())


@pytest.fixture
def operator_log(operator: OperatorProcess) -> Path:
    return operator.log
