"""Helpers shared by the operator tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubestar.api.v1alpha1 import API_VERSION

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CHART = ROOT / "helm" / "kubestar"


def parent(kind: str, name: str, namespace: str = "team", generation: int = 1) -> dict[str, Any]:
    """A parent object as the API server returns it (enough for the builders)."""
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{kind}-{name}",
            "generation": generation,
        },
    }
