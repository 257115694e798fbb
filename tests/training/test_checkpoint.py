"""Sharded checkpoints and the bucketed weight push, with real gloo worlds of two processes.

A run checkpointed by 2 ranks resumes on 2 or on 1 and takes the same next steps as the run
that never stopped; the engines' folder, written bucket by bucket, loads in transformers and in
vLLM and holds the trained weights in bf16; an interrupted save is never resumed from.
The vLLM test shares the module's engine (tests/training/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers", "safetensors")

import torch  # noqa: E402
from kubestar.engine.launch import EngineProcess  # noqa: E402
from kubestar.training import checkpoint  # noqa: E402
from kubestar.training.checkpoint import RunState  # noqa: E402
from kubestar.training.distributed import World  # noqa: E402
from kubestar.training.weights import INDEX_FILE, SINGLE_FILE, plan_buckets  # noqa: E402

from tests.training.distributed_update import (  # noqa: E402
    GATHERED,
    SMALL_BUCKET_BYTES,
    new_policy,
    next_steps,
    run_ranks,
    sft_batch,
)

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)  # 3.3M parameters, SmolLM2's tokenizer, tied embeddings


@pytest.fixture(scope="module")
def saved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world of 2: one step, the engines' folder in small buckets, a checkpoint, the next
    steps (the run that did not stop)."""
    out = tmp_path_factory.mktemp("world-2")
    run_ranks(WORLD_SIZE, str(model_dir), str(out), "--checkpoint", "save")
    return out


def losses(out: Path, name: str, size: int) -> list[dict[str, float]]:
    return [json.loads((out / f"{name}-rank-{rank}.json").read_text()) for rank in range(size)]


def assert_same_parameters(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=2e-6, msg=key)


def test_buckets_hold_at_most_the_bucket_size_or_one_larger_tensor() -> None:
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([3, 20, 3, 3], 8) == [[0], [1], [2, 3]]
    assert plan_buckets([5], 1 << 30) == [[0]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1], 0)


@pytest.mark.slow
def test_a_bucket_is_gathered_whole_from_uneven_row_shards(model_dir: Path, tmp_path: Path) -> None:
    """One gather per bucket puts every tensor together from its ranks' rows, however
    unevenly they divide (a rank with none included), in bf16; other tensors come whole."""
    run_ranks(WORLD_SIZE, str(model_dir), str(tmp_path), "--gather")
    held = torch.load(tmp_path / "gathered.pt")
    assert list(held) == list(GATHERED)  # the bucket's order
    for key, value in GATHERED.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(held[key], expected), key


