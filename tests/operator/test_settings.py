"""Operator settings, kubeconfig parsing and lease expiry (pure)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

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
    assert settings.images.engine_rocm == "rocm/vllm:latest"
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
