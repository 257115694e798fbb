"""A CPU engine's decode speed in the dtype kubestar picks against the model's own bf16, side
by side in one run (kubestar.engine.launch.cpu_dtype).

For each dtype, one engine (`EngineSettings`, as `kubestar engine serve` and the operator
start it) serves the model; after one warm-up request, `--rows` completions of exactly
`--tokens` tokens each are sent at once and timed. Prints tokens/s per dtype and the ratio
against bf16, with the CPU's bf16-related flags.

    .venv/bin/python bench/engine_dtype_bench.py                       # SmolLM2-135M, 8 x 96
    .venv/bin/python bench/engine_dtype_bench.py --rows 4 --tokens 32  # quick
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path

from kubestar.engine.launch import (
    BF16_CPU_FLAGS,
    SERVED_MODEL_NAME,
    EngineProcess,
    EngineSettings,
    cpu_dtype,
)
from kubestar.engine.models import resolve_model


def complete(url: str, prompt: str, tokens: int) -> int:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 1.0,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return int(json.load(response)["usage"]["completion_tokens"])


def tokens_per_second(model: Path, dtype: str, rows: int, tokens: int, port: int) -> float:
    settings = EngineSettings(
        model=str(model), port=port, max_model_len=1024, max_num_seqs=rows, dtype=dtype
    )
    engine = EngineProcess(settings).start(timeout=600)
    try:
        complete(engine.url, "Warm up.", 4)
        prompts = [f"Compute {i} * 17 + 3, step by step." for i in range(rows)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(rows) as pool:
            made = sum(pool.map(lambda p: complete(engine.url, p, tokens), prompts))
        return made / (time.perf_counter() - started)
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--port", type=int, default=8391)
    args = parser.parse_args()
    model = resolve_model(args.model)
    flags = set(Path("/proc/cpuinfo").read_text().split())
    picked = cpu_dtype()
    print(
        f"CPU bf16 flags: {sorted(flags & BF16_CPU_FLAGS) or 'none'}; avx512f: "
        f"{'avx512f' in flags}; kubestar picks --dtype {picked}"
    )
    results = {}
    for dtype in ("bfloat16", "float32"):
        results[dtype] = tokens_per_second(model, dtype, args.rows, args.tokens, args.port)
        print(f"{dtype:>9}: {results[dtype]:7.1f} tokens/s ({args.rows} x {args.tokens})")
    print(f"float32 / bfloat16: x{results['float32'] / results['bfloat16']:.2f}")


if __name__ == "__main__":
    main()
