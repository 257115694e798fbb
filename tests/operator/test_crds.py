"""The CRDs are generated from the pydantic types and committed in the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubestar.api import crds
from kubestar.api import v1alpha1 as api

CHART_CRDS = Path(__file__).resolve().parents[2] / "helm" / "kubestar" / "crds"


def walk(schema: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(schema, dict):
        out.append((path, schema))
        for key, value in schema.items():
            out += walk(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            out += walk(value, f"{path}[{i}]")
    return out


def test_committed_crds_equal_generated() -> None:
    assert crds.stale_crds(CHART_CRDS) == [], (
        "helm/kubestar/crds is stale: run `kubestar operator crds --out helm/kubestar/crds`"
    )
    assert sorted(p.name for p in CHART_CRDS.glob("*.yaml")) == sorted(crds.render_crds())


def test_schemas_are_structural_for_kubernetes_1_20() -> None:
    for crd in crds.crd_objects():
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema):
            assert "$ref" not in node, path
            assert "anyOf" not in node or node.get("x-kubernetes-int-or-string"), path
            assert "x-kubernetes-validations" not in node, path
            assert node.get("type") != "null", path
            if "properties" in path.rsplit("/", 1)[-1:]:
                continue
            # Every property node has a type (or is int-or-string / value-only oneOf branch).
            if path.endswith("]") and path.rsplit("/", 1)[-1].startswith("oneOf"):
                assert set(node) == {"required"}, path


def test_every_field_of_the_types_is_in_the_schema() -> None:
    crd = {c["spec"]["names"]["kind"]: c for c in crds.crd_objects()}
    run = crd["TrainingRun"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = run["properties"]["spec"]["properties"]
    assert set(spec) == {f.alias for f in api.TrainingRunSpec.model_fields.values()}
    status = run["properties"]["status"]["properties"]
    assert set(status) == {f.alias for f in api.TrainingRunStatus.model_fields.values()}
    assert run["required"] == ["spec"]


def test_defaults_validation_and_rules() -> None:
    crd = {c["spec"]["names"]["kind"]: c for c in crds.crd_objects()}
    pool = crd["SandboxPool"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = pool["properties"]["spec"]
    assert spec["default"] == {}
    assert spec["properties"]["replicas"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 1000,
        "default": 1,
    }
    assert spec["properties"]["limits"]["default"] == {}
    assert spec["properties"]["limits"]["properties"]["timeoutSeconds"]["exclusiveMinimum"]
    assert spec["properties"]["preload"]["default"] == ["numpy", "sympy"]
    assert spec["properties"]["runtimeClassName"] == {"type": "string", "nullable": True}
    quantity = spec["properties"]["resources"]["properties"]["limits"]["additionalProperties"]
    assert quantity == {"x-kubernetes-int-or-string": True}

    run = crd["TrainingRun"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stages = run["properties"]["spec"]["properties"]["stages"]
    assert stages["minItems"] == 1
    assert stages["x-kubernetes-list-type"] == "map"
    assert stages["x-kubernetes-list-map-keys"] == ["name"]
    dataset = stages["items"]["properties"]["dataset"]
    assert dataset["oneOf"] == [{"required": ["generator"]}, {"required": ["path"]}]
    algorithm = run["properties"]["spec"]["properties"]["algorithm"]["properties"]
    assert algorithm["name"]["enum"] == ["grpo-roc", "grpo"]
    assert algorithm["clipHigh"]["default"] == 0.28
    # Status fields carry no defaults (controllers write them).
    assert all("default" not in node for _, node in walk(run["properties"]["status"]))


def test_printer_columns_short_names_subresources() -> None:
    crd = {c["spec"]["names"]["kind"]: c for c in crds.crd_objects()}
    run = crd["TrainingRun"]
    columns = [c["name"] for c in run["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:5] == ["Phase", "Stage", "Step", "Reward", "Accuracy"]
    assert columns[-1] == "Age"
    assert run["spec"]["names"]["shortNames"] == ["tr", "trun"]
    assert run["spec"]["versions"][0]["subresources"] == {"status": {}}
    fleet = crd["RolloutFleet"]["spec"]["versions"][0]
    assert fleet["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_crd_files_are_valid_yaml_with_header() -> None:
    for name, text in crds.render_crds().items():
        assert text.startswith("# Generated"), name
        document = yaml.safe_load(text)
        assert document["kind"] == "CustomResourceDefinition"
