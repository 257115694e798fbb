"""Every GRPO update does what it says, in the manner of TRL's trainer tests: on groups with
mixed rewards the parameters change, tokens with a positive advantage become more likely and
those with a negative one less; updatesPerStep mini-batches take that many optimizer steps
and make the clip bite; a step whose groups all share one reward trains nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers")

import torch  # noqa: E402
from kubestar.api.v1alpha1 import AlgorithmSpec  # noqa: E402
from kubestar.training.batch import make_batch  # noqa: E402
from kubestar.training.policy import OptimizerConfig, Policy  # noqa: E402
from kubestar.training.session import algorithm_config  # noqa: E402
from kubestar.training.trainer import AlgorithmConfig, GrpoTrainer  # noqa: E402
from kubestar.training.trajectory import Trajectory  # noqa: E402

PROMPT = [1, 17, 42, 99, 7]
GOOD = [5, 6, 7, 8, 9, 10]  # the answer rewarded 1
BAD = [11, 12, 13, 14, 15, 16]  # the answer rewarded 0


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


def trajectory(problem: str, index: int, response: list[int], reward: float) -> Trajectory:
    return Trajectory(
        id=f"{problem}-{index}",
        problem_id=problem,
        sample_index=index,
        question="q",
        reference="r",
        prompt_ids=list(PROMPT),
        response_ids=list(response),
        response_mask=[1] * len(response),
        response_logprobs=[0.0] * len(response),
        reward=reward,
    )


def groups(problems: int, rewards: tuple[float, float] = (1.0, 0.0)) -> list[Trajectory]:
    """`problems` groups of 4: two GOOD answers with rewards[0], two BAD with rewards[1]."""
    out = []
    for p in range(problems):
        out += [trajectory(f"p{p}", i, GOOD, rewards[0]) for i in range(2)]
        out += [trajectory(f"p{p}", i + 2, BAD, rewards[1]) for i in range(2, 4)]
    return out


def sequence_logprob(policy: Policy, response: list[int]) -> float:
    batch = make_batch([PROMPT], [response], [[1] * len(response)])
    return float((policy.logprobs(batch) * batch.loss_mask).sum())


def new_policy(model_dir: Path, learning_rate: float) -> Policy:
    return Policy(model_dir, OptimizerConfig(learning_rate=learning_rate), device="cpu")


def parameters(policy: Policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


def test_one_update_raises_rewarded_tokens_and_lowers_the_others(model_dir: Path) -> None:
    policy = new_policy(model_dir, learning_rate=1e-3)
    trainer = GrpoTrainer(policy, AlgorithmConfig(name="grpo", group_size=4), pad_id=0)
    before = parameters(policy)
    good, bad = sequence_logprob(policy, GOOD), sequence_logprob(policy, BAD)
    metrics = trainer.update(groups(1))
    assert metrics["groups_kept"] == 1 and metrics["trained_tokens"] == 4 * len(GOOD)
    assert metrics["optimizer_steps"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, parameters(policy), strict=True))
    assert sequence_logprob(policy, GOOD) > good  # positive advantage: more likely
    assert sequence_logprob(policy, BAD) < bad  # negative advantage: less likely


def test_a_step_whose_rewards_are_all_equal_trains_nothing(model_dir: Path) -> None:
    policy = new_policy(model_dir, learning_rate=1e-3)
    trainer = GrpoTrainer(policy, AlgorithmConfig(name="grpo", group_size=4), pad_id=0)
    before = parameters(policy)
    metrics = trainer.update(groups(2, rewards=(1.0, 1.0)))
    assert metrics["skipped_update"] == 1.0 and metrics["groups_kept"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(policy), strict=True))


def test_updates_per_step_take_that_many_steps_and_the_clip_bites(model_dir: Path) -> None:
    """The spec's algorithm.updatesPerStep reaches the trainer; with 4 mini-batches the later
    ones train on weights that already moved, so ratios leave the clip band."""
    spec = AlgorithmSpec.model_validate({"name": "grpo", "groupSize": 4, "updatesPerStep": 4})
    config = algorithm_config(spec)
    assert config.updates_per_step == 4
    policy = new_policy(model_dir, learning_rate=3e-2)
    steps: list[int] = []
    policy.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    metrics = GrpoTrainer(policy, config, pad_id=0).update(groups(4))
    assert len(steps) == 4 and metrics["optimizer_steps"] == 4
    assert metrics["train_clip_fraction"] > 0
    one = GrpoTrainer(
        new_policy(model_dir, 3e-2), AlgorithmConfig(name="grpo", group_size=4), pad_id=0
    ).update(groups(4))
    assert one["optimizer_steps"] == 1
    assert one["train_clip_fraction"] == 0  # one mini-batch: on-policy, ratio 1
    # The report's per-step columns of the update are keys the trainer logs.
    from kubestar.training.report import PLOTS, STEP_COLUMNS

    shown = {key for key, _, _ in STEP_COLUMNS} | {k for *_, series in PLOTS for k, _ in series}
    assert {key for key in shown if key.startswith("train_")} <= metrics.keys()
