"""The trainer's log-probabilities at the paper's lengths: the full-logits path against the
chunked one (kubestar.training.logprobs), side by side in one run.

A Qwen3-shaped model with random weights and Qwen3's vocabulary (151,936), by default
Qwen3-0.6B's width (hidden 1024, 16 query and 8 key/value heads, MLP 3072, tied embeddings)
with 2 of its 28 layers, so that a CPU trains it at 8K tokens a row. For each row length and
path, in fresh processes (each high-water mark its own):

  * the log-probability part alone: hidden states [1, T, H] through the output projection to
    each next token's log-probability, forward and backward: peak RSS above what the
    process held before, and seconds;
  * one training step (`Policy.sft_step`, AdamW, world size 1) on one row of T tokens: peak
    RSS of the process, above the loaded policy, and tokens/s;

beside kubestar.training.memory's figures for the same settings. A full-logits measurement
the arithmetic says would not fit this machine's free memory is not run (its arithmetic is
printed instead). The processes run with a fixed glibc mmap threshold, so that freed tensors
leave RSS. Ratios are chunked against full at the same length.

    .venv/bin/python bench/trainer_logprob_bench.py                  # 2K, 4K, 8K
    .venv/bin/python bench/trainer_logprob_bench.py --tokens 1024 --layers 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
VOCAB = 151936


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


def shape_config(hidden: int, layers: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": hidden // 8,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def make_model(folder: Path, config: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    settings = {k: v for k, v in config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(**settings, max_position_embeddings=16384), dtype=torch.float32
    )
    model.save_pretrained(folder)


# -- one measurement, in its own process ---------------------------------------------------------
def measure_part(path: str, tokens: int, hidden: int) -> dict[str, float]:
    """The output projection and log-probabilities of `tokens` positions, forward and backward
    (fp32, as the trainer computes on a CPU)."""
    import torch
    from kubestar.training.logprobs import chunked_token_logprobs, token_logprobs

    torch.manual_seed(0)
    states = torch.randn(1, tokens, hidden, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, hidden)).requires_grad_()
    ids = torch.randint(0, VOCAB, (1, tokens))
    before = rss_bytes()
    started = time.perf_counter()
    if path == "full":
        logprobs = token_logprobs(states @ weight.T, ids)  # [1, T-1], from [1, T, V] logits
    else:
        logprobs = chunked_token_logprobs(states[:, :-1], weight, ids[:, 1:])
    logprobs.sum().backward()
    return {
        "seconds": time.perf_counter() - started,
        "peak_above": peak_rss_bytes() - before,
        "checksum": float(states.grad.abs().sum()),  # type: ignore[union-attr]
    }


def measure_step(path: str, tokens: int, folder: str) -> dict[str, float]:
    """One SFT step of the policy on one row of `tokens` tokens."""
    import random

    from kubestar.training.batch import make_batch
    from kubestar.training.policy import OptimizerConfig, Policy

    policy = Policy(
        folder, OptimizerConfig(learning_rate=1e-5), device="cpu", micro_batch_size=1,
        chunked_logprobs=path == "chunked",
    )  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(256)]
    response = [rng.randrange(1000, 100000) for _ in range(tokens - 256)]
    batch = make_batch([prompt], [response], [[1] * len(response)])
    loaded = rss_bytes()
    started = time.perf_counter()
    stats = policy.sft_step(batch)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "loaded": loaded,
        "peak": peak_rss_bytes(),
        "peak_above": peak_rss_bytes() - loaded,
        "loss": stats["loss"],
    }


def run_one(args: argparse.Namespace, what: str, path: str, tokens: int, folder: Path) -> Any:
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", what,
               "--path", path, "--tokens", str(tokens), "--hidden", str(args.hidden),
               "--folder", str(folder), "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} {path} {tokens}: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


# -- the run -------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096,8192", help="row lengths")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--what", default="part,step", help="what to measure: part, step")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--measure", choices=("part", "step"), help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=("full", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        import torch

        torch.set_num_threads(args.threads)
        tokens = int(args.tokens)
        result = (
            measure_part(args.path, tokens, args.hidden)
            if args.measure == "part"
            else measure_step(args.path, tokens, args.folder)
        )
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from kubestar.training.memory import GB, ModelShape, trainer_memory

    config = shape_config(args.hidden, args.layers)
    shape = ModelShape.from_config(config)
    lengths = [int(t) for t in args.tokens.split(",")]
    free = available_bytes()
    print(
        f"Qwen3-shaped, {shape.parameters / 1e6:.0f}M parameters (hidden {args.hidden}, "
        f"{args.layers} layers, vocabulary {VOCAB:,}), fp32 on the CPU, {os.cpu_count()} CPUs, "
        f"{free / GB:.1f} GB available, load average "
        + " ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="logprob-bench-") as scratch:
        folder = Path(scratch) / "model"
        make_model(folder, config)
        for tokens in lengths:
            for path in ("full", "chunked"):
                chunked = path == "chunked"
                arithmetic = trainer_memory(shape, ranks=1, micro_batch_tokens=tokens,
                                            activation_checkpointing=False, compute="fp32",
                                            chunked_logprobs=chunked)  # fmt: skip
                # What the step would peak at: the process's baseline (~0.5 GB) and the model.
                fits = arithmetic.total + 1e9 < 0.85 * available_bytes()
                row: dict[str, Any] = {
                    "tokens": tokens,
                    "path": path,
                    "fits": fits,
                    "arithmetic_step": arithmetic.total,
                    "arithmetic_logprobs": arithmetic.get("log-probabilities"),
                }
                for what in args.what.split(",") if fits else ():
                    row[what] = run_one(args, what, path, tokens, folder)
                rows.append(row)
                print(f"  {tokens} {path}: {'measured' if fits else 'does not fit'}", flush=True)
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
    return 0


def print_rows(rows: list[dict[str, Any]]) -> None:
    full = {row["tokens"]: row for row in rows if row["path"] == "full"}

    def ratio(row: dict[str, Any], part: str, key: str) -> str:
        base = full[row["tokens"]]
        if part not in base or part not in row:
            return ""
        return f" (x{row[part][key] / base[part][key]:.2f})"

    print(
        "\n| tokens/row | path | logprob part: peak above start MB (vs full) | s "
        "| step: peak RSS MB | above the loaded policy MB (vs full) | tokens/s (vs full) "
        "| by arithmetic: logprobs / step GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        arithmetic = f"{row['arithmetic_logprobs'] / 1e9:.1f} / {row['arithmetic_step'] / 1e9:.1f}"
        if not row["fits"]:
            skipped = "not run: does not fit | | | | "
            print(f"| {row['tokens']:,} | {row['path']} | {skipped}| {arithmetic} |")
            continue
        cells = ["", "", "", "", ""]
        if "part" in row:
            part = row["part"]
            cells[0] = f"{part['peak_above'] / MB:,.0f}{ratio(row, 'part', 'peak_above')}"
            cells[1] = f"{part['seconds']:.1f}"
        if "step" in row:
            step = row["step"]
            cells[2] = f"{step['peak'] / MB:,.0f}"
            cells[3] = f"{step['peak_above'] / MB:,.0f}{ratio(row, 'step', 'peak_above')}"
            cells[4] = f"{step['tokens_per_s']:.0f}{ratio(row, 'step', 'tokens_per_s')}"
        print(f"| {row['tokens']:,} | {row['path']} | {' | '.join(cells)} | {arithmetic} |")


if __name__ == "__main__":
    sys.exit(main())
