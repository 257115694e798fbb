"""One GRPO update on a fixed batch, the same at any world size: what test_distributed runs.

    python -m tests.training.distributed_update MODEL_DIR OUT_DIR [--activation-checkpointing]

runs one rank of a world described by torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Rank 0 writes the full parameters after the update (params.pt)
and the weights folder the engines would load (weights/); every rank writes what it holds
(rank-N.json).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from kubestar.training.distributed import ShardingConfig, World, close_world
from kubestar.training.policy import OptimizerConfig, Policy
from kubestar.training.trainer import AlgorithmConfig, GrpoTrainer
from kubestar.training.trajectory import Trajectory

VOCAB = 256
ALGORITHM = AlgorithmConfig(name="grpo", group_size=4, oversample_factor=1.0, updates_per_step=2)
MICRO_BATCH_SIZE = 2
LEARNING_RATE = 1e-4


def tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama with tied embeddings (as SmolLM2), random weights, saved in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def trajectories() -> list[Trajectory]:
    """Three problems (4, 4 and 3 samples) whose responses range from 2 to 60 tokens, with
    tool tokens masked out: the ranks' shares hold very different numbers of loss tokens."""
    rng = random.Random(7)
    made: list[Trajectory] = []
    for problem, samples in enumerate((4, 4, 3)):
        for sample in range(samples):
            length = rng.choice((2, 5, 30, 60))
            mask = [0 if 10 <= i < 20 else 1 for i in range(length)]  # a tool turn
            made.append(
                Trajectory(
                    id=f"p{problem}-s{sample}",
                    problem_id=f"p{problem}",
                    sample_index=sample,
                    question="",
                    reference="",
                    prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))],
                    response_ids=[rng.randrange(VOCAB) for _ in range(length)],
                    response_mask=mask,
                    response_logprobs=[-1.0] * length,
                    reward=float(sample % 2 == problem % 2),
                )
            )
    return made


def one_update(
    model_dir: Path, world: World, activation_checkpointing: bool = False
) -> tuple[Policy, dict[str, float]]:
    policy = Policy(
        model_dir,
        OptimizerConfig(learning_rate=LEARNING_RATE),
        device="cpu",
        micro_batch_size=MICRO_BATCH_SIZE,
        world=world,
        sharding=ShardingConfig(activation_checkpointing=activation_checkpointing),
    )
    trainer = GrpoTrainer(policy, ALGORITHM, pad_id=0, seed=0)
    # Only rank 0's trajectories count, as in training (it drives the rollouts).
    metrics = trainer.update(trajectories() if world.main else [])
    return policy, metrics


def local_numel(policy: Policy) -> int:
    """Parameters this process holds: its shard of each (a DTensor's local part) or all."""
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in policy.model.parameters()
    )


def main(model_dir: Path, out: Path, activation_checkpointing: bool) -> None:
    world = World.from_env()
    policy, metrics = one_update(model_dir, world, activation_checkpointing)
    state = policy.state()  # collective: every rank takes part, rank 0 gets the full state
    if world.main:
        torch.save(state["model"], out / "params.pt")
    policy.save_weights(out / "weights")
    before = [p.detach().clone() for p in policy.model.parameters()]
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.zero_()
    policy.load_state(state)  # rank 0's full state scattered back to the shards
    after = policy.model.parameters()
    reloaded = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    report = {
        "rank": world.rank,
        "world_size": world.size,
        "local_numel": local_numel(policy),
        "total_numel": sum(p.numel() for p in policy.model.parameters()),
        "metrics": metrics,
        "reloaded": reloaded,
    }
    (out / f"rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), "--activation-checkpointing" in sys.argv[3:])
