"""Checkpoints: sharded, written atomically; the newest complete one is what a restart resumes
from, at the same or a different world size.

    <dir>/step-000012/
        weights/                 Hugging Face folder (bf16, `kubestar.training.weights`): what
                                 engines and `kubestar eval` load
        trainer/                 fp32 weights + AdamW moments (torch.distributed.checkpoint):
            .metadata            every tensor's global shape and where each piece of it lies
            __0_0.distcp ...     one file per rank, each with that rank's shards
        state.json               where the run is: stage, step in stage, global step, RNG,
                                 filters; written last, it marks the checkpoint complete
    <dir>/.tmp-step-000012-PID/  a save in progress (or one that died): never resumed from

Every rank writes its own shards (nothing is gathered) into a temporary folder; once all have
finished (a barrier), rank 0 writes state.json and renames the folder to step-NNNNNN, then
prunes all but the newest `keep`. On load, torch.distributed.checkpoint reads the pieces each
rank's shards need, whatever the world size that wrote them: a run saved by 2 ranks resumes on
1 or on 4. At world size 1 the format is the same (one file). In a world over several
machines the checkpoint folder must be one shared file system (a ReadWriteMany volume).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubestar.training.distributed import barrier, broadcast
from kubestar.training.policy import Policy
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
TRAINER = "trainer"
STATE_FILE = "state.json"


@dataclass
class RunState:
    global_step: int = 0  # RL steps done, over all stages
    stage_index: int = 0
    stage_step: int = 0  # RL steps done in the current stage
    sft_done: bool = False
    # Per stage: the problem ids it trains on once its filter ran (kept across restarts).
    stage_problems: dict[str, list[str]] = field(default_factory=dict)
    rng_state: Any = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        state = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        if isinstance(state.rng_state, list):  # JSON turns random.getstate's tuples into lists
            version, internal, gauss = state.rng_state
            state.rng_state = (version, tuple(internal), gauss)
        return state


def save(
    directory: Path, policy: Policy, state: RunState, keep: int, weights: Path | None = None
) -> Path:
    """Write a checkpoint of `policy` and `state`; every rank calls it. `weights`: the engines'
    folder this step already wrote (rank 0's path), linked into the checkpoint instead of
    gathered again."""
    world = policy.world
    final = directory / f"{PREFIX}{state.global_step:06d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if world.main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = broadcast(tmp, world)  # rank 0's process id names the folder
    if weights is None:
        policy.save_weights(tmp / "weights")  # collective
    elif world.main:
        _link_folder(weights, tmp / "weights")
    _save_sharded(policy, tmp / TRAINER)
    barrier(world)  # every rank's shards are on disk
    if world.main:
        (tmp / STATE_FILE).write_text(state.to_json())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # the checkpoint exists only once it is complete
        _prune(directory, keep)
    barrier(world)
    return final


def latest(directory: Path) -> Path | None:
    """The newest complete checkpoint (a step-NNNNNN folder with its state.json), or None."""
    complete = _complete(directory)
    return complete[-1] if complete else None


def load(path: Path, policy: Policy) -> RunState:
    """Load a checkpoint into `policy` (collective; every rank reads the pieces of its own
    shards) and return the run's state."""
    main = policy.world.main
    sharded = (path / TRAINER / ".metadata").exists() if main else None
    if not broadcast(sharded, policy.world):
        found = sorted(p.name for p in path.iterdir()) if main else []
        raise FileNotFoundError(
            f"{path} has no sharded trainer state ({TRAINER}/.metadata; found {found}): it was "
            "written by an older kubestar; start the run again with --fresh"
        )
    state = policy.state()  # this rank's shards, of the current world's shapes
    with _single_process_quiet():
        dcp_load(state, checkpoint_id=path / TRAINER, no_dist=not policy.world.sharded)
    policy.load_state(state)
    run = RunState.from_json((path / STATE_FILE).read_text()) if main else None
    return broadcast(run, policy.world) or RunState()


def _save_sharded(policy: Policy, folder: Path) -> None:
    with _single_process_quiet():
        dcp_save(policy.state(), checkpoint_id=folder, no_dist=not policy.world.sharded)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """World size 1 needs no process group; DCP warns that it assumes so every time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _link_folder(source: Path, target: Path) -> None:
    """Hard links to the files of `source` (written once, never changed), copies where the
    two lie on different file systems."""
    target.mkdir()
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:
            shutil.copy2(file, target / file.name)


def _complete(directory: Path) -> list[Path]:
    return [p for p in sorted(directory.glob(f"{PREFIX}*")) if (p / STATE_FILE).exists()]


def _prune(directory: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and saves that never
    finished."""
    for old in _complete(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for unfinished in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(unfinished, ignore_errors=True)
