"""GPU code as a non-root uid in no /etc/passwd: a user name for getpass, a writable HOME and
compile caches on the pod's emptyDir, the engine modules appended to the image's PYTHONPATH,
and for AMD the video and render groups that open ROCm's devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubestar.api.v1alpha1 import RolloutFleetSpec, TrainingRunSpec
from kubestar.operator import build_fleet, build_trainer
from kubestar.operator.settings import OperatorSettings

from tests.operator.support import parent
from tests.operator.test_auth import helm_binary
from tests.operator.test_builders import tiny_run
from tests.operator.test_network_flows import rendered_settings

RENDER_992 = OperatorSettings.model_validate({"amd": {"renderGroup": 992}})


def trainer_pod(gpu: str, settings: OperatorSettings) -> dict[str, Any]:
    body, spec, fleet, pool = tiny_run()
    data = spec.model_dump(by_alias=True)
    if gpu:
        data["trainer"]["processesPerWorker"] = 2
        data["trainer"]["resources"] = {"limits": {gpu: 2}}
    run = TrainingRunSpec.model_validate(data)
    job = build_trainer.job(body, run, fleet, pool, settings)
    return dict(job["spec"]["template"]["spec"])


def engine_pod(accelerator: str, settings: OperatorSettings) -> dict[str, Any]:
    spec = RolloutFleetSpec.model_validate({"accelerator": accelerator})
    deployment = build_fleet.engine_deployment(parent("RolloutFleet", "f"), spec, settings)
    return dict(deployment["spec"]["template"]["spec"])


PODS = {
    "trainer-amd": lambda s: trainer_pod("amd.com/gpu", s),
    "trainer-nvidia": lambda s: trainer_pod("nvidia.com/gpu", s),
    "trainer-cpu": lambda s: trainer_pod("", s),
    "engine-amd": lambda s: engine_pod("amd", s),
    "engine-nvidia": lambda s: engine_pod("nvidia", s),
    "engine-cpu": lambda s: engine_pod("cpu", s),
}


@pytest.mark.parametrize("name", sorted(PODS))
def test_a_non_root_uid_has_a_user_a_home_and_caches_it_can_write(name: str) -> None:
    pod = PODS[name](OperatorSettings())
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["USER"] == env["LOGNAME"] == "kubestar"
    writable = {
        m["mountPath"]
        for m in container["volumeMounts"]
        if not m.get("readOnly")
        and "emptyDir" in next(v for v in pod["volumes"] if v["name"] == m["name"])
    }
    for key in ("HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert any(
            env[key] == folder or env[key].startswith(folder.rstrip("/") + "/")
            for folder in writable
        ), (key, env[key], writable)


@pytest.mark.parametrize("name", sorted(PODS))
def test_amd_pods_join_the_video_and_render_groups(name: str) -> None:
    default, rendered = PODS[name](OperatorSettings()), PODS[name](RENDER_992)
    groups = default["securityContext"].get("supplementalGroups")
    if name.endswith("-amd"):
        assert groups == [44]
        assert rendered["securityContext"]["supplementalGroups"] == [44, 992]
    else:
        assert groups is None
        assert "supplementalGroups" not in rendered["securityContext"]


def test_gpu_engines_keep_the_images_python_path() -> None:
    (container,) = engine_pod("amd", OperatorSettings())["containers"]
    assert "PYTHONPATH" not in {e["name"] for e in container["env"]}
    check = container["command"][: container["command"].index("--")]
    assert check[check.index("--python-path") + 1] == build_fleet.ENGINE_MODULES_DIR


def test_the_chart_sets_the_render_group(tmp_path: Path) -> None:
    helm_binary(tmp_path)  # skips without helm
    settings = rendered_settings(tmp_path, {"accelerator": {"amd": {"renderGroup": 992}}})
    assert settings.amd.supplemental_groups == [44, 992]
    assert rendered_settings(tmp_path, {}).amd.supplemental_groups == [44]
