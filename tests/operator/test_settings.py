"""Operator settings, kubeconfig parsing and lease expiry (pure)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubestar.operator import kube
from kubestar.operator.leader import MICRO, expired
from kubestar.operator.settings import OperatorSettings
from pydantic import ValidationError


def test_settings_from_the_chart_shape(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "defaultAccelerator": "amd",
                "images": {"kubestar": "registry.local/kubestar:1", "pullPolicy": "Never"},
                "network": {
                    "hostNetwork": True,
                    "apiServerHost": "127.0.0.1",
                    "apiServerPort": 6443,
                },
                "namespaces": ["team-a"],
            }
        )
    )
    settings = OperatorSettings.load(path)
    assert settings.default_accelerator == "amd"
    assert settings.images.kubestar == "registry.local/kubestar:1"
    assert settings.images.engine_rocm == OperatorSettings().images.engine_rocm
    assert settings.network.host_network and settings.network.api_server_port == 6443
    assert OperatorSettings.load(None) == OperatorSettings()
    with pytest.raises(ValidationError, match="imagez"):
        OperatorSettings.model_validate({"imagez": {}})


def test_kubeconfig_with_inline_data_and_token(tmp_path: Path) -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    path = tmp_path / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://127.0.0.1:6443",
                            "certificate-authority-data": ca,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "secret"}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}
                ],
                "current-context": "x",
            }
        )
    )
    connection = kube.from_kubeconfig(path)
    assert connection.server == "https://127.0.0.1:6443"
    assert connection.bearer() == "secret" and connection.namespace == "ns"
    assert Path(connection.ca_file).read_bytes().startswith(b"-----BEGIN")
    info = connection.to_kopf()
    assert info.token == "secret" and info.ca_path == connection.ca_file


def test_api_paths() -> None:
    assert kube.path("apps/v1", "Deployment", "ns", "d") == (
        "/apis/apps/v1/namespaces/ns/deployments/d"
    )
    assert kube.path("v1", "Pod", "ns") == "/api/v1/namespaces/ns/pods"
    assert kube.path("kubestar.dev/v1alpha1", "TrainingRun", "ns", "r", "status") == (
        "/apis/kubestar.dev/v1alpha1/namespaces/ns/trainingruns/r/status"
    )


def test_lease_expiry() -> None:
    now = datetime.now(UTC)
    fresh = {"renewTime": (now - timedelta(seconds=3)).strftime(MICRO), "leaseDurationSeconds": 15}
    stale = {"renewTime": (now - timedelta(seconds=30)).strftime(MICRO), "leaseDurationSeconds": 15}
    assert not expired(fresh, now)
    assert expired(stale, now)
    assert expired({}, now)


def test_every_default_image_names_a_version() -> None:
    """The chart's and the operator's default images agree and are pinned; the values schema
    refuses an image without a version or tagged latest."""
    chart = Path(__file__).resolve().parents[2] / "helm" / "kubestar"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    schema = json.loads((chart / "values.schema.json").read_text())
    defaults = OperatorSettings().images
    images = values["images"]
    assert (images["engineCpu"], images["engineRocm"], images["engineCuda"]) == (
        defaults.engine_cpu,
        defaults.engine_rocm,
        defaults.engine_cuda,
    )
    jsonschema.validate(values, schema)
    for image in ("vllm/vllm-openai:latest", "vllm/vllm-openai", "registry:5000/vllm"):
        unpinned = {**values, "images": {**images, "engineCuda": image}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(unpinned, schema)
    pinned = {**images, "engineCuda": "registry:5000/vllm@sha256:" + "0" * 64}
    jsonschema.validate({**values, "images": pinned}, schema)
