"""trainer.maxTokensPerMicroBatch: micro-batches by a token budget, longest first, take the
same update as micro-batches of rows (the token-level normalisation is the mini-batch's) while
the passes compute fewer padded tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers")

import torch  # noqa: E402
from kubestar.api.v1alpha1 import TrainerSpec, TrainingRunSpec  # noqa: E402
from kubestar.training.batch import TokenBatch, make_batch, plan_micro_batches  # noqa: E402
from kubestar.training.grpo import GrpoConfig  # noqa: E402
from kubestar.training.policy import OptimizerConfig, Policy  # noqa: E402
from kubestar.training.session import policy_settings  # noqa: E402
from pydantic import ValidationError  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


def test_rows_mode_takes_rows_in_order() -> None:
    assert plan_micro_batches([5, 9, 2, 7, 3], 2) == [[0, 1], [2, 3], [4]]


def test_token_mode_packs_longest_first_within_the_budget() -> None:
    lengths = [10, 40, 12, 38, 90, 11, 9]
    plan = plan_micro_batches(lengths, 2, max_tokens=80)
    assert plan == [[4], [1, 3], [2, 5, 0, 6]]  # 90 alone: longer than the budget
    assert sorted(row for rows in plan for row in rows) == list(range(len(lengths)))
    for rows in plan[1:]:  # a padded pass computes rows x its longest
        assert len(rows) * max(lengths[r] for r in rows) <= 80
    assert plan_micro_batches([], 2, max_tokens=80) == []


def batch_of_mixed_lengths(rows: int = 7, seed: int = 3) -> TokenBatch:
    """Rows of 3 + 2..40 tokens (tool tokens masked out of the longer ones)."""
    rng = random.Random(seed)
    prompts, responses, masks = [], [], []
    for _ in range(rows):
        length = rng.choice((2, 4, 9, 25, 40))
        prompts.append([rng.randrange(1, 500) for _ in range(3)])
        responses.append([rng.randrange(1, 500) for _ in range(length)])
        masks.append([0 if 10 <= i < 15 else 1 for i in range(length)])
    return make_batch(prompts, responses, masks, [[-1.0] * len(r) for r in responses])


def train(model_dir: Path, step: str, **micro: Any) -> tuple[dict[str, float], list[Any], int]:
    """One GRPO or SFT step: its stats, the gradients it stepped with, and the tokens its
    forward passes computed (rows x width, padding included)."""
    policy = Policy(model_dir, OptimizerConfig(learning_rate=1e-3), device="cpu", **micro)
    grads: list[Any] = []
    policy.optimizer.register_step_pre_hook(
        lambda *_: grads.extend(p.grad.clone() for p in policy.model.parameters())
    )
    computed: list[int] = []
    policy.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: computed.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    batch = batch_of_mixed_lengths()
    if step == "sft":
        stats = policy.sft_step(batch)
    else:
        rows = batch.input_ids.shape[0]
        old = policy.logprobs(batch) + 0.05 * torch.randn(rows, batch.loss_mask.shape[1])
        computed.clear()  # the update's passes only
        advantages = torch.linspace(-1.0, 1.0, rows)
        stats = policy.grpo_step(batch, old, advantages, GrpoConfig())
    return stats, grads, sum(computed)


@pytest.mark.parametrize("step", ["grpo", "sft"])
def test_micro_batches_by_tokens_take_the_same_update_as_rows(model_dir: Path, step: str) -> None:
    torch.manual_seed(0)
    by_rows, rows_grads, rows_computed = train(model_dir, step, micro_batch_size=2)
    torch.manual_seed(0)
    by_tokens, tokens_grads, tokens_computed = train(
        model_dir, step, micro_batch_size=2, max_tokens_per_micro_batch=64
    )
    assert by_tokens["loss"] == pytest.approx(by_rows["loss"], rel=1e-5, abs=1e-7)
    assert by_tokens["grad_norm"] == pytest.approx(by_rows["grad_norm"], rel=1e-4)
    assert len(rows_grads) == len(tokens_grads) > 0
    for a, b in zip(rows_grads, tokens_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
    # Rows of like length share a pass: less padding computed than pairs in batch order.
    assert tokens_computed < rows_computed


def test_the_spec_field_reaches_the_policy_and_zero_is_refused() -> None:
    spec = TrainingRunSpec.model_validate(
        {
            "model": {"name": "m"},
            "rolloutFleetRef": {"name": "f"},
            "sandboxPoolRef": {"name": "s"},
            "stages": [
                {"name": "s1", "steps": 1, "maxResponseTokens": 64, "dataset": {"generator": "g"}}
            ],
            "trainer": {"maxTokensPerMicroBatch": 16384, "microBatchSize": 2},
        }
    )
    settings = policy_settings(spec)
    assert (settings.max_tokens_per_micro_batch, settings.micro_batch_size) == (16384, 2)
    assert TrainerSpec().max_tokens_per_micro_batch is None  # unset: rows
    with pytest.raises(ValidationError, match="maxTokensPerMicroBatch"):
        TrainerSpec.model_validate({"maxTokensPerMicroBatch": 0})
