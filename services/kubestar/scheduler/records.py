"""The scheduler's two records: a `Turn`, from Generate until its response, and an `Engine`,
with its state as the policies see it, its client and the turns running on it. Plain data:
the modules that act on them (`scheduler`, `engines`, `weights`, `proto`) import them from
here, and none of them from each other for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kubestar.engine.client import Completion, EngineClient
from kubestar.scheduler.core import EngineState, TurnRequest
from kubestar.v1 import rollout_pb2 as pb

# A finished part of a turn: its token ids, text and (when asked for) logprobs.
SegmentCallback = Callable[[list[int], str, list[float]], None]


@dataclass(eq=False)
class Turn:
    """One turn of a trajectory, from Generate until its response: queued, or running on an
    engine (a whole turn, or one of its segments)."""

    # The whole turn (prompt + every new token it may generate).
    whole: TurnRequest
    # What the policy admits next: the whole turn, or its next segment.
    request: TurnRequest
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    future: asyncio.Future[pb.GenerateResponse]
    arrived: float
    queued_since: float
    queue_seconds: float = 0.0
    generate_seconds: float = 0.0
    attempts: int = 0
    reserved: int = 0
    task: asyncio.Task[None] | None = None
    # Set before cancelling the turn's task when its engine failed (an attempt spent).
    retry_on_cancel: bool = False
    # Set before cancelling the turn's task to restart its segment on another engine: an
    # idle one, or any when its own was removed (no attempt spent).
    moving: bool = False
    # Engines removed while it ran on them: moves past `max_attempts` spend attempts.
    removals: int = 0
    # When its current admission was sent (monotonic seconds).
    sent_at: float = 0.0
    # What the segments done so far generated.
    segments: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    # Called with each finished segment's tokens, text and logprobs (streaming callers).
    on_segment: SegmentCallback | None = None
    # A turn of n > 1 samples: its n completions, once generated (it runs whole).
    completions: list[Completion] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.whole.max_new_tokens - len(self.token_ids)


@dataclass(eq=False)
class Engine:
    """One engine: its state as the policies see it, its client, and the turns running on it."""

    state: EngineState
    client: EngineClient
    turns: set[Turn] = field(default_factory=set)
    watcher: asyncio.Task[None] | None = None
    first_probe: asyncio.Event = field(default_factory=asyncio.Event)
    # Blocks released by finished turns, ever (to tell which a scrape may not show yet).
    released_total: int = 0
    failures: int = 0
    # When the engine last answered a scrape (monotonic seconds).
    last_answer: float = field(default_factory=time.monotonic)
    # The weights (version, path) it loaded through the scheduler; None: its own, from its
    # start. Not the version alone: the SFT weights are version 0, as an engine's own are.
    weights: tuple[int, str] | None = None
