"""A process given GPUs that sees fewer fails at once, naming both: never a silent CPU run.

The operator tells each container how many GPUs it gave it, from the resources it put on the
container: ENV_GPUS (a count) and ENV_GPU_RESOURCE (amd.com/gpu, nvidia.com/gpu). A trainer
rank (kubestar.training.distributed.device_for, before it loads the model) and a GPU engine
(this module run as `python3 .../kubestar_accelerators.py -- COMMAND...` before vLLM) compare
them with what torch sees. When torch sees fewer devices, or is a build without GPU support
(or for the other vendor), the process states

    AcceleratorUnavailable: 8 amd.com/gpu requested; torch 2.9.0+cpu sees 0 devices (...)

as its termination message and exits with EXIT_UNAVAILABLE; the operator shows it in the
resource's conditions and events, and a trainer's Job fails without a retry (a retry would
meet the same node and image).

Standard library only at import (torch is imported when checked): vLLM images without
kubestar run a copy of this module from the fleet's engine-modules ConfigMap.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_GPUS = "KUBESTAR_GPUS"
ENV_GPU_RESOURCE = "KUBESTAR_GPU_RESOURCE"
REASON = "AcceleratorUnavailable"
# The trainer's final-failure code (kubestar.api.trainer_contract.EXIT_FINAL_FAILURE): a
# trainer's Job fails at once on it (podFailurePolicy).
EXIT_UNAVAILABLE = 28
# The kubelet's default termination message path.
TERMINATION_LOG = "/dev/termination-log"
# Variables that hide devices from a process: named in the message when set.
VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
VENDOR = {"amd.com/gpu": "ROCm", "nvidia.com/gpu": "CUDA"}


@dataclass(frozen=True)
class TorchView:
    """What this process's torch is and sees."""

    version: str = ""  # torch.__version__; "" when torch cannot be imported
    cuda: str | None = None  # torch.version.cuda: the CUDA it was built for
    hip: str | None = None  # torch.version.hip: the ROCm (HIP) it was built for
    devices: int = 0  # torch.cuda.device_count(): GPUs of either vendor
    error: str = ""  # why torch could not be imported

    @property
    def build(self) -> str:
        """The vendor this torch drives: ROCm, CUDA, or "" (a CPU-only build)."""
        return "ROCm" if self.hip else "CUDA" if self.cuda else ""


def torch_view() -> TorchView:
    """What the installed torch is and how many GPUs it sees."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - images always carry torch
        return TorchView(error=f"{type(error).__name__}: {error}")
    return TorchView(
        version=str(torch.__version__),
        cuda=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        devices=torch.cuda.device_count(),
    )


def requested(env: Mapping[str, str]) -> tuple[int, str]:
    """(GPUs, resource name) the operator gave this container; (0, "") when none."""
    text = env.get(ENV_GPUS, "").strip()
    count = int(text) if text.isdigit() else 0
    return count, env.get(ENV_GPU_RESOURCE, "") if count else ""


def problem(
    count: int, resource: str, seen: TorchView, env: Mapping[str, str], expected: str = ""
) -> str | None:
    """Why a process that needs `count` GPUs (given as `resource`; `expected` words it
    otherwise) cannot have them with the torch it has (`seen`), or None when it can."""
    if count <= 0:
        return None
    vendor = VENDOR.get(resource, "")
    wrong_build = bool(vendor and seen.build and seen.build != vendor)
    if seen.version and seen.devices >= count and not wrong_build:
        return None
    what = expected or f"{count} {resource or 'GPU'} requested"
    if not seen.version:
        return f"{what}; torch cannot be imported ({seen.error or 'not installed'})"
    noun = "device" if seen.devices == 1 else "devices"
    text = f"{what}; torch {seen.version} sees {seen.devices} {noun}"
    if not seen.build:
        hint = (
            "a CPU-only build of torch: run the accelerator's image (images/cuda or "
            "images/rocm), whose torch drives the GPUs"
        )
    elif wrong_build:
        hint = (
            f"torch built for {seen.build}, not {vendor}: run the image for {resource} "
            f"(images/{vendor.lower()})"
        )
    else:
        hidden = [f"{key}={env[key]}" for key in VISIBILITY if key in env]
        hint = (
            f"{', '.join(hidden)} hides devices"
            if hidden
            else "the device plugin gave the container fewer devices than its resources "
            "say, or the node's driver is missing; `kubectl describe node` lists its "
            f"allocatable {resource or 'GPUs'}"
        )
    return f"{text} ({hint})"


def check(env: Mapping[str, str] | None = None, view: TorchView | None = None) -> str | None:
    """`problem` for this container as the operator described it (ENV_GPUS)."""
    env = os.environ if env is None else env
    count, resource = requested(env)
    if not count:
        return None
    return problem(count, resource, view or torch_view(), env)


def state(message: str, termination_log: str) -> None:
    """`REASON: message` on stderr and, where it can be written, as the termination message."""
    line = f"{REASON}: {message}"
    print(f"kubestar: {line}", file=sys.stderr, flush=True)
    try:
        with open(termination_log, "w") as log:
            log.write(line + "\n")
    except OSError as error:
        print(f"kubestar: cannot write {termination_log}: {error.strerror}", file=sys.stderr)


def with_python_path(env: Mapping[str, str], folder: str) -> dict[str, str]:
    """`env` with `folder` appended to its PYTHONPATH (the image's entries stay first)."""
    current = env.get("PYTHONPATH", "")
    parts = [part for part in current.split(os.pathsep) if part]
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([*parts, folder] if folder not in parts else parts),
    }


USAGE = "usage: accelerators.py [--termination-log PATH] [--python-path DIR] -- COMMAND..."


def main(argv: Sequence[str] | None = None) -> int:
    """`python3 accelerators.py [--termination-log PATH] [--python-path DIR] -- COMMAND...`:
    check, then run COMMAND in this process (exec) with DIR appended to the image's
    PYTHONPATH, or state the problem and exit EXIT_UNAVAILABLE."""
    args = list(sys.argv[1:] if argv is None else argv)
    termination_log, python_path = TERMINATION_LOG, ""
    while args and args[0] in ("--termination-log", "--python-path") and len(args) > 1:
        if args[0] == "--termination-log":
            termination_log = args[1]
        else:
            python_path = args[1]
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    found = check()
    if found:
        state(found, termination_log)
        return EXIT_UNAVAILABLE
    env = with_python_path(os.environ, python_path) if python_path else dict(os.environ)
    os.execvpe(args[0], args, env)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
