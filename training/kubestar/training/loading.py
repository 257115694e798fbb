"""Loading a model for training at any world size, no rank holding more than its shard.

At world size 1 the model is read whole (it is all this rank's). At world size N the model is
built on the meta device (no memory), sharded with FSDP2 (`distributed.shard_model`), given
empty storage for this rank's rows only, and each rank then reads its own rows of every
tensor straight from the folder's safetensors files (memory-mapped slices), cast to fp32: a
rank's peak is its shard plus the rows of one tensor, about 1/N of the model.

Buffers that no file holds (rotary embeddings' frequencies) are computed again by the model's
own initialisation, which is all that knows them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from kubestar.training.distributed import World, row_share, shard_model
from kubestar.training.weights import INDEX_FILE, SINGLE_FILE


class ModelFilesError(RuntimeError):
    """The folder's safetensors files do not hold what the model's config describes."""


def tensor_files(folder: Path) -> dict[str, Path]:
    """Which safetensors file of `folder` holds each tensor (one file, or an index)."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {key: folder / file for key, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.exists():
        raise ModelFilesError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def load_model(
    source: Path,
    world: World,
    device: torch.device,
    compute_dtype: torch.dtype,
    activation_checkpointing: bool = False,
) -> Any:
    """The causal LM of `source` with fp32 master weights on `device`: whole at world size 1,
    this rank's FSDP2 shard (gathered in `compute_dtype` for each layer's passes) at N."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not world.sharded:
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        _prepare(model, activation_checkpointing)
        return model.to(device)
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _prepare(model, activation_checkpointing)
    shard_model(model, world, device, compute_dtype)
    model.to_empty(device=device)
    _compute_unsaved_buffers(model)
    _read_own_rows(model, source, world)
    return model


def _prepare(model: Any, activation_checkpointing: bool) -> None:
    model.config.use_cache = False
    if activation_checkpointing:
        # Non-reentrant: the recomputation runs FSDP's hooks again (all-gathers the layer).
        recompute = {"use_reentrant": False}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=recompute)


def _compute_unsaved_buffers(model: Any) -> None:
    """Non-persistent buffers (left empty by `to_empty`) from the model's own init."""
    for module in model.modules():
        if getattr(module, "_non_persistent_buffers_set", None):
            model._init_weights(module)


@torch.no_grad()
def _read_own_rows(model: Any, source: Path, world: World) -> None:
    """Every parameter's and saved buffer's local part, read from the files: a row-sharded
    DTensor's rows of this rank (as torch.chunk deals them), anything else whole."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    files = tensor_files(source)
    named = dict(model.named_parameters())
    unsaved = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in getattr(module, "_non_persistent_buffers_set", ())
    }
    named.update((key, value) for key, value in model.named_buffers() if key not in unsaved)
    missing = sorted(key for key in named if key not in files)
    if missing:
        raise ModelFilesError(
            f"{source}: the files hold no {', '.join(missing[:3])}"
            + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        )
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for key, value in named.items():
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            stored = handles[path].get_slice(key)
            if isinstance(value, DTensor):  # FSDP2's Shard(0): a run of rows
                local = value.to_local()
                start, count = row_share(value.shape[0], world)
                local.copy_(stored[start : start + count].to(local.dtype))
            else:
                value.copy_(stored[:].to(value.dtype))
