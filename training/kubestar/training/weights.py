"""The engines' weights: a Hugging Face folder written bucket by bucket, at any world size.

    folder/
        config.json, generation_config.json, tokenizer files (copied from the base model)
        model.safetensors                          the whole model, when it fits in one bucket
        model-00001-of-00003.safetensors ...       else one file per bucket, and
        model.safetensors.index.json               {"metadata": {"total_size"}, "weight_map"}

Nobody holds the whole fp32 model. The tensors are split into buckets of at most
`bucket_bytes` of bf16 (a tensor larger than that is a bucket of its own), planned from the
tensors' global shapes, so every rank knows the files before any is written. For each
bucket, every rank casts its shards of the bucket's tensors (FSDP2's row shards) to bf16
into one flat buffer, and one gather brings every rank's buffer to rank 0, which puts each
tensor together from its rows, writes the bucket as one safetensors file and drops it: one
collective per bucket, not one per tensor, and rank 0 holds at most one bucket (plus the
padding of uneven row shards). World size 1 takes the same path with plain tensors.

The folder appears atomically: written under a temporary name, renamed into place. vLLM
(`reload_weights`) and transformers read sharded folders with an index as they read one file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kubestar.engine.models import TOKENIZER_FILES
from kubestar.training.distributed import World, barrier, row_share

# A bucket of bf16 tensors rank 0 holds at once while writing the engines' folder.
DEFAULT_BUCKET_BYTES = 1 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXPORT_DTYPE = torch.bfloat16


@dataclass
class WeightsWritten:
    """What one write did: the files, and the bf16 bytes rank 0 held for each bucket."""

    folder: Path
    files: list[str] = field(default_factory=list)
    bucket_bytes: list[int] = field(default_factory=list)
    largest_tensor_bytes: int = 0  # in bf16
    total_bytes: int = 0
    seconds: float = 0.0


def exported_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors in order, each once: a tied weight (lm_head sharing the
    embedding) is kept under its first name, as Hugging Face saves it. Sharded, the values
    are the parameters themselves (DTensors of global shape)."""
    seen: set[int] = set()
    tensors = []
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensors.append((name, value))
    return tensors


def _export_bytes(tensor: torch.Tensor) -> int:
    itemsize = EXPORT_DTYPE.itemsize if tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize  # numel of a DTensor is its global size


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors (by index) grouped so that no bucket holds more than
    `bucket_bytes`, except a single tensor that is larger on its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    held = 0
    for index, size in enumerate(sizes):
        if not buckets or held + size > bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(index)
        held += size
    return buckets


def _exported(full: torch.Tensor) -> torch.Tensor:
    """A gathered tensor as the folder stores it: bf16 (floating point), on the CPU."""
    full = full.detach()
    if full.is_floating_point():
        full = full.to(EXPORT_DTYPE)
    return full.to("cpu").contiguous()


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_config(model: Any, source: Path, folder: Path) -> None:
    """config.json (its dtype bf16) and the base model's tokenizer and generation files."""
    model.config.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and not (source / "generation_config.json").exists():
        generation.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


def _row_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor split by rows over the whole world (FSDP2's Shard(0)), floating point."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(tensor, DTensor)
        and tensor.placements == (Shard(0),)
        and tensor.is_floating_point()
        and tensor.dim() > 0
    )


def gather_bucket(
    entries: Sequence[tuple[str, torch.Tensor]], world: World
) -> dict[str, torch.Tensor]:
    """The tensors of one bucket whole, bf16 on the CPU, on rank 0 ({} on the other ranks).
    Collective when sharded: every rank calls it with the same tensors in the same order.

    Row-sharded tensors travel in one gather: each rank packs its rows of every such tensor,
    cast to bf16 and padded to the longest rank's share (rows are dealt as torch.chunk deals
    them: ceil(rows / N) to each rank in turn), into one flat buffer. Anything else (a
    replicated or plain tensor) is taken whole, as it is."""
    from torch.distributed.tensor import DTensor

    sharded = [(key, tensor) for key, tensor in entries if _row_sharded(tensor)]
    held: dict[str, torch.Tensor] = {}
    if sharded:
        import torch.distributed as dist

        # [rows per rank share, elements per row] of each tensor; the buffer is their sum.
        # Rank 0's share is the longest: every rank's part is padded to it.
        shares = [(row_share(t.shape[0], world, 0)[1], t[0].numel()) for _, t in sharded]
        pieces = []
        for (_, tensor), (share_rows, row_numel) in zip(sharded, shares, strict=True):
            local = tensor.to_local().detach().to(EXPORT_DTYPE).reshape(-1)  # type: ignore[attr-defined]
            piece = local.new_zeros(share_rows * row_numel)
            piece[: local.numel()] = local
            pieces.append(piece)
        buffer = torch.cat(pieces)
        parts = [torch.empty_like(buffer) for _ in range(world.size)] if world.main else None
        dist.gather(buffer, parts, dst=0)
        del buffer, pieces
        if parts is not None:
            offset = 0
            for (key, tensor), (share_rows, row_numel) in zip(sharded, shares, strict=True):
                rows = []
                for rank, part in enumerate(parts):
                    _, count = row_share(tensor.shape[0], world, rank)
                    rows.append(part[offset : offset + count * row_numel])
                offset += share_rows * row_numel
                held[key] = torch.cat(rows).reshape(tensor.shape).to("cpu").contiguous()
            del parts
    for key, tensor in entries:
        if _row_sharded(tensor):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if world.main:
            held[key] = _exported(full)
        del full
    # The bucket's own order (the plan's), whichever way each tensor came.
    return {key: held[key] for key, _ in entries if key in held}


def write_weights(
    model: torch.nn.Module,
    source: Path,
    folder: Path,
    world: World,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> WeightsWritten:
    """Write `model` (sharded or not) as a Hugging Face folder of bf16 safetensors; every
    rank calls it, rank 0 writes. Returns what was written (on rank 0; the other ranks get
    the plan's sizes and no files)."""
    from safetensors.torch import save_file

    started = time.monotonic()
    tensors = exported_tensors(model)
    sizes = [_export_bytes(tensor) for _, tensor in tensors]
    plan = plan_buckets(sizes, bucket_bytes)
    names = _shard_names(len(plan))
    written = WeightsWritten(
        folder=folder, largest_tensor_bytes=max(sizes, default=0), total_bytes=sum(sizes)
    )
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for file, bucket in zip(names, plan, strict=True):
        held = gather_bucket([tensors[index] for index in bucket], world)
        if world.main:
            save_file(held, str(tmp / file), metadata={"format": "pt"})
            written.files.append(file)
            written.bucket_bytes.append(sum(t.numel() * t.element_size() for t in held.values()))
            weight_map.update(dict.fromkeys(held, file))
        del held
    if world.main:
        if len(names) > 1:
            index_file = {"metadata": {"total_size": written.total_bytes}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n")
        write_config(model, source, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # engines never see a half-written folder
    barrier(world)  # no rank goes on before the folder is in place
    written.seconds = time.monotonic() - started
    return written
