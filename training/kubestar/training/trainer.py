"""One GRPO-RoC update from a step's rollouts: select, weigh, update.

    rollouts (group_size * oversample per problem, rewarded)
      -> Resample-on-Correct (grpo-roc) or a uniform draw (grpo) down to group_size
      -> group-relative advantages
      -> old log-probabilities under the weights that sampled them (recomputed by the trainer)
      -> `updates_per_step` clipped policy-gradient steps over mini-batches

At world size N, rank 0 selects and builds the batch from the trajectories it rolled out,
broadcasts it, and every rank trains on its rows of each mini-batch (`distributed.shard`).

The trainer recomputes old log-probabilities rather than trusting the engine's: the engine
samples in bf16 with its own kernels, and the ratio must compare like with like.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kubestar.training.batch import TokenBatch, make_batch
from kubestar.training.distributed import all_reduce, broadcast, shard
from kubestar.training.grpo import GrpoConfig, group_advantages
from kubestar.training.policy import Policy
from kubestar.training.roc import PositiveSelection, TraceQuality, resample_on_correct
from kubestar.training.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "grpo-roc"  # or "grpo": no resampling, a uniform draw of group_size
    group_size: int = 16
    oversample_factor: float = 2.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    positive_selection: PositiveSelection = "inverse-penalty"
    updates_per_step: int = 1  # mini-batches per step; more than 1 makes the clip bite
    tis_cap: float | None = None  # truncated importance sampling against the engine's sampling

    @property
    def rollouts_per_problem(self) -> int:
        return max(self.group_size, round(self.group_size * self.oversample_factor))


def trace_quality(trajectory: Trajectory) -> TraceQuality:
    return TraceQuality(
        reward=trajectory.reward or 0.0,
        tool_calls=trajectory.num_tool_calls,
        tool_errors=trajectory.num_tool_errors,
        answers=trajectory.num_answers,
        turns=max(trajectory.num_turns, 1),
    )


def select_groups(
    trajectories: Sequence[Trajectory], config: AlgorithmConfig, rng: random.Random
) -> list[list[Trajectory]]:
    """Group by problem and down-sample each group to group_size. Trajectories spoiled by an
    engine, scheduler or sandbox failure enter no group: a group they thinned keeps the rest."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        if not trajectory.infra_failure:
            groups[trajectory.problem_id].append(trajectory)
    selected: list[list[Trajectory]] = []
    for problem_id in sorted(groups):
        group = groups[problem_id]
        if config.name == "grpo-roc" and len(group) > config.group_size:
            kept = resample_on_correct(
                group, trace_quality, config.group_size, rng, config.positive_selection
            )
            if kept is not None:
                selected.append(kept)
        else:
            kept = rng.sample(group, min(config.group_size, len(group)))
            # A group with one reward for all has zero advantage: nothing to learn from it.
            if len({t.reward for t in kept}) > 1:
                selected.append(kept)
    return selected


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def tool_error_rate(trajectories: Sequence[Trajectory]) -> float:
    """Share of tool calls whose response was an error (0 when there were no calls)."""
    calls = sum(t.num_tool_calls for t in trajectories)
    errors = sum(t.num_tool_errors for t in trajectories)
    return errors / calls if calls else 0.0


def rollout_metrics(rollouts: Sequence[Trajectory]) -> dict[str, float]:
    """What the rollouts say of the policy, before selection; trajectories spoiled by an
    infrastructure failure are counted apart (`spoiled`) and left out of the rest."""
    trajectories = [t for t in rollouts if not t.infra_failure]
    rewards = [t.reward or 0.0 for t in trajectories]
    return {
        # The same while rewards are 0/1 (answer correctness, as in the paper); both are kept
        # so that a graded reward would show apart from accuracy.
        "reward": _mean(rewards),
        "accuracy": _mean([1.0 if (t.reward or 0.0) > 0 else 0.0 for t in trajectories]),
        "tool_calls_per_trajectory": _mean([t.num_tool_calls for t in trajectories]),
        "tool_error_rate": tool_error_rate(trajectories),
        # The policy's own habit in correct answers (the paper's Figure: errors in positives),
        # whatever RoC later keeps.
        "rollout_positive_tool_error_rate": tool_error_rate(
            [t for t in trajectories if (t.reward or 0.0) > 0]
        ),
        "mean_response_tokens": _mean([t.response_length for t in trajectories]),
        "answered_rate": _mean([1.0 if t.answered else 0.0 for t in trajectories]),
        "truncated_rate": _mean([1.0 if t.truncated else 0.0 for t in trajectories]),
        "rollouts": float(len(rollouts)),
        "spoiled": float(len(rollouts) - len(trajectories)),
    }


