"""The policy being trained: a Hugging Face causal LM with its optimizer.

It computes token log-probabilities, takes GRPO and SFT updates with gradient accumulation,
and writes its weights as a Hugging Face folder that vLLM engines reload in place.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kubestar.training.batch import TokenBatch, token_logprobs
from kubestar.training.grpo import GrpoConfig, grpo_loss

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class OptimizerConfig:
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Policy:
    def __init__(
        self,
        model_path: str | Path,
        optimizer: OptimizerConfig,
        device: str = "auto",
        micro_batch_size: int = 4,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.source = Path(model_path)
        self.device = pick_device(device)
        # Master weights in fp32 (bf16 AdamW updates of 1e-6 would round to nothing).
        model: Any = AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32)
        self.model = model.to(self.device)
        self.model.config.use_cache = False
        self.optimizer_config = optimizer
        self.micro_batch_size = micro_batch_size
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

    def _micro_batches(self, batch: TokenBatch) -> Iterator[TokenBatch]:
        rows = batch.input_ids.shape[0]
        for start in range(0, rows, self.micro_batch_size):
            yield batch.rows(slice(start, start + self.micro_batch_size))

    def _forward_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        # Trim right padding shared by the whole micro-batch before the forward pass.
        width = int(batch.attention_mask.sum(dim=1).max().item())
        input_ids = batch.input_ids[:, :width].to(self.device)
        attention_mask = batch.attention_mask[:, :width].to(self.device)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        logprobs = token_logprobs(logits, input_ids)  # [b, width-1]
        return torch.nn.functional.pad(logprobs, (0, batch.loss_mask.shape[1] - (width - 1)))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probabilities under the current weights, [B, L-1] (no gradient)."""
        self.model.eval()
        parts = [self._forward_logprobs(micro).cpu() for micro in self._micro_batches(batch)]
        return torch.cat(parts)

    def grpo_step(
        self,
        batch: TokenBatch,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        config: GrpoConfig,
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch, accumulating over micro-batches."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(batch.tokens, 1)
        totals: dict[str, float] = {}
        for start in range(0, batch.input_ids.shape[0], self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            micro = batch.rows(rows)
            logprobs = self._forward_logprobs(micro)
            mask = micro.loss_mask.to(self.device)
            loss, stats = grpo_loss(
                logprobs,
                old_logprobs[rows].to(self.device),
                advantages[rows].to(self.device),
                mask,
                config,
                normalizer=float(tokens),
            )
            loss.backward()
            weight = float(mask.sum()) / tokens
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * (1.0 if key == "loss" else weight)
        totals["grad_norm"] = self._clip_and_step()
        return totals

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step of masked next-token cross-entropy."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(batch.tokens, 1)
        total = 0.0
        for micro in self._micro_batches(batch):
            logprobs = self._forward_logprobs(micro)
            mask = micro.loss_mask.to(self.device)
            loss = -(logprobs * mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        return {"loss": total, "grad_norm": self._clip_and_step()}

    def _clip_and_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optimizer_config.max_grad_norm
        )
        self.optimizer.step()
        return float(norm)

    def save_weights(self, folder: str | Path) -> Path:
        """A Hugging Face folder (bf16 safetensors + config + tokenizer) for the engines."""
        target = Path(folder)
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(
            tmp,
            safe_serialization=True,
            state_dict={k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()},
        )
        for name in TOKENIZER_FILES:
            if (self.source / name).exists():
                shutil.copy(self.source / name, tmp / name)
        config_path = tmp / "config.json"
        config_path.write_text(config_path.read_text().replace('"float32"', '"bfloat16"'))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target

    def state(self) -> dict[str, object]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, object]) -> None:
        self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
