"""Checkpoints that survive what a week-long run meets: every file fsynced before the folder
is renamed into place, a manifest of sizes and sha256 that a restart checks (a damaged
checkpoint is set aside, named, and the one before it resumes, on every rank alike; one
written before manifests still loads), and a full volume that fails the run with its own
reason, the partial checkpoint removed, every rank leaving the save together.

Real tiny models, real gloo worlds of two processes, and a real full file system: a 2 MiB
tmpfs mounted in a private mount namespace (`unshare -m`, as root), never on the host's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_parts import REPO, missing, require_modules, tiny_model

require_modules("torch", "transformers", "safetensors")

import torch  # noqa: E402
from kubestar.api.conditions import Reason  # noqa: E402
from kubestar.api.trainer_contract import EXIT_FINAL_FAILURE  # noqa: E402
from kubestar.training import checkpoint  # noqa: E402
from kubestar.training.checkpoint import RunState  # noqa: E402
from kubestar.training.distributed import World  # noqa: E402
from kubestar.training.policy import Policy  # noqa: E402

from tests.training.distributed_update import (  # noqa: E402
    flip_byte,
    new_policy,
    run_ranks,
    trajectories,
)

SHARD = "trainer/__0_0.distcp"
TINY_VOLUME = "2m"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)  # 3.3M parameters: a checkpoint of about 50 MB


def parameters(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


@pytest.fixture(scope="module")
def two_checkpoints(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Checkpoints of steps 1 and 2 (each a different update), and the parameters at step 1."""
    directory = tmp_path_factory.mktemp("pristine") / "checkpoints"
    policy, trainer = new_policy(model_dir, World())
    trainer.update(trajectories(seed=1))
    first = parameters(policy)
    state = RunState(global_step=1, rng_state=trainer.rng.getstate())
    checkpoint.save(directory, policy, state, keep=3)
    trainer.update(trajectories(seed=2))
    checkpoint.save(directory, policy, RunState(global_step=2), keep=3)
    return directory, first