def kept_metrics(kept: Sequence[Trajectory]) -> dict[str, float]:
    """What RoC kept for the update; a step that kept nothing (every group's rewards equal)
    has no kept reward to report, rather than a misleading 0."""
    if not kept:
        return {"kept": 0.0}
    return {
        "kept_reward": _mean([t.reward or 0.0 for t in kept]),
        "positive_tool_error_rate": tool_error_rate([t for t in kept if (t.reward or 0.0) > 0]),
        "kept_response_tokens": _mean([t.response_length for t in kept]),
        "kept": float(len(kept)),
    }


class GrpoTrainer:
    def __init__(self, policy: Policy, config: AlgorithmConfig, pad_id: int, seed: int = 0) -> None:
        self.policy = policy
        self.config = config
        self.pad_id = pad_id
        self.rng = random.Random(seed)
        self.loss_config = GrpoConfig(
            clip_low=config.clip_low, clip_high=config.clip_high, tis_cap=config.tis_cap
        )

    def _prepare(
        self, trajectories: Sequence[Trajectory]
    ) -> tuple[dict[str, float], tuple[TokenBatch, torch.Tensor, list[list[int]]] | None]:
        """Metrics, and what to train on: the batch, its advantages, the rows of each
        mini-batch (None when every group was dropped)."""
        metrics = rollout_metrics(trajectories)
        groups = select_groups(trajectories, self.config, self.rng)
        kept = [t for group in groups for t in group]
        metrics.update(kept_metrics(kept))
        metrics["groups_kept"] = float(len(groups))
        if not kept:
            return metrics, None
        rewards = torch.tensor([t.reward or 0.0 for t in kept])
        group_ids = torch.tensor([i for i, group in enumerate(groups) for _ in group])
        advantages = group_advantages(rewards, group_ids)  # [B]
        batch = make_batch(
            [t.prompt_ids for t in kept],
            [t.response_ids for t in kept],
            [t.response_mask for t in kept],
            [t.response_logprobs for t in kept],
            pad_id=self.pad_id,
        )
        order = list(range(len(kept)))
        self.rng.shuffle(order)
        splits = max(1, min(self.config.updates_per_step, len(kept)))
        return metrics, (batch, advantages, [order[part::splits] for part in range(splits)])

    def update(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Select, then train on the kept trajectories; returns the step's metrics.

        Sharded, every rank calls it: rank 0 with the step's trajectories (the others' are
        ignored), and every rank returns the same training metrics."""
        world = self.policy.world
        metrics: dict[str, float] = {}
        prepared = None
        if world.main:
            metrics, prepared = self._prepare(trajectories)
        prepared = broadcast(prepared, world)
        if prepared is None:
            metrics["skipped_update"] = 1.0
            return metrics
        batch, advantages, minis = prepared
        # This rank's rows of each mini-batch; all of them at world size 1.
        local = [[rows[i] for i in shard(len(rows), world)] for rows in minis]
        mine = sorted(row for rows in local for row in rows)
        position = {row: i for i, row in enumerate(mine)}
        own = batch.rows(mine)
        old_logprobs = self.policy.logprobs(own)  # [b, L-1], before any update
        engine_gap = (own.sampling_logprobs - old_logprobs).abs() * own.loss_mask
        gap = all_reduce(float(engine_gap.sum()), world, self.policy.device)
        metrics["engine_logprob_gap"] = gap / max(batch.tokens, 1)
        totals: dict[str, float] = defaultdict(float)
        for rows in local:
            stats = self.policy.grpo_step(
                batch.rows(rows),
                old_logprobs[[position[row] for row in rows]],
                advantages[rows],
                self.loss_config,
            )
            for key, value in stats.items():
                totals[key] += value / len(minis)
        # Every rank says what it trained: each holds its shard and takes its rows.
        log.info(
            "rank trained",
            extra={"fields": {"rank": world.rank, "world_size": world.size, "rows": len(mine)}},
        )
        metrics.update({f"train_{key}": value for key, value in totals.items()})
        metrics["trained_tokens"] = float(batch.tokens)
        metrics["optimizer_steps"] = float(len(minis))
        return metrics
