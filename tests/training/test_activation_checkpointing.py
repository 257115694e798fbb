"""trainer.activationCheckpointing does what it says: each decoder layer runs its forward pass
again in the backward pass (its activations were not kept), and the update is the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kubestar.training.batch import make_batch
from kubestar.training.distributed import ShardingConfig
from kubestar.training.policy import OptimizerConfig, Policy

from tests.real_parts import require_modules, tiny_model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    require_modules("transformers")
    return tiny_model(64)


def one_step(model_dir: Path, checkpointing: bool) -> tuple[int, list[torch.Tensor]]:
    """Forward calls of the first decoder layer in one SFT step, and the parameters after."""
    policy = Policy(
        model_dir,
        OptimizerConfig(learning_rate=1e-3),
        device="cpu",
        sharding=ShardingConfig(activation_checkpointing=checkpointing),
    )
    layer = policy.model.model.layers[0]
    calls: list[int] = []
    # A pre-hook: the recomputation stops as soon as it has what the backward pass needs,
    # before the layer's forward would return.
    layer.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = make_batch([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]], [[1, 1, 1, 1], [1, 1]])
    policy.sft_step(batch)
    return len(calls), [p.detach().clone() for p in policy.model.parameters()]


def test_activations_are_recomputed_and_the_update_is_the_same(model_dir: Path) -> None:
    kept_calls, kept = one_step(model_dir, checkpointing=False)
    recomputed_calls, recomputed = one_step(model_dir, checkpointing=True)
    assert kept_calls == 1  # one forward pass (micro-batch of 4 >= 2 rows)
    assert recomputed_calls == 2  # the forward pass, and again in the backward pass
    for a, b in zip(kept, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
