"""The sharded trainer's memory and speed: SmolLM2-135M at world sizes 1, 2 and 4 on this
machine, the weight push's seconds per GB, and the memory arithmetic of Qwen3-14B on 8 GPUs.

Each world size runs in fresh processes (`kubestar.training.distributed.local_ranks`, gloo on
CPU, NCCL on GPUs), so that each rank's RSS high-water mark is its own. Per world:

  1. load the policy (every rank reads the fp32 model, then keeps its 1/N shard);
  2. `--warmup` then `--steps` SFT steps on `--rows` synthetic rows of `--tokens` tokens (the
     rows dealt to ranks as in training): training tokens/s over the whole world;
  3. the weight push: `Policy.save_weights` (bucketed, bf16) timed, in s/GB of bf16 written,
     with the most bytes rank 0 held at once; then the folder delivered to an engine process
     both ways, side by side: `volume` (the engine reads the files, as from a shared volume;
     here the page cache holds them, the volume's best case) and `broadcast` (rank 0's
     WeightServer sends them over a gloo group on the loopback, kubestar.engine.weight_sync),
     each timed in the engine from its request until every tensor is in its memory;
  4. a sharded checkpoint (torch.distributed.checkpoint, every rank its own file), timed.

Per rank: peak RSS after loading and after training (ru_maxrss), RSS after training (what
the rank holds between steps), and on GPUs torch.cuda.max_memory_allocated. The ranks run
with a fixed glibc mmap threshold (`--mmap-threshold`), so that freed tensors leave RSS.
Ratios are against world size 1 of the same run. On a CPU machine the ranks share its cores
(each rank gets cores / N threads), so tokens/s measures the overhead of sharding rather than
a speed-up.

    .venv/bin/python bench/trainer_bench.py            # 1, 2, 4 ranks; a few minutes on 2 cores
    .venv/bin/python bench/trainer_bench.py --quick    # fewer, shorter rows, one step
    .venv/bin/python bench/trainer_bench.py --arithmetic-only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
GB = 1e9
MB = 1e6

# Qwen3-14B (config.json of Qwen/Qwen3-14B).
QWEN3_14B = {
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


# -- memory arithmetic --------------------------------------------------------------------------
def decoder_parameters(config: dict[str, Any]) -> tuple[int, int, int]:
    """(all parameters, one decoder layer's, the largest tensor's) of a Llama/Qwen3-style
    decoder from its Hugging Face config (kubestar.training.memory.ModelShape)."""
    from kubestar.training.memory import ModelShape

    shape = ModelShape.from_config({"model_type": "", **config})
    return shape.parameters, shape.layer_parameters, shape.embedding_parameters


def arithmetic_rows(
    config: dict[str, Any], gpus: int, gpu_gb: float, bucket_bytes: int
) -> list[tuple[str, str, float, float]]:
    """(item, bytes per parameter, whole model GB, per GPU GB under FSDP2 over `gpus`)."""
    total, layer, largest = decoder_parameters(config)
    rows = [
        ("fp32 master weights", "4", 4 * total / GB, 4 * total / GB / gpus),
        ("fp32 gradients", "4", 4 * total / GB, 4 * total / GB / gpus),
        ("AdamW moments (exp_avg, exp_avg_sq)", "8", 8 * total / GB, 8 * total / GB / gpus),
    ]
    sharded = sum(row[3] for row in rows)
    rows.append(("sharded state (sum of the above)", "16", 16 * total / GB, sharded))
    # FSDP2 with bf16 compute: one decoder layer gathered in bf16, the next one prefetched.
    gathered = 2 * 2 * layer / GB
    rows.append(("bf16 compute copy (2 layers in flight)", "2", 2 * total / GB, gathered))
    rows.append(("per GPU before activations", "", 0.0, sharded + gathered))
    rows.append((f"share of one {gpu_gb:.0f} GB GPU", "", 0.0, (sharded + gathered) / gpu_gb))
    rows.append(
        (
            "weight push, rank 0 CPU: the largest bucket (bf16)",
            "",
            0.0,
            max(bucket_bytes, 2 * largest) / GB,
        )
    )
    rows.append(
        ("weight push, every GPU: largest tensor gathered (fp32)", "", 0.0, 4 * largest / GB)
    )
    rows.append(
        ("a full-state save on rank 0 (fp32 weights + moments)", "12", 12 * total / GB, 0.0)
    )
    return rows


def print_arithmetic(gpus: int, gpu_gb: float, bucket_bytes: int) -> None:
    total, layer, largest = decoder_parameters(QWEN3_14B)
    print(
        f"\nQwen3-14B on {gpus} x {gpu_gb:.0f} GB GPUs: {total / 1e9:.2f}B parameters, "
        f"{layer / 1e6:.0f}M per decoder layer, largest tensor {largest / 1e6:.0f}M "
        f"(embedding; the head is untied); weight-push bucket {bucket_bytes / 2**30:.2f} GiB"
    )
    print(f"| item | bytes/param | whole model GB | per GPU GB (FSDP2, {gpus}-way) |")
    print("|---|---|---|---|")
    for item, per_param, whole, per_gpu in arithmetic_rows(QWEN3_14B, gpus, gpu_gb, bucket_bytes):
        whole_text = f"{whole:.1f}" if whole else ""
        per_gpu_text = f"{per_gpu:.1%}" if item.startswith("share") else f"{per_gpu:.1f}"
        print(f"| {item} | {per_param} | {whole_text} | {per_gpu_text if per_gpu else ''} |")


# -- one world -----------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(args: argparse.Namespace, world: Any) -> dict[str, Any]:
    """One rank's share of the measurement; rank 0 returns every rank's report."""
    import torch
    from kubestar.engine.models import resolve_model
    from kubestar.training import checkpoint
    from kubestar.training.batch import make_batch
    from kubestar.training.checkpoint import RunState
    from kubestar.training.distributed import barrier, shard
    from kubestar.training.policy import OptimizerConfig, Policy

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    policy = Policy(
        resolve_model(args.model),
        OptimizerConfig(learning_rate=1e-5),
        micro_batch_size=args.micro_batch_size,
        world=world,
        precision=args.precision,
    )
    report: dict[str, Any] = {
        "rank": world.rank,
        "peak_rss_load": peak_rss_bytes(),
        "parameters": sum(p.numel() for p in policy.model.parameters()),  # DTensor: global
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(16)] for _ in range(args.rows)]
    answers = [[rng.randrange(1000, 40000) for _ in range(args.tokens - 16)] for _ in prompts]
    batch = make_batch(prompts, answers, [[1] * len(a) for a in answers])
    mine = batch.rows(shard(args.rows, world))
    seconds = []
    for step in range(args.warmup + args.steps):
        barrier(world)
        started = time.perf_counter()
        policy.sft_step(mine)
        barrier(world)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - started)
    report.update(
        step_seconds=sum(seconds) / len(seconds),
        tokens_per_step=batch.tokens,
        peak_rss_train=peak_rss_bytes(),
        rss_after_steps=rss_bytes(),
        cuda_max_allocated=torch.cuda.max_memory_allocated() if cuda else None,
    )
    scratch = Path(args.scratch)
    policy.save_weights(scratch / "weights", bucket_bytes=args.bucket_bytes)
    written = policy.last_weights
    assert written is not None
    if world.main:
        for path in ("volume", "broadcast"):
            report[f"deliver_{path}_seconds"] = deliver(scratch / "weights", path)
    report.update(
        push_seconds=written.seconds,
        push_bytes=written.total_bytes,
        push_files=len(written.files),
        push_max_bucket=max(written.bucket_bytes, default=0),
        push_largest_tensor=written.largest_tensor_bytes,
        peak_rss_push=peak_rss_bytes(),
    )
    barrier(world)
    started = time.perf_counter()
    saved = checkpoint.save(scratch / "checkpoints", policy, RunState(global_step=1), keep=1)
    report["checkpoint_seconds"] = time.perf_counter() - started
    own = saved / checkpoint.TRAINER / f"__{world.rank}_0.distcp"
    report["checkpoint_rank_bytes"] = own.stat().st_size if own.exists() else 0
    reports: list[Any] = [report]
    if world.sharded:
        import torch.distributed as dist

        reports = [None] * world.size
        dist.all_gather_object(reports, report)
    return {"world_size": world.size, "ranks": reports}


def deliver(folder: Path, path: str) -> float:
    """Seconds an engine process takes to hold every tensor of `folder` in its memory, by
    `path` (volume: it reads the files; broadcast: rank 0's WeightServer sends them)."""
    from kubestar.engine.weight_sync import WeightServer

    command = [sys.executable, str(Path(__file__).resolve()), "--receive", path]
    if path == "volume":
        return _engine_seconds([*command, str(folder)])
    with WeightServer("127.0.0.1") as server:
        server.publish(folder, 1)
        return _engine_seconds([*command, server.source])


def _engine_seconds(command: list[str]) -> float:
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    return float(done.stdout.split()[-1])


def receive_main(path: str, where: str) -> None:
    """An engine's end of `deliver`: prints the seconds from its request until it holds
    every tensor (the imports excluded)."""
    import torch
    from kubestar.engine.weight_sync import new_session, receive
    from safetensors.torch import load_file

    started = time.perf_counter()
    held = 0
    if path == "volume":
        for file in sorted(Path(where).glob("*.safetensors")):
            held += sum(t.clone().numel() for t in load_file(str(file)).values())
    else:
        _, tensors = receive(where, new_session(), 0, 1, 1, 0, 1, torch.device("cpu"))
        held = sum(t.clone().numel() for _, t in tensors)
    assert held > 0
    print(f"{time.perf_counter() - started:.4f}")


def rank_main(args: argparse.Namespace) -> None:
    """A rank: the first of its world starts the others with local_ranks and prints the
    world's result; ranks started by it (WORLD_SIZE set) only take part."""
    from kubestar.training.distributed import World, close_world, local_ranks

    if "WORLD_SIZE" in os.environ:
        measure(args, World.from_env())
        close_world()
        return
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    with local_ranks(args.world, command, Path(args.scratch) / "logs") as world:
        result = measure(args, world)
    print("RESULT " + json.dumps(result), flush=True)


def run_world(args: argparse.Namespace, size: int) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix=f"trainer-bench-{size}-"))
    threads = max(1, (os.cpu_count() or 1) // size)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--rank",
        "--world",
        str(size),
        "--threads",
        str(threads),
        "--scratch",
        str(scratch),
        "--model",
        args.model,
        "--rows",
        str(args.rows),
        "--tokens",
        str(args.tokens),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--precision",
        args.precision,
        "--bucket-bytes",
        str(args.bucket_bytes),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if args.mmap_threshold:
        # glibc otherwise raises its mmap threshold as large blocks are freed, and keeps
        # freed layer buffers in its heap: RSS would count memory no tensor holds.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            logs = "".join(p.read_text()[-2000:] for p in (scratch / "logs").glob("*.log"))
            raise RuntimeError(f"world {size} failed:\n{done.stderr[-3000:]}\n{logs}")
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
        result["threads_per_rank"] = threads
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_worlds(results: list[dict[str, Any]]) -> None:
    base = results[0]
    base_rank = base["ranks"][0]

    def tokens_per_s(result: dict[str, Any]) -> float:
        rank = result["ranks"][0]
        return float(rank["tokens_per_step"] / rank["step_seconds"])

    def worst(result: dict[str, Any], key: str) -> float:
        return float(max(rank[key] for rank in result["ranks"]))

    print(
        "\n| world | threads/rank | tokens/s | vs 1 | step s | peak RSS/rank MB (load / train) "
        "| vs 1 (train) | RSS after steps MB | vs 1 | push s/GB | push files, max held MB "
        "| to an engine s/GB: volume / broadcast (broadcast vs volume) "
        "| push + delivery s/GB: volume / broadcast | checkpoint s, MB/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        rank0 = result["ranks"][0]
        per_gb = rank0["push_seconds"] / (rank0["push_bytes"] / GB)
        volume = rank0["deliver_volume_seconds"] / (rank0["push_bytes"] / GB)
        broadcast = rank0["deliver_broadcast_seconds"] / (rank0["push_bytes"] / GB)
        print(
            f"| {result['world_size']} | {result['threads_per_rank']} "
            f"| {tokens_per_s(result):.0f} | x{tokens_per_s(result) / tokens_per_s(base):.2f} "
            f"| {rank0['step_seconds']:.1f} "
            f"| {worst(result, 'peak_rss_load') / MB:.0f} "
            f"/ {worst(result, 'peak_rss_train') / MB:.0f} "
            f"| x{worst(result, 'peak_rss_train') / worst(base, 'peak_rss_train'):.2f} "
            f"| {worst(result, 'rss_after_steps') / MB:.0f} "
            f"| x{worst(result, 'rss_after_steps') / worst(base, 'rss_after_steps'):.2f} "
            f"| {per_gb:.2f} | {rank0['push_files']}, {rank0['push_max_bucket'] / MB:.0f} "
            f"| {volume:.2f} / {broadcast:.2f} (x{broadcast / volume:.2f}) "
            f"| {per_gb + volume:.2f} / {per_gb + broadcast:.2f} "
            f"| {rank0['checkpoint_seconds']:.1f}, "
            f"{worst(result, 'checkpoint_rank_bytes') / MB:.0f} |"
        )
    if base_rank.get("cuda_max_allocated") is not None:
        for result in results:
            allocated = [rank["cuda_max_allocated"] / MB for rank in result["ranks"]]
            print(f"world {result['world_size']}: cuda max allocated MB per rank {allocated}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--model", default=MODEL, help="a model name or folder (resolve_model)")
    parser.add_argument("--rows", type=int, default=8, help="rows per training step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per world")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="trainer.precision (auto: bf16 on GPUs, fp32 on CPU)",
    )
    parser.add_argument(
        "--bucket-bytes", type=int, default=1 << 30, help="the weight push's bucket (bf16 bytes)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=128 * 1024,
        help="MALLOC_MMAP_THRESHOLD_ of the ranks: blocks this large go back to the OS when "
        "freed, so RSS counts live memory (0: glibc's default, a threshold that grows)",
    )
    parser.add_argument("--quick", action="store_true", help="4 rows of 64 tokens, 1 step")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in the Qwen3-14B arithmetic")
    parser.add_argument("--gpu-gb", type=float, default=192.0, help="memory of one GPU, GB")
    parser.add_argument("--arithmetic-only", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    # A rank of one world (started by this script), or an engine of `deliver`.
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--receive", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive_main(*args.receive)
        return 0
    if args.rank:
        rank_main(args)
        return 0
    if args.quick:
        args.rows, args.tokens, args.steps, args.warmup = 4, 64, 1, 1
    print_arithmetic(args.gpus, args.gpu_gb, args.bucket_bytes)
    if args.arithmetic_only:
        return 0
    print(
        f"\n{args.model}: {args.rows} rows x {args.tokens} tokens a step, {args.warmup} warm-up "
        f"+ {args.steps} timed steps; {os.cpu_count()} CPUs; MALLOC_MMAP_THRESHOLD_ "
        f"{args.mmap_threshold or 'default'}; load average {load_average()}"
    )
    from kubestar.engine.models import resolve_model

    config = json.loads((resolve_model(args.model) / "config.json").read_text())
    results = []
    for size in [int(x) for x in args.worlds.split(",")]:
        results.append(run_world(args, size))
        print(f"  world {size} done (load average {load_average()})", flush=True)
    print_worlds(results)
    counted, arithmetic = results[0]["ranks"][0]["parameters"], decoder_parameters(config)[0]
    print(f"\n{args.model}: {counted:,} parameters counted, {arithmetic:,} by the arithmetic above")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "worlds": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
