"""Real vLLM engines for the scheduler's integration tests (and for recording /metrics).

The python that runs vLLM and the test model come from tests/real_parts.py (a missing vLLM
skips the tests that need it, or fails them under CI).

The engines get a deliberately small KV cache so that capacity binds with a handful of
turns: `--num-gpu-blocks-override` (16 blocks of 128 tokens: 1,920 usable tokens). On CPU,
`EngineSettings.kv_cache_bytes` is overridden by VLLM_CPU_KVCACHE_SPACE (which
EngineSettings.environment() always sets), so it cannot make the cache small.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kubestar.common.net import free_port
from kubestar.engine import launch
from kubestar.engine.client import EngineClient
from kubestar.engine.launch import EngineProcess, EngineSettings
from kubestar.engine.weight_sync import ROUTE

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
    engines = [settings(model, blocks, cpus=cpus[i] if i < len(cpus) else "") for i in range(count)]
    with launch.running_engines(engines, log_dir) as started:
        yield started


async def scrape(url: str) -> str:
    """An engine's /metrics text."""
    client = EngineClient(url, timeout=30)
    try:
        return await client.metrics_text()
    finally:
        await client.close()


def as_found(engines: Sequence[EngineProcess]) -> Sequence[EngineProcess]:
    """Engines shared between modules, handed on as a fresh start would leave them: any that
    an earlier test killed is started again, and every engine loads its model's own weights
    again, which also empties its prefix cache (so that which engine holds a prefix is
    decided by this module's turns alone)."""
    for engine in engines:
        if engine.process is None or engine.process.poll() is not None:
            engine.stop()
            engine.start(timeout=300)
        body = json.dumps({"path": engine.settings.model}).encode()
        request = urllib.request.Request(
            f"{engine.url}{ROUTE}", body, {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200, f"{engine.url}: {ROUTE} {response.status}"
    return engines
