"""GRPO with clip-higher and token-level loss, as rStar2-Agent trains it: no KL, no entropy.

Shapes: B trajectories (rows), T response tokens (padded). `response_mask` is 1 on tokens the
policy generated and 0 on prompt padding and tool-response tokens, which are never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrpoConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO): more room to raise unlikely tokens
    advantage_eps: float = 1e-6
    # Truncated importance sampling against the engine/trainer mismatch: each token's loss
    # is weighted by min(p_old / p_engine, tis_cap). None: off.
    tis_cap: float | None = None


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps) for each trajectory.   rewards: [B]"""
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    for group in group_ids.unique():
        members = group_ids == group
        group_rewards = rewards[members].float()
        std = group_rewards.std(unbiased=False) if group_rewards.numel() > 1 else 0.0
        advantages[members] = (group_rewards - group_rewards.mean()) / (std + eps)
    return advantages


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: GrpoConfig = GrpoConfig(),
    normalizer: float | None = None,
    sampling_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss averaged over every trained token of the batch.

    logprobs, old_logprobs, response_mask, sampling_logprobs (the engine's): [B, T];
    advantages: [B]. With gradient accumulation, pass the whole mini-batch's token count as
    `normalizer` so that every token weighs the same whichever micro-batch it falls in.
    """
    mask = response_mask.float()
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    advantage = advantages.unsqueeze(-1)  # [B, 1], one advantage for every token of a trajectory
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)  # pessimistic bound, as in PPO
    stats: dict[str, float] = {}
    tokens = mask.sum().clamp(min=1.0)
    if config.tis_cap is not None and sampling_logprobs is not None:
        # The engine sampled from p_engine, not p_old: reweight, truncated for variance.
        is_weight = torch.exp(old_logprobs - sampling_logprobs).clamp(max=config.tis_cap)
        per_token = per_token * is_weight.detach()
        with torch.no_grad():
            stats["tis_weight_mean"] = float((is_weight * mask).sum() / tokens)
            truncated = (torch.exp(old_logprobs - sampling_logprobs) > config.tis_cap).float()
            stats["tis_truncated_fraction"] = float((truncated * mask).sum() / tokens)
    # Token-level: every trained token weighs the same; long answers are not down-weighted.
    loss = (per_token * mask).sum() / (normalizer or tokens)
    with torch.no_grad():
        low = (ratio < 1.0 - config.clip_low) & (advantage < 0)  # clipped from below
        high = (ratio > 1.0 + config.clip_high) & (advantage > 0)  # clipped from above
        stats |= {
            "loss": float(loss),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "clip_fraction": float(((clipped > unclipped).float() * mask).sum() / tokens),
            "clip_low_fraction": float((low.float() * mask).sum() / tokens),
            "clip_high_fraction": float((high.float() * mask).sum() / tokens),
            "approx_kl": float((((ratio - 1) - (logprobs - old_logprobs)) * mask).sum() / tokens),
        }
    return loss, stats
