"""Real vLLM engines for the scheduler's integration tests (and for recording /metrics).

The python that runs vLLM is `KUBESTAR_ENGINE_PYTHON` (default: this one); the tests that
need an engine are skipped, saying why, when that python has no vLLM.

The engines get a deliberately small KV cache so that capacity binds with a handful of
turns: `--num-gpu-blocks-override` (16 blocks of 128 tokens: 1,920 usable tokens). On CPU,
`EngineSettings.kv_cache_bytes` is overridden by VLLM_CPU_KVCACHE_SPACE (which
EngineSettings.environment() always sets), so it cannot make the cache small.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from kubestar.engine.launch import EngineProcess, EngineSettings
from kubestar.engine.models import cache_dir

REPO = Path(__file__).resolve().parents[2]
# head_dim 64: vLLM's CPU attention has no kernel for the default tiny model's head_dim 16.
TINY_HIDDEN = 256
TEST_BLOCKS = 16
TEST_MAX_MODEL_LEN = 1024


def engine_python() -> str:
    return os.environ.get("KUBESTAR_ENGINE_PYTHON") or sys.executable


@functools.cache
def vllm_missing() -> str:
    """Why real engines cannot run here ("" when they can)."""
    python = engine_python()
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python}: {error}"
    if done.returncode != 0:
        return (
            f"{python} has no vLLM; set KUBESTAR_ENGINE_PYTHON to a python with vllm-cpu "
            "(e.g. /work/vllm-venv/bin/python)"
        )
    return ""


def skip_without_vllm() -> None:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)


def _prepare(function: str, folder: Path) -> Path:
    """A model folder, made with the engine's python (it has torch and transformers)."""
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    code = f"from kubestar.engine.models import {function}; print({function})"
    done = subprocess.run(
        [engine_python(), "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "services")},
        check=True,
    )
    return Path(done.stdout.strip().splitlines()[-1])


def tiny_model() -> Path:
    """A tiny random Llama with SmolLM2's tokenizer: fast, and its output is random text."""
    folder = cache_dir() / f"tiny-random-llama-h{TINY_HIDDEN}-l2-s0"
    return _prepare(f"prepare_tiny_model(hidden_size={TINY_HIDDEN})", folder)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def settings(
    model: Path, blocks: int = TEST_BLOCKS, max_num_seqs: int = 32, cpus: str = ""
) -> EngineSettings:
    return EngineSettings(
        model=str(model),
        port=free_port(),
        max_model_len=TEST_MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        python=engine_python(),
        extra_args=["--num-gpu-blocks-override", str(blocks)],
        cpus=cpus,
    )


def one_cpu_each(count: int) -> list[str]:
    """A CPU of its own for each of `count` engines ("" each when there are too few)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < count:
        return [""] * count
    return [str(cpu) for cpu in allowed[:count]]


@contextmanager
def running_engines(
    count: int,
    log_dir: Path,
    model: Path | None = None,
    blocks: int = TEST_BLOCKS,
    cpus: Sequence[str] = (),
) -> Iterator[Sequence[EngineProcess]]:
    """`count` engines started side by side; stopped (by process group) afterwards.
    `cpus[i]`: the CPUs engine i is confined to (EngineSettings.cpus; default: all)."""
    model = model or tiny_model()
    with ExitStack() as stack:
        engines = []
        for i in range(count):
            engine = EngineProcess(
                settings(model, blocks, cpus=cpus[i] if i < len(cpus) else ""),
                log_path=log_dir / f"engine-{i}.log",
            )
            stack.callback(engine.stop)
            engines.append(engine.start(wait=False))
        for engine in engines:
            try:
                engine.wait_ready(timeout=300)
            except (RuntimeError, TimeoutError) as error:
                log = engine.log_path.read_text(errors="replace")[-3000:] if engine.log_path else ""
                raise RuntimeError(f"{error}\n{log}") from None
        yield engines
