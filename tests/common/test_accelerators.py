"""A process given GPUs that torch cannot drive says what it was given and what it saw, for
each way it can go wrong; given none, it is not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kubestar.api.trainer_contract import EXIT_FINAL_FAILURE
from kubestar.common import accelerators as a

CPU = a.TorchView(version="2.9.0+cpu")
CUDA = a.TorchView(version="2.9.0+cu128", cuda="12.8", devices=8)
ROCM = a.TorchView(version="2.9.0+rocm6.4", hip="6.4.43482", devices=8)


@pytest.mark.parametrize(
    ("count", "resource", "seen", "env", "expected"),
    [
        (
            8,
            "amd.com/gpu",
            CPU,
            {},
            "8 amd.com/gpu requested; torch 2.9.0+cpu sees 0 devices (a CPU-only build of "
            "torch: run the accelerator's image (images/cuda or images/rocm), whose torch "
            "drives the GPUs)",
        ),
        (
            1,
            "nvidia.com/gpu",
            CPU,
            {},
            "1 nvidia.com/gpu requested; torch 2.9.0+cpu sees 0 devices (a CPU-only build",
        ),
        (
            8,
            "amd.com/gpu",
            CUDA,
            {},
            "8 amd.com/gpu requested; torch 2.9.0+cu128 sees 8 devices (torch built for CUDA, "
            "not ROCm: run the image for amd.com/gpu (images/rocm))",
        ),
        (
            2,
            "nvidia.com/gpu",
            ROCM,
            {},
            "2 nvidia.com/gpu requested; torch 2.9.0+rocm6.4 sees 8 devices (torch built for "
            "ROCm, not CUDA: run the image for nvidia.com/gpu (images/cuda))",
        ),
        (
            8,
            "nvidia.com/gpu",
            a.TorchView(version="2.9.0+cu128", cuda="12.8", devices=1),
            {"CUDA_VISIBLE_DEVICES": "0"},
            "8 nvidia.com/gpu requested; torch 2.9.0+cu128 sees 1 device "
            "(CUDA_VISIBLE_DEVICES=0 hides devices)",
        ),
        (
            4,
            "amd.com/gpu",
            a.TorchView(version="2.9.0+rocm6.4", hip="6.4", devices=0),
            {},
            "4 amd.com/gpu requested; torch 2.9.0+rocm6.4 sees 0 devices (the device plugin "
            "gave the container fewer devices than its resources say, or the node's driver "
            "is missing; `kubectl describe node` lists its allocatable amd.com/gpu)",
        ),
        (
            1,
            "nvidia.com/gpu",
            a.TorchView(error="ModuleNotFoundError: No module named 'torch'"),
            {},
            "1 nvidia.com/gpu requested; torch cannot be imported (ModuleNotFoundError",
        ),
    ],
    ids=[
        "cpu-torch-amd",
        "cpu-torch-nvidia",
        "cuda-torch-amd",
        "rocm-torch-nvidia",
        "hidden-devices",
        "fewer-devices",
        "no-torch",
    ],
)
def test_each_way_a_pod_cannot_have_its_gpus_names_both_sides(
    count: int, resource: str, seen: a.TorchView, env: dict[str, str], expected: str
) -> None:
    problem = a.problem(count, resource, seen, env)
    assert problem is not None and problem.startswith(expected), problem


def test_a_pod_that_sees_its_gpus_or_was_given_none_passes() -> None:
    assert a.problem(8, "amd.com/gpu", ROCM, {}) is None
    assert a.problem(8, "nvidia.com/gpu", CUDA, {}) is None
    assert a.problem(2, "nvidia.com/gpu", CUDA, {}) is None  # more seen than given: fine
    assert a.problem(0, "", CPU, {}) is None
    assert a.check({}, CPU) is None  # the operator gave no GPUs: nothing to check
    assert a.check({a.ENV_GPUS: "8", a.ENV_GPU_RESOURCE: "amd.com/gpu"}, ROCM) is None
    assert a.requested({a.ENV_GPUS: "2", a.ENV_GPU_RESOURCE: "nvidia.com/gpu"}) == (
        2,
        "nvidia.com/gpu",
    )
    assert a.requested({a.ENV_GPUS: "x"}) == (0, "")


def test_the_engines_check_states_the_reason_or_runs_the_command(tmp_path: Path) -> None:
    """`python -m kubestar_accelerators -- vllm ...` as a GPU engine runs it, with this
    machine's CPU-only torch: given GPUs it writes the reason and exits with the trainer's
    final-failure code; given none it execs the command."""
    log = tmp_path / "termination-log"
    command = [sys.executable, "-m", "kubestar.common.accelerators", "--termination-log", str(log)]
    env = {"PATH": "/usr/bin:/bin", a.ENV_GPUS: "2", a.ENV_GPU_RESOURCE: "nvidia.com/gpu"}
    refused = subprocess.run(
        [*command, "--", "echo", "started"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == a.EXIT_UNAVAILABLE == EXIT_FINAL_FAILURE, refused.stderr
    assert "started" not in refused.stdout
    stated = log.read_text()
    assert stated.startswith("AcceleratorUnavailable: 2 nvidia.com/gpu requested; torch "), stated
    assert "sees 0 devices" in stated
    started = subprocess.run(
        [*command, "--", "echo", "started"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (started.returncode, started.stdout) == (0, "started\n"), started.stderr


def test_the_engine_modules_folder_is_appended_to_the_images_python_path(tmp_path: Path) -> None:
    assert a.with_python_path({"PYTHONPATH": "/image/lib"}, "/modules")["PYTHONPATH"] == (
        "/image/lib:/modules"
    )
    assert a.with_python_path({}, "/modules")["PYTHONPATH"] == "/modules"
    assert a.with_python_path({"PYTHONPATH": "/modules"}, "/modules")["PYTHONPATH"] == "/modules"
    script = a.__file__
    shown = subprocess.run(
        [sys.executable, script, "--python-path", "/modules", "--", "sh", "-c", "echo $PYTHONPATH"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "/image/lib"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (shown.returncode, shown.stdout) == (0, "/image/lib:/modules\n"), shown.stderr
