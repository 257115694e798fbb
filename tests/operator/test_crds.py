"""The CRDs are generated from the pydantic types and committed in the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubestar.api import crds
from kubestar.api import v1alpha1 as api
from kubestar.api.conditions import ConditionStatus, Phase

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
        "description": api.SandboxPoolSpec.model_fields["replicas"].description,
        "type": "integer",
        "minimum": 0,
        "maximum": 1000,
        "default": 1,
    }
    assert spec["properties"]["limits"]["default"] == {}
    assert spec["properties"]["limits"]["properties"]["timeoutSeconds"]["exclusiveMinimum"]
    assert spec["properties"]["preload"]["default"] == ["numpy", "sympy"]
    runtime_class = spec["properties"]["runtimeClassName"]
    assert runtime_class["type"] == "string" and runtime_class["nullable"] is True
    assert "default" not in runtime_class
    quantity = spec["properties"]["resources"]["properties"]["limits"]["additionalProperties"]
    assert quantity == {"x-kubernetes-int-or-string": True}

    run = crd["TrainingRun"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stages = run["properties"]["spec"]["properties"]["stages"]
    assert stages["minItems"] == 1
    assert stages["x-kubernetes-list-type"] == "map"
    assert stages["x-kubernetes-list-map-keys"] == ["name"]
    dataset = stages["items"]["properties"]["dataset"]
    assert dataset["oneOf"] == [
        {"required": ["generator"]},
        {"required": ["mix"]},
        {"required": ["path"]},
    ]
    assert dataset["properties"]["mix"]["minItems"] == 1
    assert dataset["properties"]["mix"]["items"]["required"] == ["generator"]
    algorithm = run["properties"]["spec"]["properties"]["algorithm"]["properties"]
    assert algorithm["name"]["enum"] == ["grpo-roc", "grpo"]
    assert algorithm["clipHigh"]["default"] == 0.28
    trainer = run["properties"]["spec"]["properties"]["trainer"]["properties"]
    assert trainer["microBatchSize"]["default"] == 4
    # Unset: micro-batches of microBatchSize rows; set, a token budget that wins over it.
    tokens = trainer["maxTokensPerMicroBatch"]
    assert tokens["type"] == "integer" and tokens["minimum"] == 1 and tokens["nullable"]
    assert "default" not in tokens and "microBatchSize" in tokens["description"]
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


def schemas() -> list[tuple[str, dict[str, Any]]]:
    return [
        (c["spec"]["names"]["kind"], c["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for c in crds.crd_objects()
    ]


def undescribed(schema: dict[str, Any], path: str) -> list[str]:
    """Paths of the properties (and objects) below `schema` that have no description."""
    missing = []
    if schema.get("properties") and not schema.get("description", "").strip():
        missing.append(path or "<root>")
    for name, child in (schema.get("properties") or {}).items():
        if path == "" and name == "metadata":
            continue  # the API server allows nothing but a type there
        if not child.get("description", "").strip():
            missing.append(f"{path}.{name}")
        missing += [p for p in undescribed(child, f"{path}.{name}") if p != f"{path}.{name}"]
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            missing += undescribed(schema[key], f"{path}[{key}]")
    return missing


def test_every_property_has_a_description() -> None:
    """`kubectl explain` prints these: every field of the three resources, nested ones and
    the items of lists included, says what it does."""
    for kind, schema in schemas():
        assert undescribed(schema, "") == [], kind
    # Fields say what they are for; their models' docstrings only what the type is.
    run = dict(schemas())["TrainingRun"]
    algorithm = run["properties"]["spec"]["properties"]["algorithm"]
    assert algorithm["description"] == api.TrainingRunSpec.model_fields["algorithm"].description
    group_size = algorithm["properties"]["groupSize"]["description"]
    assert group_size == api.AlgorithmSpec.model_fields["group_size"].description
    stages = run["properties"]["spec"]["properties"]["stages"]
    assert stages["items"]["description"].startswith("One RL stage")
    assert run["description"].startswith("An agentic RL training run")


def test_the_checker_finds_a_missing_description() -> None:
    schema = {
        "type": "object",
        "description": "root",
        "properties": {
            "a": {"description": "a", "type": "object", "properties": {"b": {"type": "string"}}},
            "c": {
                "description": "c",
                "type": "array",
                "items": {"type": "object", "properties": {"d": {"type": "string"}}},
            },
        },
    }
    assert undescribed(schema, "") == [".a.b", ".c[items]", ".c[items].d"]


def test_status_enums_are_the_api_constants() -> None:
    for kind, schema in schemas():
        status = schema["properties"]["status"]["properties"]
        condition = status["conditions"]["items"]["properties"]
        assert condition["status"]["enum"] == [str(value) for value in ConditionStatus], kind
        if kind == "TrainingRun":
            assert status["phase"]["enum"] == [str(phase) for phase in Phase]
