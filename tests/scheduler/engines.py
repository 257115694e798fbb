"""Real vLLM engines for the scheduler's integration tests (and for recording /metrics).

The python that runs vLLM and the test model come from tests/real_parts.py (a missing vLLM
skips the tests that need it, or fails them under CI).

The engines get a deliberately small KV cache so that capacity binds with a handful of
turns: `--num-gpu-blocks-override` (16 blocks of 128 tokens: 1,920 usable tokens). On CPU,
`EngineSettings.kv_cache_bytes` is overridden by VLLM_CPU_KVCACHE_SPACE (which
EngineSettings.environment() always sets), so it cannot make the cache small.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kubestar.common.net import free_port
from kubestar.engine.launch import EngineProcess, EngineSettings

from tests.real_parts import engine_python, tiny_model

REPO = Path(__file__).resolve().parents[2]
TEST_BLOCKS = 16
TEST_MAX_MODEL_LEN = 1024


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
