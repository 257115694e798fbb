"""The trainer on one GPU against its targets, in a few minutes, with nothing fetched.

For each size, a model of Qwen3's architecture with random weights is made on the spot (a
Hugging Face folder, bf16 safetensors) and trained as a TrainingRun would train it at world
size 1: trainer.precision bf16, activation checkpointing, log-probabilities a chunk at a
time, micro-batches by tokens (trainer.maxTokensPerMicroBatch). SFT steps on synthetic rows of
mixed lengths (GRPO's passes are the same forward and backward). It prints, per size:

  * training tokens/s, and model FLOPs utilisation: 6 x parameters x tokens/s (the usual
    dense-transformer estimate; attention's own FLOPs and the recomputation left out) over
    the card's dense bf16 peak;
  * peak GPU memory (torch.cuda.max_memory_allocated) beside kubestar.training.memory's
    figure for the same settings;
  * the pass bar: Qwen3-0.6B >= 30,000 tokens/s and Qwen3-1.7B >= 12,000 on an H100 or H200.

Sizes: 0.6b and 1.7b, and 4b on a card of 140 GB or more. The exit status is 1 when a bar
is missed. On a machine without a GPU, `--cpu` runs the same path (tiny size: seconds).

    bench/gpu_check.sh                          # a GPU machine: the sizes its card holds
    bench/gpu_check.sh --sizes 0.6b --steps 2
    bench/gpu_check.sh --cpu --sizes tiny --rows 3 --tokens 96 --steps 1   # a dry run
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9

# Qwen3 shapes (kubestar.training.memory.QWEN3) by size name, and a tiny one for dry runs.
SIZES = {"0.6b": "Qwen3-0.6B", "1.7b": "Qwen3-1.7B", "4b": "Qwen3-4B", "tiny": "tiny"}
# tokens/s a size must reach on an H100 or H200.
BARS = {"0.6b": 30_000.0, "1.7b": 12_000.0}
BAR_CARDS = ("H100", "H200")
# Dense bf16 peak, TFLOP/s, by a word of the device's name (SXM parts).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0, "MI300X": 1307.0}
BIG_CARD_BYTES = 140e9 * 0.93  # "140 GB" cards (H200: 141 GB, reported as ~131 GiB)


def shape_config(size: str) -> dict[str, Any]:
    from kubestar.training.memory import QWEN3

    if size == "tiny":
        return {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 151936, "tie_word_embeddings": True,
        }  # fmt: skip
    shape = QWEN3[SIZES[size]]
    return {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
    }


def make_model(folder: Path, config: dict[str, Any], device: str) -> None:
    """A Qwen3 model with random weights, saved as the trainer loads a model folder
    (initialised on `device`: a GPU makes a 4B model in seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**config, max_position_embeddings=32768), dtype=torch.bfloat16
        )
    model.save_pretrained(folder)