@pytest.mark.slow
def test_resume_at_world_size_2_and_1_takes_the_same_next_steps(
    saved: Path, model_dir: Path
) -> None:
    step = saved / "checkpoints" / "step-000001"
    assert checkpoint.latest(saved / "checkpoints") == step
    # Every rank wrote its own shards; nothing whole was written.
    shards = sorted(p.name for p in (step / "trainer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The checkpoint's weights are the step's pushed folder, linked, not gathered again.
    for file in (saved / "weights").iterdir():
        assert (step / "weights" / file.name).stat().st_ino == file.stat().st_ino

    continued = torch.load(saved / "continued.pt")
    expected = losses(saved, "continued", WORLD_SIZE)[0]
    trained = torch.load(saved / "trained.pt")
    assert max(float((continued[k] - trained[k]).abs().max()) for k in trained) > 1e-5

    # World size 2 again: a fresh world loads its shards from the checkpoint.
    run_ranks(WORLD_SIZE, str(model_dir), str(saved), "--checkpoint", "resume")
    for report in losses(saved, "resumed-2", WORLD_SIZE):
        assert report == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert_same_parameters(torch.load(saved / "resumed-2.pt"), continued)

    # World size 1 (this process, no process group): the 2 ranks' shards resharded into one.
    policy, trainer = new_policy(model_dir, World())
    state = checkpoint.load(step, policy)
    assert state.global_step == 1
    trainer.rng.setstate(state.rng_state)
    assert next_steps(policy, trainer) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert_same_parameters(dict(policy.model.state_dict()), continued)

    # The optimizer's moments came back too: without them the same steps land elsewhere.
    policy, trainer = new_policy(model_dir, World())
    trainer.rng.setstate(checkpoint.load(step, policy).rng_state)
    policy.reset_optimizer()
    next_steps(policy, trainer)
    moved = policy.model.state_dict()
    assert max(float((moved[k] - continued[k]).abs().max()) for k in continued) > 1e-4


@pytest.mark.slow
def test_bucketed_folder_loads_with_transformers_and_holds_the_trained_weights(
    saved: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    folder = saved / "weights"
    written = json.loads((saved / "weights-written.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and sorted(written["files"]) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((folder / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == written["total_bytes"] == sum(written["bucket_bytes"])
    # What rank 0 held at once: one bucket, or one tensor larger than a bucket on its own.
    largest = written["largest_tensor_bytes"]
    assert largest > SMALL_BUCKET_BYTES  # the embedding
    for held in written["bucket_bytes"]:
        assert held <= max(SMALL_BUCKET_BYTES, largest) <= SMALL_BUCKET_BYTES + largest
    assert sum(held > SMALL_BUCKET_BYTES for held in written["bucket_bytes"]) == 1
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (folder / name).exists(), name
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    loaded = model.state_dict()
    trained = torch.load(saved / "trained.pt")
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value.to(torch.bfloat16)), key
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as HF saves it


def test_bucket_size_changes_the_files_not_the_weights(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    policy, _ = new_policy(model_dir, World())
    whole = policy.save_weights(tmp_path / "whole")
    assert policy.last_weights is not None and policy.last_weights.files == [SINGLE_FILE]
    assert not (whole / INDEX_FILE).exists()
    split = policy.save_weights(tmp_path / "split", bucket_bytes=SMALL_BUCKET_BYTES)
    assert len(policy.last_weights.files) > 2
    tensors: dict[str, torch.Tensor] = {}
    for name in policy.last_weights.files:
        tensors.update(load_file(split / name))
    single = load_file(whole / SINGLE_FILE)
    assert tensors.keys() == single.keys()
    assert all(torch.equal(tensors[k], single[k]) for k in single)
    assert not list(tmp_path.glob("*.tmp-*"))  # renamed into place


def test_interrupted_save_is_never_resumed_and_keep_prunes(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "checkpoints"
    policy, _ = new_policy(model_dir, World())
    for step in (1, 2, 3):
        checkpoint.save(directory, policy, RunState(global_step=step), keep=2)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000003"]

    # A save that fails after the weights, before the trainer state, removes its folder.
    def fail(*_: object) -> None:
        raise OSError("cannot write")

    monkeypatch.setattr(checkpoint, "_save_sharded", fail)
    with pytest.raises(checkpoint.CheckpointError, match=r"step-000004 failed on rank 0: .*cannot"):
        checkpoint.save(directory, policy, RunState(global_step=4), keep=2)
    monkeypatch.undo()
    assert not list(directory.glob(".tmp-*"))
    # One whose process died (killed, or the node lost) leaves its folder behind.
    (directory / ".tmp-step-000004-99999" / "weights").mkdir(parents=True)
    # A step folder without its state.json (copied by hand, say) is not complete either.
    (directory / "step-000005").mkdir()
    assert checkpoint.latest(directory) == directory / "step-000003"

    checkpoint.save(directory, policy, RunState(global_step=6), keep=2)
    assert checkpoint.latest(directory) == directory / "step-000006"
    # The unfinished save is gone; of the complete checkpoints the newest 2 are kept.
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["step-000003", "step-000005", "step-000006"]


def test_a_checkpoint_of_the_old_single_file_format_is_refused_by_name(
    model_dir: Path, tmp_path: Path
) -> None:
    old = tmp_path / "step-000002"
    old.mkdir()
    (old / "trainer.pt").write_bytes(b"")
    (old / "state.json").write_text(RunState(global_step=2).to_json())
    policy, _ = new_policy(model_dir, World())
    with pytest.raises(FileNotFoundError, match=r"trainer/\.metadata.*--fresh"):
        checkpoint.load(old, policy)


@pytest.mark.slow
async def test_vllm_loads_a_bucketed_folder_as_it_loads_one_file(
    engine: EngineProcess, model: Path, tmp_path: Path
) -> None:
    """The engine reloads the same weights from several files as from one (and they are not
    the weights it started with): no shard was skipped."""
    from kubestar.engine.client import EngineClient

    policy, _ = new_policy(model, World())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std())
    split = policy.save_weights(tmp_path / "split", bucket_bytes=1 << 20)
    assert policy.last_weights is not None and len(policy.last_weights.files) > 2
    whole = policy.save_weights(tmp_path / "whole")

    client = EngineClient(engine.url)
    prompt = list(range(100, 140))

    async def greedy(folder: Path) -> list[int]:
        await client.load_weights(str(folder))
        return (await client.complete(prompt, max_tokens=24, temperature=0.0)).token_ids

    try:
        from_split = await greedy(split)
        original = await greedy(model)
        from_whole = await greedy(whole)
    finally:
        await client.close()
    assert from_split == from_whole
    assert from_split != original


def test_a_checkpoint_of_an_optimizer_that_never_stepped_loads(
    model_dir: Path, tmp_path: Path
) -> None:
    """SFT, then the RL optimizer's reset, then a checkpoint before any RL update (every group
    answered alike): a restarted trainer loads it. (It used to fail: the SFT step's leftover
    gradients kept torch from making the optimizer's state at save, a fresh one made it at
    load, and the keys did not match.)"""
    policy, _ = new_policy(model_dir, World())
    policy.sft_step(sft_batch())
    policy.reset_optimizer(1e-6)
    path = checkpoint.save(tmp_path, policy, RunState(global_step=2), keep=2)
    fresh, _ = new_policy(model_dir, World())
    assert checkpoint.load(path, fresh).global_step == 2
    assert_same_parameters(
        dict(fresh.model.named_parameters()), dict(policy.model.named_parameters())
    )
