"""One GRPO update on a fixed batch, the same at any world size: what test_distributed runs.

    python -m tests.training.distributed_update MODEL_DIR OUT_DIR [--activation-checkpointing]

runs one rank of a world described by torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Rank 0 writes the full parameters after the update (params.pt)
and the weights folder the engines would load (weights/); every rank writes what it holds
(rank-N.json).

    python -m tests.training.distributed_update MODEL_DIR OUT_DIR --checkpoint save|resume

runs one rank of the checkpoint scenario (test_checkpoint): `save` takes a step, writes the
engines' folder in small buckets and a checkpoint, then takes the next steps; `resume` loads
the newest checkpoint into a fresh policy and takes the same next steps. `damaged` and
`full VOLUME` are test_checkpoint_integrity's: a damaged checkpoint skipped by every rank, a
save to a volume that fills up.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from kubestar.training import checkpoint
from kubestar.training.batch import TokenBatch, make_batch
from kubestar.training.checkpoint import RunState
from kubestar.training.distributed import ShardingConfig, World, all_reduce, close_world, shard
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


def trajectories(seed: int = 7) -> list[Trajectory]:
    """Three problems (4, 4 and 3 samples) whose responses range from 2 to 60 tokens, with
    tool tokens masked out: the ranks' shares hold very different numbers of loss tokens."""
    rng = random.Random(seed)
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


def new_policy(
    model_dir: Path, world: World, activation_checkpointing: bool = False, precision: str = "auto"
) -> tuple[Policy, GrpoTrainer]:
    policy = Policy(
        model_dir,
        OptimizerConfig(learning_rate=LEARNING_RATE),
        device="cpu",
        micro_batch_size=MICRO_BATCH_SIZE,
        world=world,
        sharding=ShardingConfig(activation_checkpointing=activation_checkpointing),
        precision=precision,
    )
    return policy, GrpoTrainer(policy, ALGORITHM, pad_id=0, seed=0)


def one_update(
    model_dir: Path, world: World, activation_checkpointing: bool = False
) -> tuple[Policy, dict[str, float]]:
    policy, trainer = new_policy(model_dir, world, activation_checkpointing)
    # Only rank 0's trajectories count, as in training (it drives the rollouts).
    metrics = trainer.update(trajectories() if world.main else [])
    return policy, metrics


def local_numel(policy: Policy) -> int:
    """Parameters this process holds: its shard of each (a DTensor's local part) or all."""
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in policy.model.parameters()
    )


def run_ranks(size: int, *args: str) -> None:
    """`python -m tests.training.distributed_update ARGS` as `size` ranks on 127.0.0.1, as
    torchrun would start them; fails with the log of the first rank that failed."""
    for rank, (code, log) in enumerate(start_ranks(size, *args)):
        assert code == 0, f"rank {rank} failed:\n{log[-3000:]}"


def start_ranks(size: int, *args: str, timeout: float = 300) -> list[tuple[int, str]]:
    """Each rank's exit code and output (ranks still running after `timeout` seconds are
    killed: a hang fails the caller instead of stalling it)."""
    from kubestar.common.net import free_port

    from tests.real_parts import REPO

    port = free_port()
    processes = []
    for rank in range(size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.training.distributed_update", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            logs.append(output)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return [(process.returncode, log) for process, log in zip(processes, logs, strict=True)]


def full_parameters(policy: Policy) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32 (collective when sharded: each DTensor all-gathered)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in policy.model.state_dict().items()
    }


def main(model_dir: Path, out: Path, activation_checkpointing: bool) -> None:
    world = World.from_env()
    policy, metrics = one_update(model_dir, world, activation_checkpointing)
    params = full_parameters(policy)
    if world.main:
        torch.save(params, out / "params.pt")
    policy.save_weights(out / "weights")
    before = [p.detach().clone() for p in policy.model.parameters()]
    # A checkpoint round trip: each rank writes and reads back its own shards.
    checkpoint.save(out / "checkpoints", policy, RunState(global_step=1), keep=1)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.zero_()
    checkpoint.load(out / "checkpoints" / "step-000001", policy)
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


