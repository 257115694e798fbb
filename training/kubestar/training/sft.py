"""Non-reasoning SFT: teach the tool-call format and instruction following before RL.

The SFT stage of a run (`run_sft`) gets its examples, masked as RL trajectories, from one of:

* `kubestar.training.sft_data` (spec.dataset unset): scripted solutions whose tool calls run
  in the real sandbox, `spec.examples` of them (default 256);
* `kubestar.training.sft_file` (spec.dataset set): the user's own conversations in the chat
  format TRL and verl read, rendered in kubestar's tool-call format; the file's first
  `spec.examples` conversations that fit `spec.max_tokens` (default: all of them).

and trains on them: `spec.epochs` passes in shuffled batches of `spec.batch_size` examples,
masked cross-entropy through `Policy.sft_step`, with a fresh AdamW at `spec.learning_rate`; the
RL optimizer (fresh moments, the RL learning rate) is restored afterwards.

A sharded trainer makes or reads the examples on rank 0 and every rank trains on its rows of
each batch.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kubestar.training.chat import ChatTokenizer
from kubestar.training.distributed import broadcast, shard
from kubestar.training.rollout import RolloutConfig
from kubestar.training.sft_data import SftExample, build_sft_examples
from kubestar.training.sft_file import load_sft_file

if TYPE_CHECKING:
    from kubestar.api.v1alpha1 import SftSpec
    from kubestar.training.policy import Policy

log = logging.getLogger(__name__)

# (stage, step, total steps, metrics), as TrainingSession's progress callback.
ProgressCallback = Callable[[str, int, int, dict[str, float]], None]

# Examples made when spec.examples is unset and there is no spec.dataset.
DEFAULT_EXAMPLES = 256


def train_sft(
    policy: Policy,
    examples: Sequence[SftExample],
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int = 0,
    pad_id: int = 0,
    progress: ProgressCallback | None = None,
) -> dict[str, float]:
    """Masked cross-entropy on `examples`; the policy's RL optimizer is restored after."""
    from kubestar.training.batch import make_batch

    if not examples:
        raise ValueError("no SFT examples")
    rl_learning_rate = policy.optimizer_config.learning_rate
    policy.reset_optimizer(learning_rate)
    rng = random.Random(f"kubestar-sft-order/{seed}")
    per_epoch = math.ceil(len(examples) / batch_size)
    total_steps = per_epoch * epochs
    step = 0
    trained = 0
    processed = 0
    initial_loss = math.nan
    epoch_losses: list[float] = []
    grad_norm = 0.0
    try:
        for epoch in range(epochs):
            order = list(range(len(examples)))
            rng.shuffle(order)
            weighted, weight = 0.0, 0
            for first in range(0, len(order), batch_size):
                chunk = [examples[i] for i in order[first : first + batch_size]]
                batch = make_batch(
                    [e.prompt_ids for e in chunk],
                    [e.response_ids for e in chunk],
                    [e.response_mask for e in chunk],
                    pad_id=pad_id,
                )
                stats = policy.sft_step(batch.rows(shard(len(chunk), policy.world)))
                step += 1
                tokens = batch.tokens
                trained += tokens
                processed += sum(e.tokens for e in chunk)
                weighted += stats["loss"] * tokens
                weight += tokens
                grad_norm = stats["grad_norm"]
                if step == 1:
                    initial_loss = stats["loss"]
                log.info(
                    "sft step",
                    extra={"fields": {"epoch": epoch, "step": step, "loss": stats["loss"]}},
                )
                if progress is not None:
                    progress("sft", step, total_steps, {"loss": stats["loss"], "epoch": epoch})
            epoch_losses.append(weighted / max(weight, 1))
    finally:
        # RL starts with fresh moments at its own learning rate.
        policy.reset_optimizer(rl_learning_rate)
    return {
        "loss": epoch_losses[-1],
        "first_epoch_loss": epoch_losses[0],
        "initial_loss": initial_loss,
        "steps": float(step),
        "epochs": float(epochs),
        "tokens": float(trained),
        "sequence_tokens": float(processed),
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
    }


def run_sft(
    policy: Policy,
    model_dir: Path,
    spec: SftSpec,
    sandbox_endpoint: str,
    seed: int = 0,
    progress: ProgressCallback | None = None,
    config: RolloutConfig | None = None,
) -> dict[str, float]:
    """The SFT stage of a run: make `spec.examples` examples (or read them from
    `spec.dataset.path`), train on them.

    Returns the metrics (loss of the last epoch, examples, trained tokens, seconds, ...; with
    spec.dataset also dropped_too_long, the file's conversations longer than max_tokens).
    """
    started = time.monotonic()
    tokenizer = ChatTokenizer.from_model(model_dir)
    examples: list[SftExample] = []
    dropped_too_long = 0
    if policy.world.main:
        if spec.dataset is not None:
            # Conversations without a system message get the RL rollouts' instructions.
            instructions = (config or RolloutConfig()).instructions
            read = load_sft_file(
                spec.dataset.path, tokenizer, spec.examples, spec.max_tokens, instructions
            )
            examples, dropped_too_long = read.examples, read.dropped_too_long
        else:
            examples = build_sft_examples(
                spec.examples or DEFAULT_EXAMPLES, sandbox_endpoint, tokenizer, seed=seed,
                max_tokens=spec.max_tokens, config=config,
            )  # fmt: skip
    examples, dropped_too_long = broadcast((examples, dropped_too_long), policy.world)
    built = time.monotonic() - started
    metrics = train_sft(
        policy,
        examples,
        epochs=spec.epochs,
        batch_size=spec.batch_size,
        learning_rate=spec.learning_rate,
        seed=seed,
        progress=progress,
    )
    metrics.update(
        examples=float(len(examples)),
        error_fix_examples=float(sum(e.fixes_error for e in examples)),
        data_seconds=built,
        seconds=time.monotonic() - started,
    )
    if spec.dataset is not None:
        metrics["dropped_too_long"] = float(dropped_too_long)
    return metrics
