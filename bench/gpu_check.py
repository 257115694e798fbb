"""The sharded trainer on one GPU, in minutes, with nothing fetched: a model of Qwen3's
architecture with random weights is made on the spot (Hugging Face folder, bf16 safetensors),
then bench/trainer_bench.py runs world size 1 on it (SFT steps on synthetic rows, the
bucketed weight push, a sharded checkpoint) and this prints what a GPU adds:

  * training tokens/s and model FLOPs utilisation, 6 x parameters x tokens/s (the usual
    dense-transformer estimate, attention's own FLOPs left out) against the card's dense bf16
    peak (`--peak-tflops`, default an H100/H200 SXM's 989);
  * peak GPU memory (torch.cuda.max_memory_allocated) against the arithmetic of the sharded
    state (fp32 weights, gradients and AdamW moments: 16 bytes a parameter) plus activations;
  * the weight push's GB/s (bf16 bytes written per second, gathered in buckets).

It trains in `--precision` (trainer.precision; `auto`, bf16 on a GPU), so MFU against the
bf16 peak is what a user of this build gets, not what the hardware can do.

    bench/gpu_check.sh                       # on a GPU machine: Qwen3-0.6B's shape
    bench/gpu_check.sh --size tiny --device-check-off   # the same path on a CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9

# Qwen3-0.6B's config.json (tied embeddings), and a tiny one of the same architecture.
SIZES: dict[str, dict[str, Any]] = {
    "0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def make_model(folder: Path, shape: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3 model with random weights, saved as the trainer loads a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    saved: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.6b")
    parser.add_argument("--rows", type=int, default=8, help="rows per training step")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    parser.add_argument(
        "--device-check-off", action="store_true", help="run on a machine without a GPU"
    )
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.device_check_off:
        print("no CUDA device here (--device-check-off runs the same path on the CPU)")
        return 2
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"device: {device}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = Path(scratch) / f"qwen3-{args.size}-random"
        started = time.monotonic()
        make_model(folder, SIZES[args.size])
        print(f"model made in {time.monotonic() - started:.1f} s: {folder.name}")
        figures = Path(scratch) / "trainer.json"
        command = [
            sys.executable,
            str(ROOT / "bench" / "trainer_bench.py"),
            "--worlds", "1", "--model", str(folder), "--rows", str(args.rows),
            "--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", "1",
            "--micro-batch-size", str(args.micro_batch_size), "--precision", args.precision,
            "--json", str(figures),
        ]  # fmt: skip
        subprocess.run(command, check=True)
        rank = json.loads(figures.read_text())["worlds"][0]["ranks"][0]

    parameters = int(rank["parameters"])
    tokens_per_s = rank["tokens_per_step"] / rank["step_seconds"]
    mfu = 6 * parameters * tokens_per_s / (args.peak_tflops * 1e12)
    state_bytes = 16 * parameters
    allocated = rank["cuda_max_allocated"]
    push_gbps = rank["push_bytes"] / GB / rank["push_seconds"]
    result = {
        "device": device,
        "size": args.size,
        "precision": args.precision,
        "parameters": parameters,
        "rows": args.rows,
        "tokens_per_row": args.tokens,
        "step_seconds": rank["step_seconds"],
        "tokens_per_s": tokens_per_s,
        "mfu_vs_bf16_peak": mfu,
        "state_gb_by_arithmetic": state_bytes / GB,
        "cuda_max_allocated_gb": allocated / GB if allocated is not None else None,
        "push_gb_per_s": push_gbps,
        "checkpoint_seconds": rank["checkpoint_seconds"],
    }
    print(
        f"\n| device | model | tokens/step | step s | tokens/s | MFU (6N, vs {args.peak_tflops:g} "
        "TFLOP/s bf16) | peak GPU memory GB | state by arithmetic GB (16 B/param) "
        "| push GB/s (bf16) | checkpoint s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    memory = f"{allocated / GB:.1f}" if allocated is not None else "-"
    print(
        f"| {device} | Qwen3 {args.size} random, {parameters / 1e6:.0f}M "
        f"| {rank['tokens_per_step']} | {rank['step_seconds']:.2f} | {tokens_per_s:,.0f} "
        f"| {mfu:.1%} | {memory} | {state_bytes / GB:.1f} | {push_gbps:.2f} "
        f"| {rank['checkpoint_seconds']:.1f} |"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
