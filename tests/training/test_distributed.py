"""Sharded training changes memory, not the math: one GRPO update at world size 2 (two gloo
processes, FSDP2) leaves the same parameters as at world size 1 on the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.real_parts import require_modules

require_modules("torch", "transformers")

import torch  # noqa: E402
from kubestar.training.distributed import World, shard  # noqa: E402

from tests.training.distributed_update import (  # noqa: E402
    SYNC_WAYS,
    one_update,
    run_ranks,
    tiny_llama,
)

WORLD_SIZE = 2


def run_world(model_dir: Path, out: Path, size: int, *options: str) -> list[dict[str, object]]:
    """`size` processes on 127.0.0.1, as torchrun would start them."""
    run_ranks(size, str(model_dir), str(out), *options)
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(size)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_rows_are_dealt_to_ranks_in_turn() -> None:
    assert shard(5, World(rank=0, size=2)) == [0, 2, 4]
    assert shard(5, World(rank=1, size=2)) == [1, 3]
    assert shard(1, World(rank=1, size=2)) == []
    assert shard(3, World()) == [0, 1, 2]


def test_filler_rows_attend_one_token_and_carry_no_loss() -> None:
    from kubestar.training.batch import make_batch, pad_rows

    batch = make_batch([[5, 6]], [[7, 8, 9]], [[1, 0, 1]], pad_id=0)
    padded = batch.padded(3)
    assert padded.input_ids.shape == (3, 5) and padded.tokens == batch.tokens == 2
    assert padded.attention_mask[1:].tolist() == [[1, 0, 0, 0, 0]] * 2
    assert padded.rows(slice(0, 1)).input_ids.tolist() == batch.input_ids.tolist()
    assert batch.padded(1) is batch
    assert pad_rows(torch.ones(1, 2), 2).tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_world_comes_from_torchrun_environment() -> None:
    world = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (world.rank, world.size, world.local_rank, world.main) == (3, 4, 1, False)
    assert World.from_env({}) == World() and not World().sharded


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_two_ranks_update_like_one(model_dir: Path, tmp_path: Path, checkpointing: bool) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    single, single_metrics = one_update(model_dir, World())
    expected = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    single.save_weights(tmp_path / "single-weights")

    # Recomputing activations in the backward pass changes memory, not the update either.
    options = ["--activation-checkpointing"] if checkpointing else []
    reports = run_world(model_dir, tmp_path, WORLD_SIZE, *options)
    sharded = torch.load(tmp_path / "params.pt")

    # The update did something, and the same thing at both world sizes.
    assert sharded.keys() == expected.keys()
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in expected)
    assert moved > 1e-5
    for key, value in expected.items():
        torch.testing.assert_close(sharded[key], value, rtol=1e-5, atol=2e-6, msg=key)
    # A per-rank normalisation (each rank dividing by its own token count) would be off by
    # far more: the ranks' shares hold different numbers of loss tokens.
    for key in ("train_loss", "train_ratio_mean", "train_grad_norm", "engine_logprob_gap"):
        for report in reports:
            metrics = report["metrics"]
            assert isinstance(metrics, dict)
            assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-7), key
    assert reports[0]["metrics"]["kept"] == single_metrics["kept"]  # type: ignore[index]

    # Each rank holds about half of every parameter.
    total = sum(p.numel() for p in single.model.parameters())
    for report in reports:
        assert report["total_numel"] == total
        assert report["reloaded"]  # the full state saved by rank 0 loads back into the shards
        assert abs(int(report["local_numel"]) - total / WORLD_SIZE) < 0.01 * total  # type: ignore[call-overload]

    # Rank 0 wrote the engines' weights folder from the gathered shards.
    assert load_file(tmp_path / "weights" / "model.safetensors").keys() == (
        load_file(tmp_path / "single-weights" / "model.safetensors").keys()
    )


@pytest.mark.slow
def test_gradients_are_reduced_once_per_optimizer_update(model_dir: Path, tmp_path: Path) -> None:
    """Sharded, FSDP2 reduce-scatters the gradients in the last micro-batch of each update
    only (each rank sums its micro-batches unsharded before it), and the parameters after the
    update are those of a reduction after every micro-batch; micro-batches by tokens too."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    run_ranks(WORLD_SIZE, str(model_dir), str(tmp_path), "--sync")
    units = 3  # FSDP2 units: the 2 decoder layers and the root, one reduce-scatter each
    for rank in range(WORLD_SIZE):
        report = json.loads((tmp_path / f"sync-rank-{rank}.json").read_text())
        every, once = report["per-micro-batch"], report["per-update"]
        assert every["optimizer_steps"] == once["optimizer_steps"] == 2
        assert every["passes"] == once["passes"] > every["optimizer_steps"]  # accumulation
        assert every["reduce_scatters"] == units * every["passes"]
        assert once["reduce_scatters"] == units * once["optimizer_steps"]
        tokens = report["per-update-by-tokens"]
        assert tokens["reduce_scatters"] == units * tokens["optimizer_steps"]
        assert once["loss"] == pytest.approx(every["loss"], rel=1e-5)
        assert tokens["loss"] == pytest.approx(every["loss"], rel=1e-5)
    reference = torch.load(tmp_path / "sync-per-micro-batch.pt")
    moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference)
    assert moved > 1e-5
    for way in SYNC_WAYS:
        params = torch.load(tmp_path / f"sync-{way}.pt")
        assert params.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=2e-6, msg=key)


@pytest.mark.slow
def test_each_rank_reads_only_its_own_rows(model_dir: Path, tmp_path: Path) -> None:
    """Sharded, no rank reads a whole tensor (only its rows of each, one tensor at a time),
    and together the ranks read the model once."""
    run_ranks(WORLD_SIZE, str(model_dir), str(tmp_path), "--load")
    reports = [json.loads((tmp_path / f"load-rank-{r}.json").read_text()) for r in range(2)]
    wholes = {key: whole for report in reports for key, _, whole in report["reads"]}
    together = dict.fromkeys(wholes, 0)
    for report in reports:
        assert sorted(key for key, _, _ in report["reads"]) == sorted(wholes)  # one read each
        for key, read, whole in report["reads"]:
            assert read < whole, key
            together[key] += read
        assert sum(read for _, read, _ in report["reads"]) == report["local_numel"]
    assert together == wholes
