"""The CRDs and the chart against a real API server (Kubernetes 1.20): validation with the
field named, defaults, printer columns, short names, scale, `kubectl explain`; helm
lint/template/install."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from kubestar.api import v1alpha1 as api

from e2e.local_cluster import LocalCluster, kubestar, wait_for
from tests.operator.support import CHART, EXAMPLES

RUN = """
apiVersion: kubestar.dev/v1alpha1
kind: TrainingRun
metadata:
  name: {name}
spec:
  rolloutFleetRef: {{name: f}}
  sandboxPoolRef: {{name: p}}
  {extra}
  stages:
    - name: s1
      maxResponseTokens: 64
      steps: 2
      dataset: {dataset}
{more_stages}
"""


def run_manifest(
    name: str,
    extra: str = "",
    dataset: str = "{generator: basic_arithmetic}",
    more_stages: str = "",
) -> str:
    return RUN.format(name=name, extra=extra, dataset=dataset, more_stages=more_stages)


def rejected(cluster: LocalCluster, namespace: str, manifest: str) -> str:
    done = cluster.kubectl(
        "apply", "-n", namespace, "--validate=false", "-f", "-", input=manifest, check=False
    )
    assert done.returncode != 0, f"the API server accepted an invalid manifest:\n{manifest}"
    return done.stderr


def test_invalid_manifests_are_rejected_with_the_field_named(
    cluster: LocalCluster, namespace: str
) -> None:
    error = rejected(cluster, namespace, run_manifest("r1", "algorithm: {groupSize: 1}"))
    assert "spec.algorithm.groupSize" in error and "greater than or equal to 2" in error
    error = rejected(cluster, namespace, run_manifest("r2", "algorithm: {name: ppo}"))
    assert "spec.algorithm.name" in error and "grpo-roc" in error
    error = rejected(
        cluster,
        namespace,
        run_manifest("r3", dataset="{generator: basic_arithmetic, path: /data/x.jsonl}"),
    )
    assert "spec.stages.dataset" in error and "one and only one" in error
    duplicate = """    - name: s1
      maxResponseTokens: 64
      steps: 2
      dataset: {generator: basic_arithmetic}"""
    error = rejected(cluster, namespace, run_manifest("r4", more_stages=duplicate))
    assert "spec.stages[1]" in error and "Duplicate value" in error
    error = rejected(cluster, namespace, run_manifest("r5", "trainer: {workers: 0}"))
    assert "spec.trainer.workers" in error
    missing = "apiVersion: kubestar.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: r6}\n"
    assert "spec" in rejected(cluster, namespace, missing)
    pool = (
        "apiVersion: kubestar.dev/v1alpha1\nkind: SandboxPool\nmetadata: {name: p}\n"
        "spec: {limits: {timeoutSeconds: 0}}\n"
    )
    error = rejected(cluster, namespace, pool)
    assert "spec.limits.timeoutSeconds" in error
    fleet = (
        "apiVersion: kubestar.dev/v1alpha1\nkind: RolloutFleet\nmetadata: {name: f}\n"
        "spec: {accelerator: tpu}\n"
    )
    assert "spec.accelerator" in rejected(cluster, namespace, fleet)


def test_defaults_fill_every_field(cluster: LocalCluster, namespace: str) -> None:
    pool = {
        "apiVersion": "kubestar.dev/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": "defaults"},
    }
    created = cluster.api().create(kubestar(namespace, "sandboxpools"), pool)
    spec = created["spec"]
    assert spec["replicas"] == 1 and spec["executorsPerPod"] == 4 and spec["port"] == 50051
    assert spec["limits"] == {"timeoutSeconds": 10, "memoryMib": 512, "outputBytes": 65536}
    assert spec["preload"] == ["numpy", "sympy"]
    run = yaml.safe_load(run_manifest("defaults"))
    created = cluster.api().create(kubestar(namespace, "trainingruns"), run)
    assert created["spec"]["algorithm"] == {
        "name": "grpo-roc",
        "groupSize": 16,
        # Unset: tisCap (off); oversampleFactor and positiveSelection (grpo-roc's own, so
        # that setting them under grpo can be refused).
        "clipLow": 0.2,
        "clipHigh": 0.28,
        "learningRate": 1e-06,
        "updatesPerStep": 1,
        "maxStaleness": 0,
        "maxTurns": 10,
        "temperature": 1,
        "topP": 1,
    }
    assert created["spec"]["stages"][0]["problemsPerStep"] == 32
    assert created["spec"]["checkpoint"]["everySteps"] == 1


def test_examples_are_accepted(cluster: LocalCluster, namespace: str) -> None:
    for example in ("tiny-cpu.yaml", "paper-amd.yaml", "qwen3-nvidia.yaml"):
        done = cluster.kubectl(
            "apply", "-n", namespace, "--dry-run=server", "-f", str(EXAMPLES / example)
        )
        assert "created (server dry run)" in done.stdout, done.stdout


def test_printer_columns_and_short_names(cluster: LocalCluster, namespace: str) -> None:
    cluster.api().create(
        kubestar(namespace, "trainingruns"), yaml.safe_load(run_manifest("columns"))
    )
    cluster.api().merge_patch(
        kubestar(namespace, "trainingruns", "columns", "status"),
        {
            "status": {
                "phase": "Succeeded",
                "stage": "s1",
                "step": 1,
                "totalSteps": 2,
                "stepSummary": "1/2",
                "metrics": {"reward": 0.75, "accuracy": 0.5},
                "progress": {"percentage": 50, "estimatedRemainingTimeSummary": "3m20s"},
            }
        },
    )
    out = cluster.kubectl("get", "-n", namespace, "tr").stdout
    header, row = out.splitlines()[:2]
    assert header.split() == [
        *("NAME", "PHASE", "STAGE", "STEP", "REWARD", "ACCURACY", "PROGRESS", "TIME-LEFT", "AGE")
    ]
    assert row.split()[:8] == ["columns", "Succeeded", "s1", "1/2", "0.75", "0.5", "50", "3m20s"]
    wide = cluster.kubectl("get", "-n", namespace, "trainingruns", "-o", "wide").stdout
    assert "CHECKPOINT" in wide
    for short in ("sbp", "rf", "fleet", "trun"):
        cluster.kubectl("get", "-n", namespace, short)
    cluster.kubectl("get", "-n", namespace, "kubestar")


def test_scale_subresource(cluster: LocalCluster, namespace: str) -> None:
    pool = {
        "apiVersion": "kubestar.dev/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": "scaled"},
    }
    cluster.api().create(kubestar(namespace, "sandboxpools"), pool)
    cluster.kubectl("scale", "-n", namespace, "sandboxpool/scaled", "--replicas=3")
    scaled = cluster.api().get(kubestar(namespace, "sandboxpools", "scaled"))
    assert scaled is not None and scaled["spec"]["replicas"] == 3


def test_kubectl_explain_shows_the_field_descriptions(cluster: LocalCluster) -> None:
    """The descriptions of the pydantic fields reach `kubectl explain` (through the API
    server's published OpenAPI, which follows a new CRD by a few seconds)."""
    algorithm = api.TrainingRunSpec.model_fields["algorithm"].description
    group_size = api.AlgorithmSpec.model_fields["group_size"].description
    assert algorithm and group_size

    def explained() -> str | None:
        done = cluster.kubectl("explain", "trainingrun.spec.algorithm", check=False)
        # kubectl wraps and indents the text: compare with whitespace collapsed.
        text = " ".join(done.stdout.split())
        return text if done.returncode == 0 and " ".join(algorithm.split()) in text else None

    text = wait_for("kubectl explain trainingrun.spec.algorithm", explained, timeout=60)
    assert " ".join(group_size.split()) in text
    pool = cluster.kubectl("explain", "sandboxpool.spec.limits.timeoutSeconds").stdout
    timeout = api.CallLimitsSpec.model_fields["timeout_seconds"].description
    assert timeout and " ".join(timeout.split()) in " ".join(pool.split())


def test_helm_lint_and_template(cluster: LocalCluster) -> None:
    lint = cluster.helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout
    for version in ("1.20.2", "1.33.0"):
        rendered = cluster.helm(
            "template",
            "k",
            str(CHART),
            "--kube-version",
            version,
            "--set",
            "accelerator.vendor=amd",
            "--set",
            "operator.replicas=2",
        ).stdout
        kinds = [d["kind"] for d in yaml.safe_load_all(rendered) if d]
        assert {
            "Deployment",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "ServiceAccount",
            "ConfigMap",
            "Service",
        } <= set(kinds)

    # Namespace-scoped by default: the operator's rules are a Role in the release's namespace.
    def operator_rules(*values: str) -> list[tuple[str, str]]:
        sets = [arg for value in values for arg in ("--set", value)]
        rendered = cluster.helm("template", "k", str(CHART), "-n", "sys", *sets).stdout
        return [
            (d["kind"], d["metadata"].get("namespace", ""))
            for d in yaml.safe_load_all(rendered)
            if d
            and d["kind"] in ("Role", "ClusterRole")
            and any("kubestar.dev" in rule.get("apiGroups", []) for rule in d["rules"])
        ]

    assert operator_rules() == [("Role", "sys")]
    assert operator_rules("operator.watchNamespaces={a,b}") == [("Role", "a"), ("Role", "b")]
    assert operator_rules("operator.clusterWide=true") == [("ClusterRole", "")]
    both = cluster.helm(
        "template",
        "k",
        str(CHART),
        "--set",
        "operator.clusterWide=true",
        "--set",
        "operator.watchNamespaces={a}",
        check=False,
    )
    assert both.returncode != 0 and "operator.clusterWide" in both.stderr
    old = cluster.helm("template", "k", str(CHART), "--kube-version", "1.19.0", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr
    bad = cluster.helm("template", "k", str(CHART), "--set", "accelerator.vendor=tpu", check=False)
    assert bad.returncode != 0 and "accelerator.vendor" in bad.stderr
    typo = cluster.helm("template", "k", str(CHART), "--set", "operator.replica=2", check=False)
    assert typo.returncode != 0 and "replica" in typo.stderr


def test_chart_installed(cluster: LocalCluster, chart: str) -> None:
    status = json.loads(cluster.helm("status", "kubestar", "-n", chart, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    assert "kubectl get trainingrun -w" in status["info"]["notes"]
    deployment = json.loads(
        cluster.kubectl("get", "-n", chart, "deployment", "kubestar-operator", "-o", "json").stdout
    )
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["kubestar", "operator", "run"]
    settings = json.loads(
        cluster.kubectl("get", "-n", chart, "configmap", "kubestar-settings", "-o", "json").stdout
    )["data"]["settings.yaml"]
    from kubestar.operator.settings import OperatorSettings

    parsed = OperatorSettings.model_validate(yaml.safe_load(settings))
    assert parsed.default_accelerator == "cpu"
    # RBAC is least privilege: the operator may not enumerate or delete secrets (it writes
    # and reads back only its own copies of the token, by name) nor delete its children.
    for verb, resource in (
        ("list", "secrets"),
        ("watch", "secrets"),
        ("delete", "secrets"),
        ("delete", "deployments"),
        ("create", "clusterroles"),
        ("patch", "trainingruns.kubestar.dev"),
    ):
        done = cluster.kubectl(
            "auth",
            "can-i",
            verb,
            resource,
            f"--as=system:serviceaccount:{chart}:kubestar",
            check=False,
        )
        assert done.stdout.strip() == "no", (verb, resource)
    done = cluster.kubectl(
        "auth",
        "can-i",
        "patch",
        "trainingruns.kubestar.dev",
        "--subresource=status",
        f"--as=system:serviceaccount:{chart}:kubestar",
        check=False,
    )
    assert done.stdout.strip() == "yes"


@pytest.mark.parametrize("crd", sorted(p.name for p in (CHART / "crds").glob("*.yaml")))
def test_crds_are_established(cluster: LocalCluster, crd: str) -> None:
    name = yaml.safe_load((CHART / "crds" / crd).read_text())["metadata"]["name"]
    done = subprocess.run(
        [
            str(cluster.bin / "kubectl"),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "get",
            "crd",
            name,
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Established')].status}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "True"
