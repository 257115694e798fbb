"""trainer.precision does what it says at every world size: bf16 computes the forward and
backward passes in bf16 while the master weights and the optimizer state stay fp32; fp32
computes in fp32; auto is fp32 on CPU. World size 1 (autocast) and 2 (FSDP2's
mixed-precision policy, two processes over gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kubestar.api.v1alpha1 import TrainerSpec
from kubestar.training.distributed import World, compute_dtype
from pydantic import ValidationError

from tests.real_parts import require_modules, tiny_model
from tests.training.distributed_update import new_policy, precision_step, run_ranks

BF16, FP32 = "torch.bfloat16", "torch.float32"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    require_modules("transformers")
    return tiny_model(64)


@pytest.mark.parametrize(
    ("precision", "computed"), [("bf16", BF16), ("fp32", FP32), ("auto", FP32)]
)
def test_one_process_computes_in_the_precision_asked(
    model_dir: Path, precision: str, computed: str
) -> None:
    policy, _ = new_policy(model_dir, World(), precision=precision)
    report = precision_step(policy)
    assert report == {"computed": [computed], "master": [FP32], "optimizer": [FP32], "moved": True}


@pytest.mark.slow
def test_two_processes_compute_in_bf16_with_fp32_master_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    run_ranks(2, str(model_dir), str(tmp_path), "--precision", "bf16")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"precision-rank-{rank}.json").read_text())
        assert report == {"computed": [BF16], "master": [FP32], "optimizer": [FP32], "moved": True}


def test_auto_is_bf16_on_gpus_and_fp32_on_cpu() -> None:
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16


def test_an_unknown_precision_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="precision"):
        TrainerSpec.model_validate({"precision": "fp16"})
    with pytest.raises(ValueError, match=r"trainer\.precision"):
        compute_dtype("fp8", torch.device("cpu"))
