"""What the operator makes for every example, and what the chart renders, validate against the
OpenAPI schemas of Kubernetes 1.29 through the newest the kubernetes-validate package ships,
in strict mode (an unknown field is an error, not ignored); a broken object fails.

The local e2e cluster runs 1.20, so this is what keeps the objects right for the releases a
user's cluster runs. The chart's kubeVersion states the supported range (docs/gpu-clusters.md
lists the fields an older API server ignores)."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubestar.api.v1alpha1 import (
    RolloutFleet,
    SandboxPool,
    TrainingRun,
    load_manifests,
)
from kubestar.operator import build_fleet, build_sandbox, build_trainer
from kubestar.operator.settings import OperatorSettings

from tests.operator.support import EXAMPLES, ROOT, parent
from tests.operator.test_auth import helm_binary, render
from tests.real_parts import require_modules

# The dev extra installs it; without it the test fails under CI (tests/real_parts.py).
require_modules("kubernetes_validate")
import kubernetes_validate  # noqa: E402

OLDEST = (1, 29)
NEWEST = tuple(int(part) for part in kubernetes_validate.latest_version().split(".")[:2])
VERSIONS = [f"{OLDEST[0]}.{minor}" for minor in range(OLDEST[1], NEWEST[1] + 1)]
SETTINGS = OperatorSettings.model_validate(
    {
        "images": {"pullSecrets": [{"name": "regcred"}]},
        "amd": {"renderGroup": 992},
        "networkPolicies": {"operatorNamespace": "kubestar"},
    }
)
SETTINGS.auth.token = "t" * 64  # the auth Secrets and mounts too


def children(example: Path) -> list[dict[str, Any]]:
    """Everything the operator makes for the example's resources, as the reconciles call the
    builders (a 1.29 API server: the Job's podFailurePolicy included)."""
    objects: list[dict[str, Any]] = []
    resources = load_manifests(example)
    fleets = {r.metadata.name: r for r in resources if isinstance(r, RolloutFleet)}
    pools = {r.metadata.name: r for r in resources if isinstance(r, SandboxPool)}
    for pool in pools.values():
        objects += build_sandbox.children(
            parent("SandboxPool", pool.metadata.name), pool.spec, SETTINGS
        )
    for fleet in fleets.values():
        objects += build_fleet.children(
            parent("RolloutFleet", fleet.metadata.name), fleet.spec, SETTINGS
        )
    for run in (r for r in resources if isinstance(r, TrainingRun)):
        body = parent("TrainingRun", run.metadata.name)
        spec = run.spec
        fleet_spec = fleets[spec.rollout_fleet_ref.name].spec
        pool_spec = pools[spec.sandbox_pool_ref.name].spec
        objects += [
            build_trainer.config_map(body, spec),
            *build_trainer.rbac(body),
            *build_trainer.auth(body, SETTINGS),
            *build_trainer.telemetry(body, SETTINGS),
            build_trainer.rendezvous_service(body, SETTINGS),
            *build_trainer.network_policies(body, spec, SETTINGS),
            *build_trainer.jobs(body, spec, fleet_spec, pool_spec, SETTINGS, server_version=OLDEST),
        ]
        claim = build_trainer.checkpoint_claim(body, spec, SETTINGS)
        if claim is not None:
            objects.append(claim)
    return objects


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def invalid(obj: dict[str, Any], version: str) -> str | None:
    """Why `obj` does not validate against `version`'s schema, strictly; None when it does."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        return f"{obj['kind']} {obj['metadata']['name']}: {where}: {error.message}"
    return None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("example", [path.name for path in EXAMPLE_FILES])
def test_every_child_of_every_example_validates(example: str, version: str) -> None:
    objects = children(EXAMPLES / example)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "StatefulSet", "Job", "Service", "NetworkPolicy", "Secret"} <= kinds
    problems = [problem for obj in objects if (problem := invalid(obj, version))]
    assert problems == []


@functools.cache
def rendered_chart(tmp: str) -> list[dict[str, Any]]:
    return render(
        Path(tmp),
        "monitoring.podMonitors.enabled=true",
        "monitoring.serviceMonitor.enabled=true",
        "monitoring.dashboard.enabled=true",
        "operator.metrics.enabled=true",
        "images.pullSecrets[0].name=regcred",
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_the_charts_objects_validate(
    version: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    helm_binary(tmp_path_factory.mktemp("helm"))  # skips without helm
    documents = rendered_chart(str(tmp_path_factory.getbasetemp() / "chart"))
    crds = [yaml.safe_load(path.read_text()) for path in (ROOT / "helm/kubestar/crds").glob("*")]
    checked = []
    for obj in [*documents, *crds]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus operator's kinds: not Kubernetes' own schemas
        checked.append(obj["kind"])
        assert invalid(obj, version) is None
    assert {"Deployment", "ConfigMap", "CustomResourceDefinition"} <= set(checked)


def test_a_broken_object_fails() -> None:
    (job, *_) = [o for o in children(EXAMPLES / "tiny-cpu.yaml") if o["kind"] == "Job"]
    assert invalid(job, VERSIONS[0]) is None
    typo = copy.deepcopy(job)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    assert "imagePullPolicy2" in (invalid(typo, VERSIONS[0]) or "")
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["backoffLimit"] = "six"
    assert "backoffLimit" in (invalid(wrong_type, VERSIONS[-1]) or "")


def test_the_charts_kube_version_states_the_range(tmp_path: Path) -> None:
    """From the local e2e cluster's 1.20 to the newest release validated here: a newer
    kubernetes-validate fails this until the range (and docs/gpu-clusters.md) says so."""
    chart = yaml.safe_load((ROOT / "helm/kubestar/Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">=1.20.0-0 <1.{NEWEST[1] + 1}.0-0"
    assert VERSIONS[0] == "1.29" and len(VERSIONS) >= 7
    table = (ROOT / "docs/gpu-clusters.md").read_text()
    assert f"1.29 to {VERSIONS[-1]}" in table
    helm = helm_binary(tmp_path)  # skips without helm
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path), "HELM_CONFIG_HOME": str(tmp_path)}
    for version, installs in (("1.20.0", True), (f"{VERSIONS[-1]}.0", True), ("1.99.0", False)):
        done = subprocess.run(
            [helm, "template", "k", str(ROOT / "helm/kubestar"), "--kube-version", version],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert (done.returncode == 0) == installs, (version, done.stderr)
