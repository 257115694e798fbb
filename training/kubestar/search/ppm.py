"""Training rStar-Math's process preference model (`kubestar.scoring.model`) on step-level
preference pairs with the Bradley-Terry loss.

* For each pair, the chosen and the rejected sequence (the same prompt, then a different
  step) go through the model together and the loss is -log sigmoid(r_chosen - r_rejected),
  averaged over pairs. The whole backbone is fine-tuned, with AdamW at rStar's learning rate
  (7e-6) for its two epochs by default.
* Sequences longer than `max_tokens` keep their last tokens: the reward is read at the end,
  so the step being judged must stay (rStar cuts the end instead, which can drop the step).
* The trained model is saved as a PPM folder (`ProcessPreferenceModel.save`), which the
  scoring service serves: `train_ppm_folder` does it all, for `kubestar ppm train` and the
  PPM stage of `kubestar evolve`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from kubestar.scoring.model import ProcessPreferenceModel
from kubestar.search.ppm_data import PpmExample, split_pairs
from kubestar.training.policy import OptimizerConfig

# (epoch, step, total steps, loss of the step).
ProgressCallback = Callable[[int, int, int, float], None]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected) over pairs: the negative log-likelihood
    that the chosen step is preferred under the Bradley-Terry model."""
    return -torch.nn.functional.logsigmoid(chosen.float() - rejected.float()).mean()


def truncate(ids: Sequence[int], max_tokens: int) -> list[int]:
    """The last `max_tokens` ids (the reward is read at the last token)."""
    return list(ids[-max_tokens:]) if len(ids) > max_tokens else list(ids)


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


def train_ppm_folder(
    base: Path,
    examples: Sequence[PpmExample],
    out: Path,
    settings: PpmTrainSettings,
    *,
    held_out: float,
    device: str,
    pairs_file: Path,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """A PPM trained from `base` (a PPM folder, or a model's for a fresh head) on the pairs
    of `pairs_file` (`examples`), the share `held_out` of them kept out of training (split
    by `settings.seed`), and saved as the PPM folder `out`, whose ppm.json keeps the metrics,
    the settings and the pairs file; returns the metrics (`PpmTrainMetrics.as_dict`)."""
    train, held = split_pairs(examples, held_out, settings.seed)
    model = ProcessPreferenceModel.load(base, device=device, seed=settings.seed)
    metrics = train_ppm(model, train, settings, held_out=held, progress=progress)
    report = metrics.as_dict()
    model.save(
        out,
        metadata={
            "training": report,
            "settings": asdict(settings),
            "pairs_file": str(pairs_file.resolve()),
        },
    )
    return report
