"""CustomResourceDefinitions generated from the pydantic types in kubestar.api.v1alpha1.

The types are the single source of truth; this module turns them into apiextensions.k8s.io/v1
structural OpenAPI v3 schemas that Kubernetes 1.20 accepts (no $ref, `nullable: true` instead
of unions with null, defaults on every field that has one, no CEL rules) and adds what a CRD
needs besides: printer columns, short names, categories and the status and scale subresources.
Every property carries its field's `description` (what `kubectl explain` prints); an object
without one gets its model's docstring, and so do the resources themselves.

    kubestar operator crds --out helm/kubestar/crds      # rewrite the chart's CRDs
    kubestar operator crds --check helm/kubestar/crds    # exit 1 if they are stale

Model validators that a structural schema can say are mirrored here (`EXTRA_RULES`): "exactly
one of generator, mix or path" becomes a `oneOf` of `required`, unique stage names become a list of
type map keyed by name. The operator validates every spec with the same pydantic types too, so
anything a 1.20 schema cannot express is still reported (as a condition) before it is used.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
import yaml
from kubestar.api import v1alpha1 as api
from kubestar.api.conditions import ConditionType
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

HEADER = (
    "# Generated from kubestar.api.v1alpha1 by `kubestar operator crds`: do not edit.\n"
    "# Change the types, then run `kubestar operator crds --out helm/kubestar/crds`.\n"
)

Schema = dict[str, Any]

# Schema fragments for model validators (see the module docstring), by model and field.
EXTRA_RULES: dict[tuple[type[BaseModel], str | None], Schema] = {
    (api.DatasetSpec, None): {
        "oneOf": [{"required": ["generator"]}, {"required": ["mix"]}, {"required": ["path"]}]
    },
    (api.TrainingRunSpec, "stages"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
}


# Fields whose default the operator applies from its settings (the Helm chart's values), so
# the CRD must leave them unset: a RolloutFleet without an accelerator gets the cluster's.
OPERATOR_DEFAULTS: set[tuple[type[BaseModel], str]] = {(api.RolloutFleetSpec, "accelerator")}


def _is_model(tp: Any) -> bool:
    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def _constraints(schema: Schema, metadata: list[Any]) -> None:
    is_array = schema.get("type") == "array"
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            schema["minimum"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            schema["minimum"] = item.gt
            schema["exclusiveMinimum"] = True
        elif isinstance(item, annotated_types.Le):
            schema["maximum"] = item.le
        elif isinstance(item, annotated_types.Lt):
            schema["maximum"] = item.lt
            schema["exclusiveMaximum"] = True
        elif isinstance(item, annotated_types.MinLen):
            schema["minItems" if is_array else "minLength"] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            schema["maxItems" if is_array else "maxLength"] = item.max_length


def type_schema(tp: Any, *, with_defaults: bool = True) -> Schema:
    """The structural schema of a Python type as the v1alpha1 types use them."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(tp) if arg is not type(None)]
        nullable = len(members) != len(get_args(tp))
        if set(members) == {str, int}:
            schema: Schema = {"x-kubernetes-int-or-string": True}
        elif len(members) == 1:
            schema = type_schema(members[0], with_defaults=with_defaults)
        else:
            raise TypeError(f"no structural schema for the union {tp}")
        if nullable:
            schema["nullable"] = True
        return schema
    if origin is Literal:
        values = list(get_args(tp))
        kinds = {type(value) for value in values}
        if kinds != {str}:
            raise TypeError(f"only string literals are supported, got {tp}")
        return {"type": "string", "enum": values}
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        values = [member.value for member in tp]
        if not all(isinstance(value, str) for value in values):
            raise TypeError(f"only enums of strings are supported, got {tp}")
        return {"type": "string", "enum": values}
    if origin is list:
        (item,) = get_args(tp)
        return {"type": "array", "items": type_schema(item, with_defaults=with_defaults)}
    if origin is dict:
        key, value = get_args(tp)
        if key is not str:
            raise TypeError(f"only string keys are supported, got {tp}")
        if value is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {
            "type": "object",
            "additionalProperties": type_schema(value, with_defaults=with_defaults),
        }
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if _is_model(tp):
        return model_schema(tp, with_defaults=with_defaults)
    raise TypeError(f"no structural schema for {tp!r}")


def _default(field: FieldInfo) -> tuple[bool, Any]:
    """(has a default, the default as JSON); nested models default to {} so that the API
    server fills their own fields' defaults in."""
    if field.default_factory is not None:
        factory = field.default_factory
        if _is_model(factory):
            return True, {}
        value = typing.cast(Callable[[], Any], factory)()
    elif field.default is PydanticUndefined or field.default is None:
        return False, None
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return True, {}
    if value == "":
        # Some 1.20 API servers (built with Go >= 1.18) take an empty-string default for
        # null and reject the CRD; an absent string means "" to every reader anyway.
        return False, None
    adapter: TypeAdapter[Any] = TypeAdapter(field.annotation)  # type: ignore[arg-type]
    return True, adapter.dump_python(value, mode="json", by_alias=True)