# The checkpoint scenario: one step, a checkpoint, then a GRPO step and an SFT step.
SMALL_BUCKET_BYTES = 64 * 1024
SFT_ROWS = 5


def sft_batch() -> TokenBatch:
    """Five prompt + answer rows of 4 to 40 tokens (the same on every rank)."""
    rng = random.Random(11)
    prompts, answers = [], []
    for _ in range(SFT_ROWS):
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))])
        answers.append([rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))])
    return make_batch(prompts, answers, [[1] * len(a) for a in answers], pad_id=0)


def next_steps(policy: Policy, trainer: GrpoTrainer) -> dict[str, float]:
    """The steps after the checkpoint: a GRPO update on a new batch, then an SFT step."""
    world = policy.world
    grpo = trainer.update(trajectories(seed=8) if world.main else [])
    sft = policy.sft_step(sft_batch().rows(shard(SFT_ROWS, world)))
    return {"grpo_loss": grpo["train_loss"], "sft_loss": sft["loss"]}


def checkpoint_scenario(model_dir: Path, out: Path, phase: str) -> None:
    """`save`: step 1, the engines' folder in small buckets (weights/), checkpoint (its
    weights linked from weights/), the next steps (continued-*). `resume`: the newest
    checkpoint, then the same next steps (resumed-*)."""
    world = World.from_env()
    policy, trainer = new_policy(model_dir, world)
    checkpoints = out / "checkpoints"
    if phase == "save":
        trainer.update(trajectories() if world.main else [])
        trained = full_parameters(policy)
        policy.save_weights(out / "weights", bucket_bytes=SMALL_BUCKET_BYTES)
        state = RunState(global_step=1, rng_state=trainer.rng.getstate())
        checkpoint.save(checkpoints, policy, state, keep=2, weights=out / "weights")
        if world.main:
            torch.save(trained, out / "trained.pt")
            written = policy.last_weights
            assert written is not None
            record = {**asdict(written), "folder": str(written.folder)}
            (out / "weights-written.json").write_text(json.dumps(record))
    else:
        latest = checkpoint.latest(checkpoints)
        assert latest is not None
        state = checkpoint.load(latest, policy)
        trainer.rng.setstate(state.rng_state)
    losses = next_steps(policy, trainer)
    params = full_parameters(policy)
    name = "continued" if phase == "save" else f"resumed-{world.size}"
    if world.main:
        torch.save(params, out / f"{name}.pt")
    (out / f"{name}-rank-{world.rank}.json").write_text(json.dumps(losses))
    close_world()


