"""Checkpoints: written atomically, the newest complete one is what a restart resumes from.

<dir>/step-000012/
    weights/      Hugging Face folder (bf16), what engines and `kubestar eval` load
    trainer.pt    fp32 weights + optimizer moments
    state.json    where the run is: stage, step in stage, global step, RNG, filters

A sharded trainer saves and loads collectively: every rank takes part in gathering (or
scattering) the full state, rank 0 alone reads and writes the files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from kubestar.training.distributed import barrier, broadcast
from kubestar.training.policy import Policy

PREFIX = "step-"


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


def save(directory: Path, policy: Policy, state: RunState, keep: int) -> Path:
    world = policy.world
    final = directory / f"{PREFIX}{state.global_step:06d}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    if world.main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = broadcast(tmp, world)  # rank 0's process id names the folder
    policy.save_weights(tmp / "weights")
    trainer_state = policy.state()
    if not world.main:
        barrier(world)
        return final
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "state.json").write_text(state.to_json())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # the checkpoint exists only once it is complete
    for old in sorted(directory.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    barrier(world)
    return final


def latest(directory: Path) -> Path | None:
    complete = [p for p in sorted(directory.glob(f"{PREFIX}*")) if (p / "state.json").exists()]
    return complete[-1] if complete else None


def load(path: Path, policy: Policy) -> RunState:
    main = policy.world.main
    policy.load_state(torch.load(path / "trainer.pt", weights_only=False) if main else {})
    state = RunState.from_json((path / "state.json").read_text()) if main else None
    return broadcast(state, policy.world) or RunState()
