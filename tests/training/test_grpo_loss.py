"""GRPO-RoC loss and advantages on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from tests.real_parts import require_modules

require_modules("torch")

import torch  # noqa: E402
from kubestar.training.grpo import GrpoConfig, group_advantages, grpo_loss  # noqa: E402


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    advantages = group_advantages(rewards, groups)
    # group 0: mean 0.25, population std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert advantages[0].item() == pytest.approx(0.75 / std, rel=1e-5)
    assert advantages[1].item() == pytest.approx(-0.25 / std, rel=1e-5)
    # group 1: all equal -> zero advantage, no division by zero
    assert advantages[4].item() == 0.0 and advantages[5].item() == 0.0


def test_loss_is_minus_advantage_when_policy_unchanged() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    advantages = torch.tensor([2.0])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = grpo_loss(logprobs, logprobs.clone(), advantages, mask)
    assert loss.item() == pytest.approx(-2.0)  # ratio 1 on both trained tokens
    assert stats["clip_fraction"] == 0.0


def test_clip_higher_bounds_positive_and_negative_advantages() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.25]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    config = GrpoConfig(clip_low=0.2, clip_high=0.28)
    positive, _ = grpo_loss(new, old, torch.tensor([1.0]), mask, config)
    # A>0: token 1 clipped at 1.28, token 2 keeps 0.5 (min of objectives) -> -(1.28 + 0.5)/2
    assert positive.item() == pytest.approx(-(1.28 + 0.5) / 2, rel=1e-5)
    negative, _ = grpo_loss(new, old, torch.tensor([-1.0]), mask, config)
    # A<0: token 1 keeps 1.5, token 2 clipped at 0.8 -> (1.5 + 0.8)/2
    assert negative.item() == pytest.approx((1.5 + 0.8) / 2, rel=1e-5)


def test_masked_tokens_get_no_gradient() -> None:
    logprobs = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = grpo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 1].item() == 0.0
    assert logprobs.grad[0, 0].item() == pytest.approx(-0.5)


def test_clip_fractions_count_tokens_outside_the_band_by_side() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.3, 0.55]]))  # ratios 1.5, 0.6, 1.1
    mask = torch.ones(1, 3)
    _, positive = grpo_loss(new, old, torch.tensor([1.0]), mask, GrpoConfig(0.2, 0.28))
    assert positive["clip_high_fraction"] == pytest.approx(1 / 3)  # 1.5 > 1.28
    assert positive["clip_low_fraction"] == 0.0  # A>0: a low ratio is not clipped
    _, negative = grpo_loss(new, old, torch.tensor([-1.0]), mask, GrpoConfig(0.2, 0.28))
    assert negative["clip_low_fraction"] == pytest.approx(1 / 3)  # 0.6 < 0.8
    # clipHigh is the field that decides: at 0.6 the 1.5 ratio is inside the band.
    _, wide = grpo_loss(new, old, torch.tensor([1.0]), mask, GrpoConfig(0.2, 0.6))
    assert wide["clip_high_fraction"] == 0.0 and wide["clip_fraction"] == 0.0


def test_truncated_importance_sampling_weights_tokens_by_the_engines_mismatch() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = old.clone().requires_grad_(True)
    mask = torch.ones(1, 2)
    advantages = torch.tensor([1.0])
    engine = torch.log(torch.tensor([[0.25, 0.05]]))  # weights p_old/p_engine: 2 and 10
    plain, _ = grpo_loss(new, old, advantages, mask, GrpoConfig(), sampling_logprobs=engine)
    assert plain.item() == pytest.approx(-1.0)  # off by default: the engine's numbers unused
    config = GrpoConfig(tis_cap=4.0)
    loss, stats = grpo_loss(new, old, advantages, mask, config, sampling_logprobs=engine)
    assert loss.item() == pytest.approx(-(2.0 + 4.0) / 2, rel=1e-5)  # 10 truncated at 4
    assert stats["tis_weight_mean"] == pytest.approx(3.0, rel=1e-5)
    assert stats["tis_truncated_fraction"] == pytest.approx(0.5)
    same, _ = grpo_loss(new, old, advantages, mask, config, sampling_logprobs=old.clone())
    assert same.item() == pytest.approx(-1.0)  # no mismatch: no correction
