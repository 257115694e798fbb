"""rStar-Math's process preference model (PPM): a causal LM with a scalar head that values a
partial solution, trained on step-level preference pairs with the Bradley-Terry loss.

* The reward of a token sequence is the head (dropout, then one linear layer, initialised
  near zero as rStar's `ValueHead`) applied to the final hidden state of the sequence's last
  token: the backbone reads the whole prefix, the last position summarises it.
* Training (`train_ppm`): for each pair, the chosen and the rejected sequence (the same
  prompt, then a different step) go through the model together and the loss is
  -log sigmoid(r_chosen - r_rejected), averaged over pairs. The whole backbone is
  fine-tuned, with AdamW at rStar's learning rate (7e-6) for its two epochs by default.
  Sequences longer than `max_tokens` keep their last tokens: the reward is read at the end,
  so the step being judged must stay (rStar cuts the end instead, which can drop the step).
* At inference a raw reward r is squashed to tanh(r / 5) (`squash`), as rStar's
  `rm_generate` does: values in [-1, 1], on the scale of the ground-truth rewards the
  search backpropagates (+1 correct, -1 wrong).
* On disk a PPM is a folder: the backbone as a Hugging Face causal-LM folder (fp32
  safetensors, config, tokenizer), `value_head.safetensors` (rStar's key names,
  `v_head.summary.weight` / `.bias`) and `ppm.json` (the squash scale, the base model, the
  training metrics). Loading a plain model folder gives a PPM with a fresh head, the start
  of training.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from kubestar.search.ppm_data import PpmExample, tokenizer_sha256
from kubestar.training.chat import ChatTokenizer
from kubestar.training.distributed import SINGLE, device_for
from kubestar.training.policy import OptimizerConfig
from kubestar.training.weights import TOKENIZER_FILES

# rStar-Math's rm_generate: rewards = tanh(reward / 5) ("PPM use 5 as the scale").
REWARD_SCALE = 5.0
HEAD_FILE = "value_head.safetensors"
INFO_FILE = "ppm.json"
FORMAT = "kubestar-ppm/1"
# rStar's ValueHead: dropout 0.1 (summary_dropout_prob) before the linear layer.
HEAD_DROPOUT = 0.1
HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")

# (epoch, step, total steps, loss of the step).
ProgressCallback = Callable[[int, int, int, float], None]


def squash(raw: float, scale: float = REWARD_SCALE) -> float:
    """A raw reward on the search's scale: tanh(raw / scale), in [-1, 1]."""
    return math.tanh(raw / scale)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected) over pairs: the negative log-likelihood
    that the chosen step is preferred under the Bradley-Terry model."""
    return -torch.nn.functional.logsigmoid(chosen.float() - rejected.float()).mean()


def truncate(ids: Sequence[int], max_tokens: int) -> list[int]:
    """The last `max_tokens` ids (the reward is read at the last token)."""
    return list(ids[-max_tokens:]) if len(ids) > max_tokens else list(ids)


class ValueHead(torch.nn.Module):
    """Dropout, then a linear layer to one value; its weights start near zero (rStar's
    normal(5e-7, 1e-6), bias 1e-6), so an untrained PPM scores everything about 0 and the
    backbone's features are not swamped by a random head at the start of training."""

    def __init__(self, hidden_size: int, dropout: float = HEAD_DROPOUT) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.summary = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.summary.weight, mean=5e-7, std=1e-6)
        torch.nn.init.constant_(self.summary.bias, 1e-6)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.summary(self.dropout(hidden.to(self.summary.weight.dtype)))
        return output.squeeze(-1)