def rows(count: int, tokens: int, seed: int = 0) -> Any:
    """`count` rows of a 256-token prompt (fewer for short rows) and a response, their total
    lengths spread evenly from a quarter of `tokens` to `tokens`, as an RL step's are."""
    from kubestar.training.batch import make_batch

    rng = random.Random(seed)
    prompts, responses = [], []
    for index in range(count):
        length = tokens // 4 + (tokens - tokens // 4) * index // max(count - 1, 1)
        prompt = min(256, length // 4)
        prompts.append([rng.randrange(1000, 100000) for _ in range(prompt)])
        responses.append([rng.randrange(1000, 100000) for _ in range(length - prompt)])
    return make_batch(prompts, responses, [[1] * len(r) for r in responses])


def peak_tflops(device: str, given: float | None) -> float:
    if given:
        return given
    return next((peak for word, peak in PEAK_TFLOPS.items() if word in device), 989.0)


def check(size: str, args: argparse.Namespace, device: str, scratch: Path) -> dict[str, Any]:
    import torch
    from kubestar.training.distributed import ShardingConfig
    from kubestar.training.memory import ModelShape, trainer_memory
    from kubestar.training.policy import OptimizerConfig, Policy

    config = shape_config(size)
    shape = ModelShape.from_config({**config, "model_type": "qwen3"})
    folder = scratch / f"qwen3-{size}-random"
    started = time.monotonic()
    make_model(folder, config, "cpu" if args.cpu else "cuda")
    made = time.monotonic() - started
    policy = Policy(
        folder,
        OptimizerConfig(learning_rate=1e-6),
        device="cpu" if args.cpu else "cuda",
        precision=args.precision,
        sharding=ShardingConfig(activation_checkpointing=True),
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
    )
    batch = rows(args.rows, args.tokens)
    if not args.cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for step in range(1 + args.steps):  # the first step warms up (kernels, allocator)
        begun = time.perf_counter()
        policy.sft_step(batch)
        if not args.cpu:
            torch.cuda.synchronize()
        if step:
            seconds.append(time.perf_counter() - begun)
    step_seconds = sum(seconds) / len(seconds)
    tokens = int(batch.attention_mask.sum())  # every token of a row is computed
    tokens_per_s = tokens / step_seconds
    peak = peak_tflops(device, args.peak_tflops)
    parameters = sum(p.numel() for p in policy.model.parameters())
    predicted = trainer_memory(
        shape,
        ranks=1,
        micro_batch_tokens=max(args.max_tokens_per_micro_batch, args.tokens),
        activation_checkpointing=True,
        compute="bf16"
        if args.precision == "bf16" or (args.precision == "auto" and not args.cpu)
        else "fp32",
    )
    bar = BARS.get(size) if any(card in device for card in BAR_CARDS) else None
    del policy
    if not args.cpu:
        torch.cuda.empty_cache()
    return {
        "size": size,
        "parameters": parameters,
        "parameters_by_arithmetic": shape.parameters,
        "model_made_seconds": made,
        "rows": args.rows,
        "tokens_per_step": tokens,
        "step_seconds": step_seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": 6 * parameters * tokens_per_s / (peak * 1e12),
        "peak_tflops": peak,
        "peak_memory_gb": (
            torch.cuda.max_memory_allocated() / GB
            if not args.cpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        ),
        "peak_memory_kind": "cpu peak RSS of the process" if args.cpu else "cuda max allocated",
        "memory_by_arithmetic_gb": predicted.total / GB,
        "bar_tokens_per_s": bar,
        "passed": None if bar is None else tokens_per_s >= bar,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="", help="comma-separated (default: what the card holds)"
    )
    parser.add_argument("--rows", type=int, default=16, help="rows per step")
    parser.add_argument("--tokens", type=int, default=8192, help="the longest row's tokens")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        help="trainer.precision (default: bf16 on a GPU; auto, i.e. fp32, with --cpu: this "
        "CPU path checks the code, not speed, and CPUs without bf16 units crawl in bf16)",
    )
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak")
    parser.add_argument("--cpu", action="store_true", help="no GPU: the same path on the CPU")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device here (--cpu runs the same path on the CPU)")
        return 2
    args.precision = args.precision or ("auto" if args.cpu else "bf16")
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    memory = 0 if args.cpu else torch.cuda.get_device_properties(0).total_memory
    sizes = [s for s in args.sizes.split(",") if s] or (
        ["tiny"] if args.cpu else ["0.6b", "1.7b"] + (["4b"] if memory >= BIG_CARD_BYTES else [])
    )
    print(f"device: {device} ({memory / GB:.0f} GB); torch {torch.__version__}; sizes {sizes}")
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for size in sizes:
            results.append(check(size, args, device, Path(scratch)))
            print(f"  {size}: {results[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    print(
        "\n| device | model | tokens/step | step s | tokens/s | bar | MFU (6N) "
        "| peak memory GB | by arithmetic GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        bar = "-" if r["bar_tokens_per_s"] is None else (
            f"{r['bar_tokens_per_s']:,.0f}: {'pass' if r['passed'] else 'FAIL'}"
        )  # fmt: skip
        print(
            f"| {device} | Qwen3 {r['size']} random, {r['parameters'] / 1e6:,.0f}M "
            f"| {r['tokens_per_step']:,} | {r['step_seconds']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {bar} | {r['mfu']:.1%} of {r['peak_tflops']:g} TFLOP/s "
            f"| {r['peak_memory_gb']:.1f} | {r['memory_by_arithmetic_gb']:.1f} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"device": device, "results": results}, indent=2))
    return 1 if any(r["passed"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
