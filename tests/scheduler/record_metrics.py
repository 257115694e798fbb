"""Record real vLLM /metrics texts into tests/scheduler/data/ (for the policy unit tests).

    .venv/bin/python -m tests.scheduler.record_metrics

One tiny-model engine with 16 KV blocks of 128 tokens: `vllm-cpu-idle.prom` right after
start, `vllm-cpu-busy.prom` while 16 turns of 100 prompt + 300 new tokens overload it (running,
waiting and preempting), `vllm-cpu-after.prom` once they finished.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from kubestar.engine.client import EngineClient
from kubestar.scheduler.core import parse_vllm_metrics

from tests.real_parts import vllm_missing
from tests.scheduler.engines import running_engines

DATA = Path(__file__).parent / "data"


async def record(url: str) -> None:
    client = EngineClient(url)
    (DATA / "vllm-cpu-idle.prom").write_text(await client.metrics_text())
    turns = [
        asyncio.create_task(client.complete(list(range(100 + i, 200 + i)), 300, temperature=1.0))
        for i in range(16)
    ]
    busiest = ""
    best = (-1, -1)
    while not all(t.done() for t in turns):
        text = await client.metrics_text()
        sample = parse_vllm_metrics(text)
        score = (min(sample.waiting, 1) + min(sample.preemptions, 1), sample.running)
        if score > best:
            best, busiest = score, text
        await asyncio.sleep(0.2)
    await asyncio.gather(*turns)
    (DATA / "vllm-cpu-busy.prom").write_text(busiest)
    (DATA / "vllm-cpu-after.prom").write_text(await client.metrics_text())
    await client.close()


def main() -> None:
    if vllm_missing():
        raise SystemExit(vllm_missing())
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as logs, running_engines(1, Path(logs)) as engines:
        asyncio.run(record(engines[0].url))
    for name in ("idle", "busy", "after"):
        print(name, parse_vllm_metrics((DATA / f"vllm-cpu-{name}.prom").read_text()))


if __name__ == "__main__":
    main()
