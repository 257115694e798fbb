"""The policy being trained: a Hugging Face causal LM with its optimizer.

It computes token log-probabilities, takes GRPO and SFT updates with gradient accumulation,
and writes its weights as a Hugging Face folder that vLLM engines reload in place.

At world size N (`kubestar.training.distributed`) every rank holds a Policy over its shard of
the weights and optimizer state, and calls each method with its own rows of the batch; the
methods are collective (every rank calls them, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kubestar.training.batch import TokenBatch, pad_rows, plan_micro_batches
from kubestar.training.distributed import (
    SINGLE,
    ShardingConfig,
    World,
    all_reduce,
    compute_dtype,
    device_for,
    init_world,
)
from kubestar.training.grpo import GrpoConfig, grpo_loss
from kubestar.training.loading import load_model
from kubestar.training.logprobs import model_token_logprobs
from kubestar.training.weights import DEFAULT_BUCKET_BYTES, WeightsWritten, write_weights


@dataclass
class OptimizerConfig:
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0


class Policy:
    last_weights: WeightsWritten | None = None  # the newest save_weights's record

    def __init__(
        self,
        model_path: str | Path,
        optimizer: OptimizerConfig,
        device: str = "auto",
        micro_batch_size: int = 4,
        seed: int = 0,
        world: World = SINGLE,
        sharding: ShardingConfig | None = None,
        precision: str = "auto",
        chunked_logprobs: bool = True,
        max_tokens_per_micro_batch: int | None = None,
        defer_gradient_sync: bool = True,
    ) -> None:
        """`precision`: trainer.precision (auto, bf16 or fp32; `compute_dtype`).
        `chunked_logprobs`: log-probabilities a chunk of positions at a time, never the full
        logits (False: the full-logits path, kept to measure against).
        `max_tokens_per_micro_batch`: trainer.maxTokensPerMicroBatch, micro-batches by tokens
        instead of `micro_batch_size` rows (`plan_micro_batches`). `defer_gradient_sync`:
        sharded, one gradient reduction per optimizer update (`_sync_gradients`; False: one
        per micro-batch, less memory, more communication)."""
        torch.manual_seed(seed)
        self.source = Path(model_path)
        self.world = world
        self.device = device_for(world, device)
        init_world(world, self.device)
        self.compute_dtype = compute_dtype(precision, self.device)
        sharding = sharding or ShardingConfig()
        # Master weights in fp32 (bf16 AdamW updates of 1e-6 would round to nothing); sharded,
        # each rank reads only its own rows.
        self.model: Any = load_model(
            self.source,
            world,
            self.device,
            self.compute_dtype,
            activation_checkpointing=sharding.activation_checkpointing,
        )
        self.optimizer_config = optimizer
        self.micro_batch_size = micro_batch_size
        self.chunked_logprobs = chunked_logprobs
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.defer_gradient_sync = defer_gradient_sync
        self.optimizer = self._new_optimizer(optimizer.learning_rate)

    def _new_optimizer(self, learning_rate: float) -> torch.optim.AdamW:
        config = self.optimizer_config
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

    def reset_optimizer(self, learning_rate: float | None = None) -> None:
        """Fresh moments (between stages, when a stage asks for it)."""
        self.optimizer = self._new_optimizer(learning_rate or self.optimizer_config.learning_rate)

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def _micro_batches(self, batch: TokenBatch) -> list[tuple[list[int], TokenBatch]]:
        """(rows of `batch`, their micro-batch) for each forward/backward pass
        (`plan_micro_batches`). Every rank makes as many passes, since FSDP2's collectives
        pair up pass by pass: a rank with fewer makes up the difference with filler passes
        (no rows of `batch`: one attended token, no loss)."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        plan = plan_micro_batches(lengths, self.micro_batch_size, self.max_tokens_per_micro_batch)
        passes = int(all_reduce(len(plan), self.world, self.device, op="max"))
        plan += [[] for _ in range(passes - len(plan))]
        return [(rows, batch.rows(rows) if rows else batch.rows([]).padded(1)) for rows in plan]

    def _sync_gradients(self, last: bool) -> None:
        """Sharded, with gradient sync deferred: FSDP2 reduce-scatters the gradients only in
        the backward pass of an update's last micro-batch; before it, each rank sums its
        micro-batches' gradients unsharded (fp32, 4 bytes a parameter) without communicating."""
        if self.world.sharded and self.defer_gradient_sync:
            self.model.set_requires_gradient_sync(last)

    def _forward_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        # Trim right padding shared by the whole micro-batch before the forward pass.
        width = int(batch.attention_mask.sum(dim=1).max().item())
        input_ids = batch.input_ids[:, :width].to(self.device)
        attention_mask = batch.attention_mask[:, :width].to(self.device)
        # Unsharded, autocast computes in the compute dtype (sharded, FSDP2's gathered
        # parameters already are); the weights themselves stay fp32 either way.
        mixed = not self.world.sharded and self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=mixed):
            # [b, width-1]; chunked, the full logits never exist (kubestar.training.logprobs)
            logprobs = model_token_logprobs(
                self.model, input_ids, attention_mask, chunked=self.chunked_logprobs
            )
        return torch.nn.functional.pad(logprobs, (0, batch.loss_mask.shape[1] - (width - 1)))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probabilities under the current weights, [B, L-1] (no gradient)."""
        self.model.eval()
        out = torch.zeros_like(batch.sampling_logprobs)
        for rows, micro in self._micro_batches(batch):
            logprobs = self._forward_logprobs(micro).cpu()  # collective: fillers run too
            if rows:  # a filler pass's result is dropped
                out[rows] = logprobs
        return out

    def grpo_step(
        self,
        batch: TokenBatch,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        config: GrpoConfig,
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch, accumulating over micro-batches.

        At world size N, `batch` holds this rank's rows and the returned stats are the whole
        mini-batch's: every token weighs 1 / (the mini-batch's tokens over all ranks),
        whichever rank and micro-batch it lands in.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(all_reduce(batch.tokens, self.world, self.device), 1.0)
        totals: dict[str, float] = {}
        passes = self._micro_batches(batch)
        for index, (rows, micro) in enumerate(passes):
            self._sync_gradients(last=index == len(passes) - 1)
            logprobs = self._forward_logprobs(micro)
            mask = micro.loss_mask.to(self.device)
            filler = len(micro.input_ids)  # a filler pass: one row, no loss tokens
            loss, stats = grpo_loss(
                logprobs,
                pad_rows(old_logprobs[rows], filler).to(self.device),
                pad_rows(advantages[rows], filler).to(self.device),
                mask,
                config,
                normalizer=float(tokens),
                sampling_logprobs=micro.sampling_logprobs.to(self.device),
            )
            loss.backward()
            weight = float(mask.sum()) / tokens
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * (1.0 if key == "loss" else weight)
        totals = {key: all_reduce(value, self.world, self.device) for key, value in totals.items()}
        totals["grad_norm"] = self._clip_and_step()
        return totals

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step of masked next-token cross-entropy (sharded: as grpo_step)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(all_reduce(batch.tokens, self.world, self.device), 1.0)
        total = 0.0
        passes = self._micro_batches(batch)
        for index, (_, micro) in enumerate(passes):
            self._sync_gradients(last=index == len(passes) - 1)
            logprobs = self._forward_logprobs(micro)
            mask = micro.loss_mask.to(self.device)
            loss = -(logprobs * mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        total = all_reduce(total, self.world, self.device)
        return {"loss": total, "grad_norm": self._clip_and_step()}

    def _clip_and_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optimizer_config.max_grad_norm
        )
        self.optimizer.step()
        # Sharded: a DTensor whose value is the norm over every rank's shard.
        full = getattr(norm, "full_tensor", None)
        return float(full() if full else norm)

    def save_weights(self, folder: str | Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
        """A Hugging Face folder (bf16 safetensors + config + tokenizer) for the engines,
        gathered bucket by bucket (`kubestar.training.weights`): every rank takes part, rank 0
        writes and holds at most one bucket of `bucket_bytes`. What was written is kept in
        `last_weights`."""
        self.last_weights = write_weights(
            self.model, self.source, Path(folder), self.world, bucket_bytes
        )
        return self.last_weights.folder

    def state(self) -> dict[str, Any]:
        """Weights and optimizer moments for a checkpoint, as this rank holds them: sharded
        state dicts (each DTensor its local shard, keyed by parameter name) that
        torch.distributed.checkpoint writes rank by rank and reshards on load; plain
        tensors at world size 1. Nothing is gathered."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # An optimizer that has not stepped (RL right after SFT's reset, every group uniform)
        # gets its state made here, as it will be on load: torch only makes it when no
        # gradient is left over, and a checkpoint without it could not be loaded.
        self.optimizer.zero_grad(set_to_none=True)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state(self, state: dict[str, Any]) -> None:
        """Put `state` (the structure of `state()`, its tensors filled in by a checkpoint
        load) into the model and the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