def damaged_scenario(model_dir: Path, out: Path) -> None:
    """Checkpoints at steps 1 and 2; the largest file rank 1 hashes when step 2 is verified
    gets one byte flipped; a fresh policy resumes from the newest good checkpoint
    (damaged-rank-N.json: which, its step; damaged.pt: the parameters after step 1)."""
    world = World.from_env()
    policy, trainer = new_policy(model_dir, world)
    checkpoints = out / "checkpoints"
    trainer.update(trajectories() if world.main else [])
    first = full_parameters(policy)
    checkpoint.save(checkpoints, policy, RunState(global_step=1), keep=3)
    trainer.update(trajectories(seed=8) if world.main else [])
    checkpoint.save(checkpoints, policy, RunState(global_step=2), keep=3)
    if world.main:
        torch.save(first, out / "damaged.pt")
        step = checkpoints / "step-000002"
        _, parts, _ = checkpoint._verify_plan(step, world.size)
        name = parts[1][0]  # rank 1 finds it; rank 0 must still set the checkpoint aside
        flip_byte(step / name)
        (out / "damaged-file.txt").write_text(name)
    resumed, _ = new_policy(model_dir, world)
    good = checkpoint.newest_good(checkpoints, world)
    assert good is not None
    state = checkpoint.load(good, resumed)
    params = full_parameters(resumed)
    if world.main:
        torch.save(params, out / "resumed-damaged.pt")
    report = {"checkpoint": good.name, "global_step": state.global_step}
    (out / f"damaged-rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


def computed_dtypes(model: torch.nn.Module) -> set[str]:
    """The dtypes the model's linear layers compute in, filled in as it runs (forward hooks).
    The output projection is left out: it returns fp32 log-probabilities, not its product
    (test_logprobs checks the dtype it multiplies in)."""
    seen: set[str] = set()
    head = model.get_output_embeddings()  # type: ignore[operator]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.register_forward_hook(lambda _m, _i, output: seen.add(str(output.dtype)))
    return seen


def precision_step(policy: Policy) -> dict[str, object]:
    """One SFT step; the dtypes the forward and backward passes computed in, those of the
    master weights and the optimizer state, and whether the update moved the weights
    (collective when sharded)."""
    computed = computed_dtypes(policy.model)
    before = full_parameters(policy)
    policy.sft_step(sft_batch().rows(shard(SFT_ROWS, policy.world)))
    after = full_parameters(policy)
    moments = [t for state in policy.optimizer.state.values() for t in state.values()]
    return {
        "computed": sorted(computed),
        "master": sorted({str(p.dtype) for p in policy.model.parameters()}),
        "optimizer": sorted({str(t.dtype) for t in moments if t.dim() > 0}),
        "moved": any(not torch.equal(before[name], after[name]) for name in before),
    }


def precision_scenario(model_dir: Path, out: Path, precision: str) -> None:
    """`precision_step` at trainer.precision `precision` on each rank
    (precision-rank-N.json)."""
    world = World.from_env()
    policy, _ = new_policy(model_dir, world, precision=precision)
    report = precision_step(policy)
    (out / f"precision-rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


def load_scenario(model_dir: Path, out: Path) -> None:
    """A sharded Policy loaded while every safetensors read is recorded: how many elements
    each tensor read held, against the tensor's whole size (load-rank-N.json)."""
    import safetensors

    opened = safetensors.safe_open
    reads: list[tuple[str, int, int]] = []  # (tensor, elements read, elements whole)

    class Recorded:
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def __enter__(self) -> Recorded:
            self.handle.__enter__()  # type: ignore[attr-defined]
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.__exit__(*exc)  # type: ignore[attr-defined]

        def keys(self) -> list[str]:
            return list(self.handle.keys())  # type: ignore[attr-defined]

        def get_slice(self, key: str) -> object:
            stored = self.handle.get_slice(key)  # type: ignore[attr-defined]
            whole = 1
            for size in stored.get_shape():
                whole *= size

            class Slice:
                def __getitem__(self, index: object) -> torch.Tensor:
                    tensor: torch.Tensor = stored[index]
                    reads.append((key, tensor.numel(), whole))
                    return tensor

            return Slice()

    safetensors.safe_open = lambda *args, **kwargs: Recorded(opened(*args, **kwargs))  # type: ignore[misc,assignment]
    world = World.from_env()
    policy = Policy(model_dir, OptimizerConfig(), device="cpu", world=world)
    safetensors.safe_open = opened  # type: ignore[misc]
    report = {"reads": reads, "local_numel": local_numel(policy)}
    (out / f"load-rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


# The sync scenario's ways of taking one update: Policy options.
SYNC_WAYS: dict[str, dict[str, object]] = {
    "per-micro-batch": {"defer_gradient_sync": False},
    "per-update": {"defer_gradient_sync": True},
    "per-update-by-tokens": {"defer_gradient_sync": True, "max_tokens_per_micro_batch": 80},
}


def sync_scenario(model_dir: Path, out: Path) -> None:
    """One GRPO update (2 optimizer steps) each way of SYNC_WAYS, from the same initial
    weights, in one world: the full parameters after (sync-WAY.pt) and, per rank, how many
    reduce-scatters and training passes each made (sync-rank-N.json)."""
    import torch.distributed as dist

    world = World.from_env()
    reduce_scatters = [0]
    original = dist.reduce_scatter_single

    def counted(*args: object, **kwargs: object) -> object:
        reduce_scatters[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist.reduce_scatter_single = counted  # type: ignore[assignment]  # FSDP2's call
    report: dict[str, dict[str, float]] = {}
    passes = [0]  # training forward passes of the way being taken
    for way, options in SYNC_WAYS.items():
        policy = Policy(
            model_dir,
            OptimizerConfig(learning_rate=LEARNING_RATE),
            device="cpu",
            micro_batch_size=MICRO_BATCH_SIZE,
            world=world,
            **options,  # type: ignore[arg-type]
        )
        policy.model.register_forward_pre_hook(
            lambda module, _: passes.__setitem__(0, passes[0] + module.training)
        )
        passes[0] = reduce_scatters[0] = 0
        metrics = GrpoTrainer(policy, ALGORITHM, pad_id=0, seed=0).update(
            trajectories() if world.main else []
        )
        report[way] = {
            "reduce_scatters": reduce_scatters[0],
            "passes": passes[0],
            "optimizer_steps": metrics["optimizer_steps"],
            "loss": metrics["train_loss"],
        }
        params = full_parameters(policy)
        if world.main:
            torch.save(params, out / f"sync-{way}.pt")
    (out / f"sync-rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


# Tensors whose rows do not divide evenly: at world size 2, rank 1 holds 2 of "odd"'s rows and
# none of "one_row"'s; "ints" is replicated (taken whole, its dtype kept).
GATHERED = {
    "odd": torch.arange(15, dtype=torch.float32).reshape(5, 3) / 7,
    "one_row": torch.arange(4, dtype=torch.float32).reshape(1, 4) / 3,
    "vector": torch.arange(7, dtype=torch.float32) / 11,
    "ints": torch.arange(6),
}


def gather_scenario(out: Path) -> None:
    """One bucket of GATHERED's tensors, row-sharded as FSDP2 shards them, gathered whole
    onto rank 0 (gathered.pt)."""
    from kubestar.training.distributed import init_world
    from kubestar.training.weights import gather_bucket
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = World.from_env()
    init_world(world, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world.size,))
    entries = [
        (key, distribute_tensor(value, mesh, [Replicate() if key == "ints" else Shard(0)]))
        for key, value in GATHERED.items()
    ]
    held = gather_bucket(entries, world)
    if world.main:
        torch.save(held, out / "gathered.pt")
    close_world()


def flip_byte(path: Path) -> None:
    """Flip every bit of the byte in the middle of `path` (its size stays)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def full_scenario(model_dir: Path, out: Path, volume: Path) -> None:
    """A checkpoint to `volume`, too small for it, with the step's weights linked from
    `out` (another file system: rank 0 copies them); each rank records what it raised
    (full-rank-N.json) and whether the world still works together afterwards."""
    world = World.from_env()
    policy, trainer = new_policy(model_dir, world)
    trainer.update(trajectories() if world.main else [])
    weights = policy.save_weights(out / "weights")
    report: dict[str, object] = {}
    try:
        checkpoint.save(volume, policy, RunState(global_step=1), keep=2, weights=weights)
    except checkpoint.CheckpointError as error:
        report = {"error": type(error).__name__, "message": str(error)}
    # Every rank left the save at the same point: the next collective pairs up.
    report["ranks_after"] = all_reduce(1.0, world, torch.device("cpu"))
    (out / f"full-rank-{world.rank}.json").write_text(json.dumps(report))
    close_world()


if __name__ == "__main__":
    if "--precision" in sys.argv:
        precision = sys.argv[sys.argv.index("--precision") + 1]
        precision_scenario(Path(sys.argv[1]), Path(sys.argv[2]), precision)
    elif "--sync" in sys.argv:
        sync_scenario(Path(sys.argv[1]), Path(sys.argv[2]))
    elif "--load" in sys.argv:
        load_scenario(Path(sys.argv[1]), Path(sys.argv[2]))
    elif "--gather" in sys.argv:
        gather_scenario(Path(sys.argv[2]))
    elif "--checkpoint" in sys.argv:
        phase = sys.argv[sys.argv.index("--checkpoint") + 1]
        if phase == "damaged":
            damaged_scenario(Path(sys.argv[1]), Path(sys.argv[2]))
        elif phase == "full":
            full_scenario(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[-1]))
        else:
            checkpoint_scenario(Path(sys.argv[1]), Path(sys.argv[2]), phase)
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]), "--activation-checkpointing" in sys.argv[3:])