def _description(model: type[BaseModel]) -> str:
    """The model's docstring as a description: paragraphs kept, lines within one joined
    (`kubectl explain` wraps them itself)."""
    doc = model.__dict__.get("__doc__")
    if not doc:
        return ""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def model_schema(model: type[BaseModel], *, with_defaults: bool = True) -> Schema:
    properties: dict[str, Schema] = {}
    required: list[str] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        schema = type_schema(field.annotation, with_defaults=with_defaults)
        _constraints(schema, list(field.metadata))
        # The field says what it is for; its model's docstring only what the type is.
        description = field.description or schema.pop("description", "")
        schema.pop("description", None)
        if description:
            schema = {"description": description, **schema}
        if with_defaults and (model, name) not in OPERATOR_DEFAULTS:
            has_default, default = _default(field)
            if has_default:
                schema["default"] = default
        schema.update(EXTRA_RULES.get((model, name), {}))
        if field.is_required():
            required.append(key)
        properties[key] = schema
    result: Schema = {"type": "object"}
    description = _description(model)
    if description:
        result["description"] = description
    result["properties"] = properties
    if required:
        result["required"] = required
    result.update(EXTRA_RULES.get((model, None), {}))
    return result


# --- The three resources -----------------------------------------------------------------

CONDITION_READY = f'.status.conditions[?(@.type=="{ConditionType.READY}")].status'


class Kind(typing.NamedTuple):
    kind: str
    plural: str
    short_names: list[str]
    spec: type[BaseModel]
    status: type[BaseModel]
    spec_required: bool
    columns: list[Schema]
    scale: bool


def _age() -> Schema:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


KINDS: list[Kind] = [
    Kind(
        kind="SandboxPool",
        plural="sandboxpools",
        short_names=["sbp", "sandbox"],
        spec=api.SandboxPoolSpec,
        status=api.SandboxPoolStatus,
        spec_required=False,
        columns=[
            {"name": ConditionType.READY.value, "type": "string", "jsonPath": CONDITION_READY},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Capacity", "type": "integer", "jsonPath": ".status.capacity"},
            {"name": "Isolation", "type": "string", "jsonPath": ".status.isolation"},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
            _age(),
        ],
        scale=True,
    ),
    Kind(
        kind="RolloutFleet",
        plural="rolloutfleets",
        short_names=["rf", "fleet"],
        spec=api.RolloutFleetSpec,
        status=api.RolloutFleetStatus,
        spec_required=False,
        columns=[
            {"name": ConditionType.READY.value, "type": "string", "jsonPath": CONDITION_READY},
            {"name": "Accelerator", "type": "string", "jsonPath": ".status.accelerator"},
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "KV-Tokens", "type": "integer", "jsonPath": ".status.kvCapacityTokens"},
            {"name": "Scheduler", "type": "string", "jsonPath": ".status.schedulerEndpoint"},
            _age(),
        ],
        scale=True,
    ),
    Kind(
        kind="TrainingRun",
        plural="trainingruns",
        short_names=["tr", "trun"],
        spec=api.TrainingRunSpec,
        status=api.TrainingRunStatus,
        spec_required=True,
        columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Stage", "type": "string", "jsonPath": ".status.stage"},
            {"name": "Step", "type": "string", "jsonPath": ".status.stepSummary"},
            {"name": "Reward", "type": "number", "jsonPath": ".status.metrics.reward"},
            {"name": "Accuracy", "type": "number", "jsonPath": ".status.metrics.accuracy"},
            {
                "name": "Progress",
                "type": "integer",
                "description": "RL steps done, in percent",
                "jsonPath": ".status.progress.percentage",
            },
            {
                "name": "Time-Left",
                "type": "string",
                "description": "Estimated time until the last step is done",
                "jsonPath": ".status.progress.estimatedRemainingTimeSummary",
            },
            {
                "name": "Checkpoint",
                "type": "string",
                "priority": 1,
                "jsonPath": ".status.lastCheckpoint",
            },
            _age(),
        ],
        scale=False,
    ),
]


def render_crd(kind: Kind) -> Schema:
    """One CustomResourceDefinition as a dict."""
    spec = model_schema(kind.spec)
    if not kind.spec_required:
        spec["default"] = {}
    status = model_schema(kind.status, with_defaults=False)
    status["properties"]["conditions"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    resource = api.KINDS[kind.kind]
    fields = resource.model_fields
    root: Schema = {
        "type": "object",
        "description": _description(resource),
        "properties": {
            "apiVersion": {"description": fields["api_version"].description, "type": "string"},
            "kind": {"description": fields["kind"].description, "type": "string"},
            # The API server refuses anything but a type here (metadata is its own schema);
            # `kubectl explain` shows ObjectMeta's description.
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if kind.spec_required:
        root["required"] = ["spec"]
    subresources: Schema = {"status": {}}
    if kind.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.readyReplicas",
        }
        if "selector" in kind.status.model_fields:  # what a HorizontalPodAutoscaler needs
            subresources["scale"]["labelSelectorPath"] = ".status.selector"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kind.plural}.{api.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kubestar"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": kind.short_names,
                "categories": ["kubestar", "all"] if kind.kind != "TrainingRun" else ["kubestar"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": kind.columns,
                }
            ],
        },
    }


def crd_objects() -> list[Schema]:
    return [render_crd(kind) for kind in KINDS]


def render_crds() -> dict[str, str]:
    """File name -> YAML text, as they sit in helm/kubestar/crds/."""
    return {
        f"{api.GROUP}_{kind.plural}.yaml": HEADER
        + yaml.safe_dump(render_crd(kind), sort_keys=False, width=100)
        for kind in KINDS
    }


def write_crds(directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_crds().items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def stale_crds(directory: str | Path) -> list[str]:
    """Names of the files in `directory` that differ from the generated CRDs."""
    out = Path(directory)
    return [
        name
        for name, text in render_crds().items()
        if not (out / name).exists() or (out / name).read_text() != text
    ]
