"""The reference pages generated from the code: docs/reference/api.md, every field of the three
custom resources, and docs/reference/values.md, every value of the Helm chart.

The API page is rendered from the CRDs' schemas (`kubestar.api.crds`, made from the pydantic
types), so it says what `kubectl explain` and the API server say: path, type with its
validation, default and description. The values page is rendered from helm/kubestar/values.yaml
(defaults, and the comment block right above each key as its description) and
values.schema.json (types; a schema description stands in where a key has no comment), as
helm-docs does.

    .venv/bin/python -m kubestar.api.reference --write   # rewrite the pages (from the repository)
    .venv/bin/python -m kubestar.api.reference --check   # exit 1 if the committed pages are stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubestar.api import crds
from kubestar.api import v1alpha1 as api

Schema = dict[str, Any]

REGENERATE = ".venv/bin/python -m kubestar.api.reference --write"
API_PAGE = Path("docs/reference/api.md")
VALUES_PAGE = Path("docs/reference/values.md")
CHART = Path("helm/kubestar")
HTML_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")


# --- Markdown --------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for one table cell: one line, paragraphs kept apart, pipes escaped, and a `<`
    outside code spans that would open an HTML tag (a placeholder such as <name>) escaped."""
    paragraphs = [" ".join(part.split()) for part in text.strip().split("\n\n")]
    parts = [p for p in paragraphs if p]
    for i, paragraph in enumerate(parts):
        spans = paragraph.split("`")
        for j in range(0, len(spans), 2):  # even pieces lie outside code spans
            spans[j] = HTML_TAG_START.sub("&lt;", spans[j])
        parts[i] = "`".join(spans)
    return "<br><br>".join(parts).replace("|", "\\|")


def _code(value: Any) -> str:
    return f"`{json.dumps(value, separators=(', ', ': '))}`"


def _one_of(choices: list[Any]) -> str:
    return "one of " + ", ".join(f"`{choice}`" if choice != "" else '`""`' for choice in choices)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _bounds(node: Schema) -> list[str]:
    """The validation of a schema node in words, as the API server (or helm) applies it."""
    out = []
    if "minimum" in node:
        out.append(f"{'>' if node.get('exclusiveMinimum') is True else '>='} {node['minimum']}")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(
        node.get("exclusiveMinimum"), bool
    ):
        out.append(f"> {node['exclusiveMinimum']}")  # JSON Schema draft 6+ (the chart's)
    if "maximum" in node:
        out.append(f"{'<' if node.get('exclusiveMaximum') is True else '<='} {node['maximum']}")
    if node.get("minLength") == 1 or node.get("minItems") == 1:
        out.append("not empty")
    for key, words in (
        ("minLength", "at least {} characters"),
        ("maxLength", "at most {} characters"),
        ("minItems", "at least {} items"),
        ("maxItems", "at most {} items"),
    ):
        if key in node and not (key.startswith("min") and node[key] == 1):
            out.append(words.format(node[key]))
    return out


# --- The API reference -----------------------------------------------------------------------


