"""Operator settings, kopf's login and lease expiry (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubestar.common import kube
from kubestar.operator.main import kopf_login
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


def test_kopf_logs_in_with_the_operator_clients_credentials(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("rotated\n")
    connection = kube.Connection(
        server="https://127.0.0.1:6443", token_file=str(token_file), ca_file="/ca.crt"
    )
    info = kopf_login(connection)
    assert info.server == "https://127.0.0.1:6443" and info.ca_path == "/ca.crt"
    assert info.scheme == "Bearer" and info.token == "rotated"
    assert info.default_namespace == "default" and info.insecure is None


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


def test_the_kubestar_tag_is_a_version_or_the_charts() -> None:
    """images.kubestar.tag: empty (the chart's appVersion) or a tag, never latest, as
    values.yaml says."""
    chart = Path(__file__).resolve().parents[2] / "helm" / "kubestar"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    schema = json.loads((chart / "values.schema.json").read_text())

    def with_tag(tag: str) -> dict[str, object]:
        images = values["images"]
        return {**values, "images": {**images, "kubestar": {**images["kubestar"], "tag": tag}}}

    for tag in ("", "0.1.0", "dev", "dev-upgrade", "v1.2_rc.3"):
        jsonschema.validate(with_tag(tag), schema)
    for tag in ("latest", "a b", ":0.1.0", "@sha256:" + "0" * 64):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(with_tag(tag), schema)


def test_policy_is_closed_by_default_and_opened_by_values() -> None:
    from kubestar.operator.settings import Policy

    closed = OperatorSettings()
    own = closed.images.kubestar
    assert closed.refusal("spec.image", image="") is None  # the installation's own
    assert closed.refusal("spec.image", image=own) is None
    refused = closed.refusal("spec.engine.image", image="any/image:1")
    assert refused is not None and refused.startswith("spec.engine.image 'any/image:1'")
    assert "policy.allowedImages: none" in refused
    refused = closed.refusal("spec.runtimeClassName", runtime_class="gvisor")
    assert refused is not None and refused.startswith("spec.runtimeClassName 'gvisor'")
    refused = closed.refusal("spec.isolation", isolation="Disabled")
    assert refused is not None and "policy.allowIsolationDisabled" in refused
    assert closed.refusal("spec.isolation", isolation="Required") is None
    gvisor_default = OperatorSettings.model_validate({"sandbox": {"runtimeClassName": "gvisor"}})
    assert gvisor_default.refusal("spec.runtimeClassName", runtime_class="gvisor") is None

    listed = OperatorSettings(
        policy=Policy(allowed_images=["myorg/"], allowed_runtime_classes=["gvisor"])
    )
    assert listed.refusal("spec.image", image="myorg/kubestar:2") is None
    refused = listed.refusal("spec.engine.image", image="myorgx/vllm:1")
    assert refused is not None and "policy.allowedImages: myorg/" in refused
    assert listed.refusal("spec.runtimeClassName", runtime_class="gvisor") is None
    refused = listed.refusal("spec.runtimeClassName", runtime_class="runc")
    assert refused is not None and "policy.allowedRuntimeClasses: gvisor" in refused

    opened = OperatorSettings.model_validate(
        {
            "policy": {
                "allowedImages": ["*"],
                "allowedRuntimeClasses": ["*"],
                "allowIsolationDisabled": True,
            }
        }
    )
    assert opened.refusal("spec.image", image="any/image:1") is None
    assert opened.refusal("spec.runtimeClassName", runtime_class="kata") is None
    assert opened.refusal("spec.isolation", isolation="Disabled") is None


def test_the_operator_watches_named_namespaces_or_every_one_when_told() -> None:
    assert OperatorSettings().scope_problem() is not None
    assert OperatorSettings(namespaces=["team"]).scope_problem() is None
    assert OperatorSettings(cluster_wide=True).scope_problem() is None
    with pytest.raises(ValidationError, match="namespaces or clusterWide"):
        OperatorSettings.model_validate({"namespaces": ["team"], "clusterWide": True})


def test_the_operator_command_refuses_to_run_with_nothing_to_watch() -> None:
    from click.testing import CliRunner
    from kubestar.cli.operator import run_command

    nothing = CliRunner().invoke(run_command, ["--kubeconfig", "/nonexistent"])
    assert nothing.exit_code == 2 and "no namespaces to watch" in nothing.output
    both = CliRunner().invoke(run_command, ["--namespace", "team", "--cluster-wide"])
    assert both.exit_code == 2 and "not both" in both.output
