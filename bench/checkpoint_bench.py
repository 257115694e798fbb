"""What durable, verified checkpoints cost: SmolLM2-135M's checkpoint (fp32 weights and AdamW
moments, 1.7 GB, plus the engines' bf16 folder, 269 MB, linked) saved the way it was before
manifests (torch.distributed.checkpoint fsyncing its own files, state.json, the rename) and
the way `kubestar.training.checkpoint.save` saves it now (every file hashed with sha256 and
fsynced, the manifest, the folders fsynced), alternately in the same run, then the check a
restart makes before resuming (`newest_good`: every file hashed against the manifest) with
the files in the page cache and without (evicted with posix_fadvise, the files of this
checkpoint only), beside the load itself.

    .venv/bin/python bench/checkpoint_bench.py            # 3 rounds; about 2 minutes on 2 cores
    .venv/bin/python bench/checkpoint_bench.py --rounds 1 --model tiny-random-llama-h64-l2-s0
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MB = 1e6


def old_save(directory: Path, policy: Any, step: int, weights: Path) -> Path:
    """The save before manifests: shards (fsynced by torch.distributed.checkpoint), linked
    weights, state.json, the rename, then the older checkpoints pruned (keep 1); nothing
    else synced, nothing hashed."""
    from kubestar.training import checkpoint
    from kubestar.training.checkpoint import RunState

    final = directory / f"{checkpoint.PREFIX}{step:06d}"
    tmp = directory / f"{checkpoint.TMP_PREFIX}{final.name}-{os.getpid()}"
    checkpoint._begin(directory, tmp)
    checkpoint._link_folder(weights, tmp / checkpoint.WEIGHTS)
    checkpoint._save_sharded(policy, tmp / checkpoint.TRAINER)
    (tmp / checkpoint.STATE_FILE).write_text(RunState(global_step=step).to_json())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for older in directory.glob(f"{checkpoint.PREFIX}*"):
        if older != final:
            shutil.rmtree(older)
    return final


def evict(folder: Path) -> None:
    """Drop this folder's files from the page cache (they are clean: fsynced)."""
    for path in folder.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def timed(work: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default="", help="Folder for the checkpoints (a temp dir).")
    args = parser.parse_args()

    import torch
    from kubestar.engine.models import resolve_model
    from kubestar.training import checkpoint
    from kubestar.training.batch import make_batch
    from kubestar.training.checkpoint import RunState
    from kubestar.training.policy import OptimizerConfig, Policy

    torch.set_num_threads(2)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="checkpoint-bench-"))
    policy = Policy(resolve_model(args.model), OptimizerConfig(learning_rate=1e-5))
    batch = make_batch([[1000 + i for i in range(8)]], [[2000 + i for i in range(8)]], [[1] * 8])
    policy.sft_step(batch.rows([0]))  # AdamW's moments exist from the first step
    weights = policy.save_weights(scratch / "weights")

    # Untimed, one of each: the first save pays for torch.distributed.checkpoint's start.
    old_save(scratch / "warm-up", policy, 0, weights)
    checkpoint.save(scratch / "warm-up", policy, RunState(), keep=1, weights=weights)
    shutil.rmtree(scratch / "warm-up")
    old_seconds: list[float] = []
    new_seconds: list[float] = []
    step = 0
    for _ in range(args.rounds):
        for kind, seconds in (("old", old_seconds), ("new", new_seconds)):
            step += 1
            directory = scratch / kind
            started = time.perf_counter()
            if kind == "old":
                saved = old_save(directory, policy, step, weights)
            else:
                state = RunState(global_step=step)
                saved = checkpoint.save(directory, policy, state, keep=1, weights=weights)
            seconds.append(time.perf_counter() - started)
            assert checkpoint.latest(directory) == saved

    newest = checkpoint.latest(scratch / "new")
    assert newest is not None
    size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    trainer = sum(p.stat().st_size for p in (newest / checkpoint.TRAINER).iterdir())
    warm, good = timed(lambda: checkpoint.newest_good(scratch / "new"))
    assert good == newest
    evict(newest)
    cold, _ = timed(lambda: checkpoint.newest_good(scratch / "new"))
    evict(newest)
    load, _ = timed(lambda: checkpoint.load(newest, policy))
    latest, _ = timed(lambda: checkpoint.latest(scratch / "old"))

    old, new = statistics.median(old_seconds), statistics.median(new_seconds)
    print(f"model {args.model}: checkpoint {size / MB:,.0f} MB ({trainer / MB:,.0f} MB trainer)")
    print(f"rounds {args.rounds}; scratch {scratch}")
    print("| what | before manifests | now | overhead |")
    print("|---|---|---|---|")
    print(
        f"| save s (median; all rounds) | {old:.2f} ({', '.join(f'{s:.2f}' for s in old_seconds)})"
        f" | {new:.2f} ({', '.join(f'{s:.2f}' for s in new_seconds)}) | {new - old:+.2f} s "
        f"(x{new / old:.2f}) |"
    )
    print(
        f"| check before resuming s, files cached / evicted | {latest * 1e3:.1f} ms (none) | "
        f"{warm:.2f} / {cold:.2f} | +{cold:.2f} s cold, {size / MB / cold:,.0f} MB/s |"
    )
    print(f"| load s (evicted), for scale | {load:.2f} | {load:.2f} | |")
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