def _api_type(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type")
    if "enum" in node:
        return _one_of(node["enum"])
    if kind == "array":
        text = f"list of {_api_type(node['items'])}"
        keys = node.get("x-kubernetes-list-map-keys")
        return f"{text}, keyed by " + ", ".join(f"`{key}`" for key in keys) if keys else text
    if kind == "object":
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return "object (any fields)"
        if isinstance(node.get("additionalProperties"), dict):
            return f"map of {_api_type(node['additionalProperties'])}"
        return "object"
    return str(kind)


@dataclass
class _Rendered:
    """Object schemas already tabled (by their fields), so that a type used in several places
    (pod overrides, env vars, datasets) is tabled once and pointed to after that."""

    first_path: dict[str, str]


def _field_rows(
    node: Schema, path: str, kind: str, seen: _Rendered
) -> Iterator[tuple[str, str, str, str]]:
    required = set(node.get("required", []))
    for key, child in node.get("properties", {}).items():
        child_path = f"{path}.{key}"
        described = _api_type(child)
        constraints = _bounds(child)
        if key in required:
            constraints.insert(0, "**required**")
        one_of = [rule["required"][0] for rule in child.get("oneOf", [])]
        if one_of:
            constraints.append("exactly one of " + ", ".join(f"`{k}`" for k in one_of))
        type_cell = ", ".join([described, *constraints])
        default = _code(child["default"]) if "default" in child else ""
        description = child.get("description", "")
        nested = child["items"] if child.get("type") == "array" else child
        fields = nested.get("properties")
        subtree = f"{child_path}[]" if nested is not child else child_path
        if fields and len(fields) > 1:
            fingerprint = json.dumps(fields, sort_keys=True)
            where = seen.first_path.get(fingerprint)
            if where is not None:
                description = f"{description}\n\nIts fields: as {where}."
                yield (f"`{child_path}`", _cell(type_cell), default, _cell(description))
                continue
            seen.first_path[fingerprint] = f"{kind}'s `{subtree}`"
        yield (f"`{child_path}`", _cell(type_cell), default, _cell(description))
        if fields:
            yield from _field_rows(nested, subtree, kind, seen)


def render_api_reference() -> str:
    lines = [
        f"<!-- Generated from kubestar.api.v1alpha1 by `{REGENERATE}`: do not edit. -->",
        "",
        f"# API reference: {api.GROUP}/{api.VERSION}",
        "",
        "Every field of kubestar's three custom resources, generated from the types their CRDs "
        "are made from (`kubestar.api.v1alpha1`), so it says what `kubectl explain` and the API "
        "server say. A default is what the API server fills in when a field is left out; a "
        "field without one stays unset. Status fields are written by the operator and the "
        "trainer. The chart's values: [values.md](values.md).",
        "",
    ]
    lines += [f"- [{kind.kind}](#{kind.kind.lower()})" for kind in crds.KINDS]
    seen = _Rendered(first_path={})
    for kind in crds.KINDS:
        crd = crds.render_crd(kind)
        version = crd["spec"]["versions"][0]
        root = version["schema"]["openAPIV3Schema"]
        names = crd["spec"]["names"]
        scale = version["subresources"].get("scale")
        subresources = "status" + (
            f", scale (`{scale['specReplicasPath'][1:]}`, `{scale['statusReplicasPath'][1:]}`)"
            if scale
            else ""
        )
        columns = ", ".join(
            column["name"] + (" (`-o wide`)" if column.get("priority") else "")
            for column in version["additionalPrinterColumns"]
        )
        lines += ["", f"## {kind.kind}", "", _cell(root["description"]), ""]
        lines += [
            f"- apiVersion: `{api.GROUP}/{api.VERSION}`, kind: `{kind.kind}`",
            "- names: "
            + ", ".join(f"`{n}`" for n in [kind.plural, *kind.short_names])
            + " (`kubectl get "
            + kind.short_names[-1]
            + "`)",
            "- categories: "
            + ", ".join(f"`{c}`" for c in names["categories"])
            + " (`kubectl get kubestar` lists all three kinds)",
            f"- subresources: {subresources}",
            f"- `kubectl get` columns: {columns}",
        ]
        for part in ("spec", "status"):
            node = root["properties"][part]
            lines += ["", f"### {kind.kind} {part}", ""]
            if node.get("description"):
                lines += [_cell(node["description"]), ""]
            lines += _table(
                ("field", "type", "default", "description"),
                list(_field_rows(node, part, kind.kind, seen)),
            )
    return "\n".join(lines) + "\n"


# --- The chart's values ----------------------------------------------------------------------


def _comments_above(lines: list[str], line: int) -> str:
    """The comment block right above a line (no blank line between), as text: lines that the
    chart indents as examples (`#   - ...`) become code spans."""
    block: list[str] = []
    row = line - 1
    while row >= 0 and lines[row].strip().startswith("#"):
        block.insert(0, lines[row].strip()[1:])
        row -= 1
    text = []
    for comment in block:
        stripped = comment.strip()
        if comment.startswith("   ") and stripped.startswith("- "):
            text.append(f"`{stripped}`")
        else:
            text.append(stripped)
    return " ".join(text)


def _resolve(node: Schema, schema: Schema) -> Schema:
    ref = node.get("$ref")
    if not ref:
        return node
    target: Schema = schema
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _values_type(node: Schema, value: Any) -> str:
    if "enum" in node:
        return _one_of(node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = node.get("items", {})
        return f"list of {items.get('type', 'object')}" if items else "list"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        inner = node["additionalProperties"].get("type")
        return f"map of {' or '.join(inner) if isinstance(inner, list) else inner or 'object'}"
    if kind:
        return str(kind)
    # No type in the schema: say what the default is.
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(value), "object"
    )


@dataclass
class _Value:
    path: str
    type: str
    default: str
    description: str


def _values_rows(
    key_node: yaml.MappingNode, lines: list[str], schema: Schema, node: Schema, path: str
) -> Iterator[_Value]:
    for key, value in key_node.value:
        child_path = f"{path}.{key.value}" if path else key.value
        child_schema = _resolve(node.get("properties", {}).get(key.value, {}), schema)
        description = _comments_above(lines, key.start_mark.line) or child_schema.get(
            "description", ""
        )
        # A map the schema gives fields to is a section; any other (labels, quantities) is one
        # value, as a user sets it.
        if isinstance(value, yaml.MappingNode) and value.value and "properties" in child_schema:
            if description:
                yield _Value(child_path, "object", "", description)
            yield from _values_rows(value, lines, schema, child_schema, child_path)
            continue
        default = yaml.safe_load(yaml.serialize(value))
        kind = _values_type(child_schema, default)
        yield _Value(
            child_path, ", ".join([kind, *_bounds(child_schema)]), _code(default), description
        )


def render_values_reference(chart: Path) -> str:
    text = (chart / "values.yaml").read_text()
    schema = json.loads((chart / "values.schema.json").read_text())
    lines = text.splitlines()
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        raise ValueError(f"{chart / 'values.yaml'} is not a mapping")
    out = [
        f"<!-- Generated from {CHART}/values.yaml and values.schema.json by `{REGENERATE}`: "
        "do not edit. -->",
        "",
        "# Chart values",
        "",
        f"Every value of the chart `{CHART}`, with its default and what it does (the comment "
        "above it in values.yaml). values.schema.json checks each one: a misspelt key or a "
        "value of the wrong type fails `helm install` and `helm upgrade` with the key's name. "
        "The custom resources' fields: [api.md](api.md).",
        "",
    ]
    out += [f"- [{key.value}](#{key.value.lower()})" for key, _ in root.value]
    for key, value in root.value:
        section_schema = _resolve(schema.get("properties", {}).get(key.value, {}), schema)
        intro = _comments_above(lines, key.start_mark.line) or section_schema.get("description", "")
        out += ["", f"## {key.value}", ""]
        if intro:
            out += [_cell(intro), ""]
        if isinstance(value, yaml.MappingNode) and value.value:
            rows = list(_values_rows(value, lines, schema, section_schema, key.value))
        else:
            default = yaml.safe_load(yaml.serialize(value))
            rows = [_Value(key.value, _values_type(section_schema, default), _code(default), "")]
        out += _table(
            ("key", "type", "default", "description"),
            [
                (f"`{row.path}`", _cell(row.type), row.default, _cell(row.description))
                for row in rows
            ],
        )
    return "\n".join(out) + "\n"


# --- The pages -------------------------------------------------------------------------------


def render_pages(root: Path) -> dict[Path, str]:
    """Page path (relative to the repository) -> its text."""
    return {
        API_PAGE: render_api_reference(),
        VALUES_PAGE: render_values_reference(root / CHART),
    }


def write_pages(root: Path) -> list[Path]:
    written = []
    for relative, text in render_pages(root).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(relative)
    return written


def stale_pages(root: Path) -> list[Path]:
    """The pages whose committed text differs from what the code makes now."""
    return [
        relative
        for relative, text in render_pages(root).items()
        if not (root / relative).exists() or (root / relative).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubestar.api.reference",
        description="Generate the API and chart-values reference pages.",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the pages")
    action.add_argument(
        "--check", action="store_true", help="exit 1 if the pages are stale (the default)"
    )
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="the repository (default: here)"
    )
    args = parser.parse_args(argv)
    if args.write:
        for relative in write_pages(args.root):
            print(f"wrote {relative}")
        return 0
    stale = stale_pages(args.root)
    if stale:
        names = ", ".join(str(path) for path in stale)
        print(f"stale: {names}; run `{REGENERATE}`", file=sys.stderr)
        return 1
    print("docs/reference is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
