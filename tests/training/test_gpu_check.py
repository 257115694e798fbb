"""bench/gpu_check.sh's dry run: the GPU check's whole path (a Qwen3-shaped model made on the
spot, bf16-ready Policy with activation checkpointing, chunked log-probabilities and
micro-batches by tokens, the memory arithmetic beside it) runs on the CPU with nothing but
PyTorch and transformers importable, as on a GPU machine without the rest of kubestar's
dependencies; the pass bars judge only the cards they are set for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_parts import REPO, require_modules

# What a bare GPU machine lacks: importing any of them fails the dry run.
ABSENT = ("pydantic", "ray", "vllm", "grpc", "kubernetes", "kopf")


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu_with_only_torch_and_transformers(tmp_path: Path) -> None:
    require_modules("torch", "transformers")
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT)
    )
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu", "--sizes", "tiny",
         "--rows", "3", "--tokens", "96", "--steps", "1", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    (result,) = figures["results"]
    assert result["parameters"] == result["parameters_by_arithmetic"] > 0
    # Rows of 24 to 96 tokens, every token computed.
    assert result["tokens_per_step"] == 24 + 60 + 96 and result["tokens_per_s"] > 0
    assert result["memory_by_arithmetic_gb"] > 0 and result["passed"] is None  # no bar on a CPU
    assert "| cpu | Qwen3 tiny random" in done.stdout


def test_bars_apply_to_the_cards_they_are_set_for() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.BARS == {"0.6b": 30_000.0, "1.7b": 12_000.0}
    assert gpu_check.peak_tflops("NVIDIA H200", None) == 989.0
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert gpu_check.peak_tflops("AMD Instinct MI300X", None) == 1307.0
    assert gpu_check.peak_tflops("NVIDIA H200", 500.0) == 500.0