def test_every_file_and_folder_of_a_checkpoint_is_fsynced(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards, the weights (linked from the folder the engines got), state.json and the
    manifest, each folder, and the parent that holds the rename."""
    policy, _ = new_policy(model_dir, World())
    pushed = policy.save_weights(tmp_path / "pushed")
    directory = tmp_path / "checkpoints"
    synced: list[Path] = []
    fsync = os.fsync

    def counting(descriptor: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", counting)
    final = checkpoint.save(directory, policy, RunState(global_step=1), keep=1, weights=pushed)
    monkeypatch.undo()

    def inside(path: Path) -> str:
        """The path in the checkpoint, whether it was synced before or after the rename."""
        if path == directory:
            return "PARENT"
        first, *rest = path.relative_to(directory).parts
        assert first == final.name or first.startswith(f".tmp-{final.name}-"), path
        return Path(*rest).as_posix() if rest else "."

    done = {inside(path) for path in synced}
    files = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    assert {SHARD, "trainer/.metadata", "weights/model.safetensors"} <= files
    assert {"state.json", "manifest.json"} <= files
    folders = {".", "trainer", "weights", "PARENT"}
    assert files | folders <= done, sorted(files | folders - done)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("flip", "sha256"),
        ("truncate", "bytes, the manifest says"),
        ("missing", "missing"),
        ("extra", "not in the manifest"),
    ],
)
def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_resumes(
    two_checkpoints: tuple[Path, dict[str, torch.Tensor]],
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
    words: str,
) -> None:
    pristine, first = two_checkpoints
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    newest = directory / "step-000002"
    shard = newest / SHARD
    if damage == "flip":
        flip_byte(shard)
    elif damage == "truncate":
        with shard.open("r+b") as handle:
            handle.truncate(shard.stat().st_size - 4096)
    elif damage == "missing":
        shard.unlink()
    else:  # a shard no rank of this save wrote
        shutil.copy(shard, newest / "trainer" / "__1_0.distcp")
    damaged = SHARD if damage != "extra" else "trainer/__1_0.distcp"

    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        good = checkpoint.newest_good(directory)
    assert good == directory / "step-000001"
    # Moved aside under a name no restart resumes from, never deleted.
    assert sorted(p.name for p in directory.iterdir()) == [".bad-step-000002", "step-000001"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "step-000002 is bad" in line and damaged in line and words in line
    assert ".bad-step-000002" in line

    policy, _ = new_policy(model_dir, World())
    state = checkpoint.load(good, policy)
    assert state.global_step == 1
    resumed = parameters(policy)
    assert resumed.keys() == first.keys()
    assert all(torch.equal(resumed[k], first[k]) for k in first)


def test_a_checkpoint_from_before_manifests_still_loads(
    two_checkpoints: tuple[Path, dict[str, torch.Tensor]],
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pristine, _ = two_checkpoints
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    for manifest in directory.glob(f"*/{checkpoint.MANIFEST_FILE}"):
        manifest.unlink()  # as an earlier kubestar wrote them

    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        good = checkpoint.newest_good(directory)
    assert good == directory / "step-000002"
    assert checkpoint.verify(good) == checkpoint.Verdict(verified=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "step-000002 has no manifest.json" in line and "unverified" in line
    policy, _ = new_policy(model_dir, World())
    assert checkpoint.load(good, policy).global_step == 2
    # Pruning counts it among the good ones (keep 2: it and the new one stay).
    checkpoint.save(directory, policy, RunState(global_step=3), keep=2)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000003"]


def test_pruning_never_drops_the_only_good_checkpoint(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep 1: a new checkpoint that fails its manifest by the time the old ones are pruned
    (its disk lost part of it) is set aside, and the one before stays."""
    directory = tmp_path / "checkpoints"
    policy, _ = new_policy(model_dir, World())
    checkpoint.save(directory, policy, RunState(global_step=1), keep=1)
    prune = checkpoint._prune

    def losing_data(folder: Path, keep: int) -> None:
        with (folder / "step-000002" / SHARD).open("r+b") as handle:
            handle.truncate(1000)
        prune(folder, keep)

    monkeypatch.setattr(checkpoint, "_prune", losing_data)
    checkpoint.save(directory, policy, RunState(global_step=2), keep=1)
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == [".bad-step-000002", "step-000001"]
    assert checkpoint.newest_good(directory) == directory / "step-000001"
    # Of good ones, `keep` stay.
    for step in (3, 4):
        checkpoint.save(directory, policy, RunState(global_step=step), keep=1)
    assert sorted(p.name for p in directory.iterdir()) == [".bad-step-000002", "step-000004"]


@pytest.mark.slow
def test_every_rank_skips_a_checkpoint_that_one_rank_finds_damaged(
    model_dir: Path, tmp_path: Path
) -> None:
    """World of 2: the ranks share the hashing; the damaged file is one rank 1 hashes, and
    both resume from step 1 with its parameters."""
    run_ranks(2, str(model_dir), str(tmp_path), "--checkpoint", "damaged")
    reports = [json.loads((tmp_path / f"damaged-rank-{r}.json").read_text()) for r in (0, 1)]
    assert reports == [{"checkpoint": "step-000001", "global_step": 1}] * 2
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [".bad-step-000002", "step-000001"]
    first = torch.load(tmp_path / "damaged.pt")
    resumed = torch.load(tmp_path / "resumed-damaged.pt")
    assert all(torch.equal(resumed[k], first[k]) for k in first)


def in_tiny_volume(
    volume: Path, command: list[str], **kwargs: object
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `command` with a 2 MiB tmpfs at `volume`, in a mount namespace of its own (the
    host's mounts are untouched; the tmpfs goes with the namespace): how it ended, and what
    was left in the volume afterwards."""
    volume.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        missing(f"cannot make a mount namespace (unshare -m, needs root): {probe.stderr.strip()}")
    listing = volume.with_name(volume.name + ".left")
    script = (
        f'mount -t tmpfs -o size={TINY_VOLUME} kubestar-test "$0" || exit 90; "$@"; code=$?; '
        f'ls -A "$0" > "{listing}"; exit $code'
    )
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(volume), *command],
        capture_output=True,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )
    assert done.returncode != 90, f"mounting the tmpfs failed: {done.stderr}"
    return done, listing.read_text().split()


@pytest.mark.slow
def test_a_full_volume_fails_every_rank_alike_and_removes_the_partial_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    """World of 2, checkpoint folder on a 2 MiB volume: rank 0 fails copying the weights in,
    both fail writing their shards; every rank raises the same CheckpointVolumeFull, nobody
    waits in a collective (the next one pairs up), and the volume is empty again."""
    volume = tmp_path / "volume"
    launch = (
        "import json, sys; from tests.training.distributed_update import start_ranks; "
        "print(json.dumps(start_ranks(2, *sys.argv[1:], timeout=240)))"
    )
    args = [str(model_dir), str(tmp_path), "--checkpoint", "full", str(volume)]
    done, left = in_tiny_volume(volume, [sys.executable, "-c", launch, *args], cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    for code, log in json.loads(done.stdout.splitlines()[-1]):
        assert code == 0, log[-3000:]
    reports = [json.loads((tmp_path / f"full-rank-{r}.json").read_text()) for r in (0, 1)]
    assert reports[0] == reports[1]
    report = reports[0]
    assert report["error"] == "CheckpointVolumeFull" and report["ranks_after"] == 2
    message = report["message"]
    assert message.startswith(f"checkpoint volume full: {volume}: writing step-000001 failed")
    assert "No space left on device" in message and "free of 2.0 MiB" in message
    assert "spec.checkpoint.keep, now 2" in message and "\n" not in message
    assert left == []  # no .tmp folder: the space came back


@pytest.mark.slow
def test_a_full_volume_fails_the_run_with_its_reason(tmp_path: Path) -> None:
    """`kubestar train` (sandbox, engine, scheduler, Ray, trainer: test_train_session's run)
    with spec.checkpoint.path on a 2 MiB volume: the first checkpoint fills it. The run
    ends Failed, reason CheckpointVolumeFull, the message names the folder; the exit code
    is the one that fails a cluster's Job without retrying; the volume is empty again."""
    from tests.training.test_train_session import rl_steps, train_command

    volume = tmp_path / "volume"
    command, env = train_command(tmp_path, steps=1)
    manifest = tmp_path / "run.yaml"
    # One step, checkpointed, and no evaluation: the subject is the volume.
    text = manifest.read_text().replace(
        "checkpoint: {everySteps: 2, keep: 5}",
        f"checkpoint: {{everySteps: 1, keep: 5, path: {volume}}}",
    )
    manifest.write_text(text.replace("at: [start, end]", "at: []"))
    done, left = in_tiny_volume(volume, command, env=env, timeout=900)
    assert done.returncode == EXIT_FINAL_FAILURE, done.stderr[-3000:]
    assert [m["step"] for m in rl_steps(tmp_path)] == [1]  # it failed saving step 1
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["phase"] == "Failed"
    (progressing,) = [c for c in status["conditions"] if c["type"] == "Progressing"]
    assert (progressing["status"], progressing["reason"]) == (
        "False",
        Reason.CHECKPOINT_VOLUME_FULL,
    )
    message = progressing["message"]
    assert message.startswith(f"checkpoint volume full: {volume}: writing step-000001 failed")
    assert "spec.checkpoint.keep, now 5" in message
    assert f"kubestar: {message}" in done.stderr  # said once, in one line
    assert left == []  # no .tmp folder: the space came back