class ProcessPreferenceModel(torch.nn.Module):
    """A causal LM's backbone and a `ValueHead` (see the module docstring). Load one with
    `ProcessPreferenceModel.load`."""

    def __init__(
        self,
        backbone: Any,
        head: ValueHead,
        source: Path,
        reward_scale: float = REWARD_SCALE,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.source = source
        self.reward_scale = reward_scale
        self.tokenizer = ChatTokenizer.from_model(source)
        self.tokenizer_sha256 = tokenizer_sha256(source)

    @classmethod
    def load(cls, model: str | Path, device: str = "auto", seed: int = 0) -> ProcessPreferenceModel:
        """A PPM folder, or a causal LM's folder (or a model name kubestar resolves, such as
        SmolLM2-135M-Instruct) with a fresh head made from `seed`."""
        from kubestar.engine.models import resolve_model
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        folder = resolve_model(str(model))
        torch.manual_seed(seed)
        # fp32 weights, as the policy keeps them: AdamW steps of 7e-6 vanish in bf16, and the
        # served scores equal the trained model's.
        backbone: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        backbone.config.use_cache = False
        head = ValueHead(int(backbone.config.hidden_size))
        scale = REWARD_SCALE
        if (folder / HEAD_FILE).exists():
            state = load_file(str(folder / HEAD_FILE))
            head.summary.load_state_dict({key.rpartition(".")[2]: state[key] for key in HEAD_KEYS})
        if (folder / INFO_FILE).exists():
            scale = float(json.loads((folder / INFO_FILE).read_text()).get("reward_scale", scale))
        ppm = cls(backbone, head, folder, scale)
        return ppm.to(device_for(SINGLE, device))

    @property
    def device(self) -> torch.device:
        return self.head.summary.weight.device

    @property
    def vocab_size(self) -> int:
        return int(self.backbone.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of right-padded rows [B, L]: the head at each row's last token."""
        hidden = self.backbone.base_model(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state  # the final hidden states, after the last norm
        last = attention_mask.sum(dim=1) - 1
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        rewards: torch.Tensor = self.head(hidden[rows, last])
        return rewards

    def rewards(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rewards [B] of token sequences, in one forward pass (with gradients when
        training)."""
        if any(not ids for ids in sequences):
            raise ValueError("every sequence needs at least one token")
        width = max(len(ids) for ids in sequences)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        rewards: torch.Tensor = self(input_ids.to(self.device), attention_mask.to(self.device))
        return rewards

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], batch_size: int = 16) -> list[float]:
        """Raw rewards of token sequences (no dropout, no gradients), `batch_size` at a time."""
        self.eval()
        scores: list[float] = []
        for start in range(0, len(sequences), batch_size):
            scores.extend(self.rewards(sequences[start : start + batch_size]).cpu().tolist())
        return scores

    def save(self, folder: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write the PPM folder (see the module docstring); it appears whole or not at all."""
        from safetensors.torch import save_file

        target = Path(folder)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.backbone.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (self.source / name).exists():
                shutil.copy(self.source / name, tmp / name)
        weight, bias = self.head.summary.weight, self.head.summary.bias
        tensors = {
            key: tensor.detach().cpu().contiguous()
            for key, tensor in zip(HEAD_KEYS, (weight, bias), strict=True)
        }
        save_file(tensors, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        info = {"format": FORMAT, "reward_scale": self.reward_scale, "base_model": str(self.source)}
        info.update(metadata or {})
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target


@dataclass(frozen=True)
class PpmTrainSettings:
    """How a PPM is trained (defaults: rStar-Math's reward-model script where it has one)."""

    learning_rate: float = 7e-6
    epochs: int = 2
    batch_size: int = 16  # pairs per optimizer step
    micro_batch_size: int = 4  # pairs per forward pass; gradients accumulate over a batch
    max_tokens: int = 2048  # a longer sequence keeps its last max_tokens tokens
    seed: int = 0  # the order of pairs, the head's initialisation, dropout
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "micro_batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.learning_rate <= 0:
            raise ValueError("learning_rate must be above 0")


@dataclass
class PpmTrainMetrics:
    """What a training run did. Accuracies are the fraction of pairs whose chosen sequence
    the trained model scores strictly higher (no dropout)."""

    pairs: int
    epoch_losses: list[float] = field(default_factory=list)
    train_accuracy: float = math.nan
    held_out_pairs: int = 0
    held_out_accuracy: float | None = None
    truncated: int = 0  # sequences cut to max_tokens
    steps: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cut(examples: Sequence[PpmExample], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    return [(truncate(e.chosen, max_tokens), truncate(e.rejected, max_tokens)) for e in examples]


@torch.no_grad()
def pair_accuracy(
    model: ProcessPreferenceModel,
    examples: Sequence[PpmExample],
    max_tokens: int = PpmTrainSettings.max_tokens,
    batch_size: int = 16,
) -> float:
    """The fraction of pairs the model orders right (r_chosen > r_rejected)."""
    if not examples:
        return math.nan
    pairs = _cut(examples, max_tokens)
    chosen = model.score([c for c, _ in pairs], batch_size)
    rejected = model.score([r for _, r in pairs], batch_size)
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


def train_ppm(
    model: ProcessPreferenceModel,
    examples: Sequence[PpmExample],
    settings: PpmTrainSettings | None = None,
    held_out: Sequence[PpmExample] = (),
    progress: ProgressCallback | None = None,
) -> PpmTrainMetrics:
    """Train `model` in place on preference pairs (see the module docstring); the accuracy
    on `examples` and on `held_out` is measured after training."""
    settings = settings or PpmTrainSettings()
    if not examples:
        raise ValueError("no preference pairs to train on")
    started = time.monotonic()
    torch.manual_seed(settings.seed)
    optimizer_config = OptimizerConfig(
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm,
    )
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=optimizer_config.learning_rate,
        betas=optimizer_config.betas,
        weight_decay=optimizer_config.weight_decay,
    )
    pairs = _cut(examples, settings.max_tokens)
    metrics = PpmTrainMetrics(
        pairs=len(pairs),
        truncated=sum(
            (len(e.chosen) > settings.max_tokens) + (len(e.rejected) > settings.max_tokens)
            for e in examples
        ),
    )
    rng = random.Random(f"kubestar-ppm-order/{settings.seed}")
    total_steps = math.ceil(len(pairs) / settings.batch_size) * settings.epochs
    for epoch in range(settings.epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        model.train()
        epoch_loss = 0.0
        for first in range(0, len(order), settings.batch_size):
            batch = [pairs[i] for i in order[first : first + settings.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for start in range(0, len(batch), settings.micro_batch_size):
                micro = batch[start : start + settings.micro_batch_size]
                # Chosen and rejected rows in one pass, as rStar's pairwise collator does.
                rewards = model.rewards([c for c, _ in micro] + [r for _, r in micro])
                loss = bradley_terry_loss(rewards[: len(micro)], rewards[len(micro) :])
                (loss * len(micro) / len(batch)).backward()
                step_loss += float(loss.detach()) * len(micro)
            torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer_config.max_grad_norm)
            optimizer.step()
            metrics.steps += 1
            epoch_loss += step_loss
            if progress is not None:
                progress(epoch, metrics.steps, total_steps, step_loss / len(batch))
        metrics.epoch_losses.append(epoch_loss / len(pairs))
    metrics.train_accuracy = pair_accuracy(model, examples, settings.max_tokens)
    if held_out:
        metrics.held_out_pairs = len(held_out)
        metrics.held_out_accuracy = pair_accuracy(model, held_out, settings.max_tokens)
    metrics.seconds = time.monotonic() - started
    return metrics
