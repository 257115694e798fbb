"""The async rollout scheduler: a queue of trajectory turns in front of a fleet of vLLM engines.

Each turn waits in one FIFO queue until the policy (`kubestar.scheduler.core`) finds it an
engine; it then holds a reservation of prompt + max new tokens on that engine until it
finishes. Under kv-aware a turn longer than `segment_tokens` runs in segments: each reserves
only its own context + new tokens, and the next one is queued ahead of new turns (same engine
while it has room). Segments are invisible to callers: one turn, one response. An engine
left idle takes over a segment that a much slower engine would still need long for (a move).

A turn may ask for n samples (vLLM's n, how a search draws a node's children): one request to
one engine, which prefills the prompt once and samples n continuations; it is admitted whole,
reserving the prompt and all n continuations (`core.EngineState.need`), and answered with n
completions. Its trajectory id (a search uses one per tree) keeps it on the engine that holds
the prefix, like a trajectory's turns.

Failures: a turn whose engine cannot be reached (connection refused or reset, HTTP 5xx,
timeout) takes that engine out, and every turn in flight there is sent again elsewhere. A
turn fails only when no engine is left (or after `max_attempts` engines failed under it); an
HTTP 4xx is the turn's own fault and is returned as is, without a retry.

The rest of the scheduler lives beside this module: the turn and engine records in `records`,
the engines, their health and prefix affinity in `engines`, weight updates in `weights`, the
answers as protobuf messages in `proto`, settings in `config` and errors in `errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace

from kubestar.engine.client import Completion, EngineError
from kubestar.scheduler import proto
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import (
    KV_AWARE,
    POLICIES,
    EngineState,
    RunningSegment,
    TurnRequest,
    check_fits,
    find_split_stop,
    plan_admissions,
    record_decode,
    release,
    segment_new_tokens,
    segment_to_move,
    tokens_through,
)
from kubestar.scheduler.engines import Engines
from kubestar.scheduler.errors import (
    NoEngineAvailable,
    SchedulerDraining,
    SchedulerError,
    TurnRejected,
)
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.scheduler.records import Engine, SegmentCallback, Turn
from kubestar.scheduler.weights import WeightUpdates
from kubestar.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)


class Scheduler:
    """Admits turns to engines by policy; see the module docstring.

    `on_availability(bool)` is called when "at least one engine takes turns" changes (the
    server reports it as its health).
    """

    def __init__(
        self,
        engines: Iterable[tuple[str, str]] = (),
        config: SchedulerConfig | None = None,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.policy_name = self.config.policy
        self.policy = POLICIES[self.config.policy]
        # Only kv-aware reserves room, so only it gains from segments.
        self.segment_tokens = self.config.segment_tokens if self.policy_name == KV_AWARE else 0
        self.metrics = metrics or SchedulerMetrics()
        self._weights = WeightUpdates(self.metrics, self.config.weights_reload_timeout)
        self._engines = Engines(
            self.config,
            self.metrics,
            self._weights,
            on_probed=self._dispatch,
            on_health_change=self._update_availability,
        )
        self.metrics.watch_engines(self._engines.states)
        self.on_availability: Callable[[bool], None] | None = None
        self._initial = list(engines)
        self._queue: deque[Turn] = deque()
        self._seq = itertools.count()
        self._turn_done = asyncio.Event()
        self._paused = False
        self._draining = False
        self._available: bool | None = None
        self.admitted_total = 0
        self.retried_total = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching the initial engines; wait (bounded) for their first probe."""
        for name, url in self._initial:
            self._engines.add(name, url)
        await self._engines.wait_first_probes(list(self._engines.by_name.values()))
        self._update_availability()

    async def drain(self, timeout: float) -> None:
        """Take no new turns; wait up to `timeout` seconds for queued and running ones."""
        self._draining = True
        self._update_availability()
        deadline = time.monotonic() + timeout
        while (self._queue or self._engines.in_flight()) and time.monotonic() < deadline:
            self._turn_done.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._turn_done.wait()

    async def stop(self) -> None:
        """Fail whatever is left, stop watching and close the engine connections."""
        self._draining = True
        self._update_availability()
        while self._queue:
            self._fail(self._queue.popleft(), SchedulerDraining("the scheduler stopped"))
        await self._engines.remove_all()

    # ---- turns -----------------------------------------------------------------------------

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: pb.SamplingParams | None = None,
        on_segment: SegmentCallback | None = None,
        n: int = 1,
    ) -> pb.GenerateResponse:
        """Run one turn, or draw `n` samples of it from one prefill; `on_segment` sees each
        part of a one-sample turn as it is done (a segment of SchedulerConfig.segment_tokens,
        or the whole turn)."""
        if self._draining:
            raise SchedulerDraining("the scheduler is shutting down")
        if not prompt_token_ids:
            raise TurnRejected("prompt_token_ids is empty")
        if max_new_tokens <= 0:
            raise TurnRejected("max_new_tokens must be at least 1")
        if n < 1:
            raise TurnRejected("n must be at least 1")
        if n > 1 and on_segment is not None:
            raise TurnRejected("a turn of n > 1 samples is answered whole, not in parts")
        now = time.monotonic()
        whole = TurnRequest(
            trajectory_id=trajectory_id,
            prompt_tokens=len(prompt_token_ids),
            max_new_tokens=max_new_tokens,
            seq=next(self._seq),
            enqueued_at=now,
            samples=n,
        )
        if not self._engines.alive():
            self.metrics.failed.labels("no-engine").inc()
            raise NoEngineAvailable(self._engines.no_engine_message())
        try:
            check_fits(self._engines.states(), whole)
        except ValueError:
            self.metrics.failed.labels("too-large").inc()
            raise
        turn = Turn(
            whole=whole,
            # n samples run whole (core's module docstring says why).
            request=whole
            if n > 1
            else replace(
                whole, max_new_tokens=self._segment(max_new_tokens, len(prompt_token_ids))
            ),
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling if sampling is not None else pb.SamplingParams(),
            future=asyncio.get_running_loop().create_future(),
            arrived=now,
            queued_since=now,
            on_segment=on_segment,
        )
        self._queue.append(turn)
        self._dispatch()
        if turn.task is None and not turn.future.done():
            self.metrics.queued.inc()
        try:
            return await turn.future
        except asyncio.CancelledError:
            self._abandon(turn)
            raise

    def end_trajectory(self, trajectory_id: str) -> None:
        self._engines.forget(trajectory_id)

    def _abandon(self, turn: Turn) -> None:
        """The caller went away: forget the turn, stop its generation."""
        with contextlib.suppress(ValueError):
            self._queue.remove(turn)
        if turn.task is not None:
            turn.retry_on_cancel = turn.moving = False
            turn.task.cancel()
        self.metrics.queue_length.set(len(self._queue))

    def _dispatch(self) -> None:
        """Send every queued turn the policy finds room for (synchronous: no awaits)."""
        try:
            if not self._queue:
                return
            if not self._engines.alive():
                message = self._engines.no_engine_message()
                while self._queue:
                    self._fail(self._queue.popleft(), NoEngineAvailable(message), "no-engine")
                return
            if self._engines.capacity_changed:
                self._engines.capacity_changed = False
                self._fail_unfit()
            # While weights are being replaced only turns already under way go on (their
            # next segments), so that no turn mixes two versions of the weights.
            candidates = [t for t in self._queue if t.segments] if self._paused else self._queue
            if not candidates:
                return
            now = time.monotonic()
            plan = plan_admissions(
                [t.request for t in candidates],
                self._engines.states(),
                self.policy,
                now,
                self.config.starvation_seconds,
            )
            if not plan:
                return
            by_seq = {t.request.seq: t for t in self._queue}
            sent = {request.seq for request, _ in plan}
            self._queue = deque(t for t in self._queue if t.request.seq not in sent)
            for request, state in plan:
                self._start(by_seq[request.seq], self._engines.by_name[state.name], now)
        finally:
            self.metrics.queue_length.set(len(self._queue))

    def _fail_unfit(self) -> None:
        states = self._engines.states()
        keep: deque[Turn] = deque()
        for turn in self._queue:
            try:
                check_fits(states, turn.whole)
            except ValueError as error:
                self._fail(turn, error, "too-large")
            else:
                keep.append(turn)
        self._queue = keep

    def _start(self, turn: Turn, engine: Engine, now: float) -> None:
        turn.reserved = engine.state.need(turn.request)
        turn.attempts = max(turn.attempts, 1)
        turn.queue_seconds += now - turn.queued_since
        self._engines.remember(turn.request.trajectory_id, engine)
        engine.turns.add(turn)
        self.admitted_total += 1
        self.metrics.admitted.labels(engine.state.name).inc()
        turn.task = asyncio.create_task(
            self._run(turn, engine), name=f"turn {turn.request.seq} on {engine.state.name}"
        )

    async def _run(self, turn: Turn, engine: Engine) -> None:
        sampling = turn.sampling
        context = turn.prompt_token_ids + turn.token_ids if turn.segments else turn.prompt_token_ids
        started = turn.sent_at = time.monotonic()
        try:
            completions = await engine.client.sample(
                context,
                turn.request.max_new_tokens,
                turn.request.samples,
                temperature=sampling.temperature,
                top_p=sampling.top_p or 1.0,
                top_k=sampling.top_k,
                stop=list(sampling.stop) or None,
                # A seeded turn stays reproducible; each segment draws its own stream.
                seed=(sampling.seed + turn.segments) if sampling.seed else None,
                # Token offsets find a stop string split across segments.
                logprobs=sampling.logprobs or bool(turn.segments and sampling.stop),
            )
        except asyncio.CancelledError:
            self._finish(turn, engine, 0)
            moving, turn.moving = turn.moving, False
            if moving and not self._draining and not turn.future.done():
                if turn.removals > self.config.max_attempts:
                    # Its engines keep leaving under it (a turn that crashes each engine it
                    # meets, when discovery sees the crash first): no longer free.
                    removed = f"engine {engine.state.name} was removed under it"
                    self._requeue(turn, f"{removed} ({turn.removals} engines so far)")
                else:
                    # To another engine: first in the queue, not a failed attempt.
                    turn.queued_since = time.monotonic()
                    self._queue.appendleft(turn)
                    self.metrics.moved.inc()
                self._dispatch()
                return
            if turn.retry_on_cancel:
                turn.retry_on_cancel = False
                self._requeue(turn, f"engine {engine.state.name} was taken out")
                self._dispatch()
                return
            message = "the scheduler stopped" if self._draining else "the turn was cancelled"
            self._fail(turn, SchedulerDraining(message), "cancelled")
            self._dispatch()
            raise
        except EngineError as error:
            self._finish(turn, engine, 0)
            if error.rejected:
                self._fail(
                    turn,
                    TurnRejected(f"engine {engine.state.name} refused it: {error}"),
                    "rejected",
                )
            else:
                self._engines.failed(engine, error)
                self._requeue(turn, f"engine {engine.state.name} failed: {error}")
            self._dispatch()
            return
        except Exception as error:  # a bug or an answer we cannot read: fail this turn only
            log.exception("turn failed", extra={"fields": {"engine": engine.state.name}})
            self._finish(turn, engine, 0)
            self._fail(turn, SchedulerError(f"engine {engine.state.name}: {error!r}"), "internal")
            self._dispatch()
            return
        now = time.monotonic()
        turn.generate_seconds += now - started
        generated = [len(completion.token_ids) for completion in completions]
        record_decode(engine.state, max(generated), now - started)
        self._finish(turn, engine, len(context) + sum(generated))
        if turn.request.samples > 1:
            turn.completions = completions
            finish_reason, stop_reason = completions[0].finish_reason, completions[0].stop_reason
        else:
            finish_reason, stop_reason = self._take_segment(turn, completions[0])
        if (
            finish_reason == "length"
            and turn.request.samples == 1
            and turn.remaining > 0
            and not turn.future.done()
        ):
            # Only a segment ended: the rest of the turn goes first in the queue.
            context_tokens = turn.whole.prompt_tokens + len(turn.token_ids)
            turn.request = replace(
                turn.whole,
                prompt_tokens=context_tokens,
                max_new_tokens=self._segment(turn.remaining, context_tokens),
                enqueued_at=now,
            )
            turn.queued_since = now
            self._queue.appendleft(turn)
            self.metrics.segments.inc()
        elif not turn.future.done():
            turn.future.set_result(
                proto.generate_response(turn, engine.state, finish_reason, stop_reason)
            )
            self.metrics.completed.inc()
            self.metrics.queue_seconds.observe(turn.queue_seconds)
            self.metrics.generate_seconds.observe(turn.generate_seconds)
            self.metrics.turn_seconds.observe(now - turn.arrived)
        self._dispatch()
        self._move_to_idle_engine()

    def _move_to_idle_engine(self) -> None:
        """kv-aware: an engine left with nothing to do takes over a segment that a much slower
        engine would still need long for (see core.segment_to_move)."""
        if self.policy_name != KV_AWARE or not self.segment_tokens or self._paused:
            return
        now = time.monotonic()
        running = {
            id(segment): (turn, segment)
            for engine in self._engines.by_name.values()
            for turn in engine.turns
            if turn.task is not None and not turn.moving and not turn.retry_on_cancel
            for segment in [RunningSegment(turn.request, engine.state, now - turn.sent_at)]
        }
        choice = segment_to_move(
            self._engines.states(), [segment for _, segment in running.values()]
        )
        if choice is None:
            return
        segment, target = choice
        turn = running[id(segment)][0]
        assert turn.task is not None
        log.info(
            "segment moved to an idle engine",
            extra={
                "fields": {
                    "trajectory": turn.request.trajectory_id,
                    "from": segment.engine.name,
                    "to": target.name,
                    "elapsed_s": round(segment.elapsed_seconds, 3),
                }
            },
        )
        turn.moving = True
        turn.task.cancel()

    def _segment(self, remaining: int, context_tokens: int) -> int:
        """New tokens for a turn's next admission: all, or a segment ending on a block."""
        block_size = self._engines.largest_block_size()
        return segment_new_tokens(remaining, self.segment_tokens, context_tokens, block_size)

    def _take_segment(self, turn: Turn, completion: Completion) -> tuple[str, str]:
        """Append a segment's output to the turn; returns its finish and stop reasons."""
        token_ids, text, logprobs = completion.token_ids, completion.text, completion.logprobs
        finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
        split = find_split_stop(turn.text, text, turn.sampling.stop) if turn.segments else None
        # It counts if it ends no later than where the engine stopped (its own stop string or
        # the end of sequence may come first).
        if split is not None and split[0] <= len(text):
            characters, stop_reason = split
            finish_reason = "stop"
            if len(completion.text_offsets) == len(token_ids):
                keep = tokens_through(completion.text_offsets, characters)
                token_ids, text, logprobs = token_ids[:keep], text[:characters], logprobs[:keep]
            else:  # an engine without offsets: keep what came after, but end the turn
                log.warning("no token offsets to cut a split stop string at")
        turn.segments += 1
        turn.token_ids += token_ids
        turn.text += text
        if turn.sampling.logprobs:
            turn.logprobs += logprobs
        if turn.on_segment is not None:
            turn.on_segment(list(token_ids), text, list(logprobs) if turn.sampling.logprobs else [])
        return finish_reason, stop_reason

    def _finish(self, turn: Turn, engine: Engine, used_tokens: int) -> None:
        """The turn left its engine: give back its reservation."""
        if turn not in engine.turns:
            return
        engine.turns.discard(turn)
        before = engine.state.released_since_sample
        release(engine.state, turn.reserved, used_tokens)
        engine.released_total += engine.state.released_since_sample - before
        turn.reserved = 0
        turn.task = None
        self._turn_done.set()

    def _requeue(self, turn: Turn, reason: str) -> None:
        if turn.future.done():
            return
        if turn.attempts >= self.config.max_attempts:
            self._fail(
                turn,
                NoEngineAvailable(f"the turn failed on {turn.attempts} engines; last: {reason}"),
                "attempts",
            )
            return
        turn.attempts += 1
        turn.queued_since = time.monotonic()
        self._queue.appendleft(turn)
        self.retried_total += 1
        self.metrics.retried.inc()
        log.info(
            "turn retried",
            extra={
                "fields": {
                    "trajectory": turn.request.trajectory_id,
                    "attempts": turn.attempts,
                    "reason": reason,
                }
            },
        )

    def _fail(self, turn: Turn, error: Exception, reason: str = "") -> None:
        if not turn.future.done():
            turn.future.set_exception(error)
            if reason:
                self.metrics.failed.labels(reason).inc()

    # ---- engines ---------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self._weights.version

    def engines(self) -> list[EngineState]:
        return self._engines.states()

    async def add_engine(self, name: str, url: str) -> None:
        """Add an engine (no-op if the name is known); waits (bounded) for its first probe."""
        if not name or not url:
            raise TurnRejected("an engine needs a name and a URL")
        if self._draining:
            raise SchedulerDraining("the scheduler is shutting down")
        if name in self._engines.by_name:
            return
        await self._engines.wait_first_probes([self._engines.add(name, url)])

    async def remove_engine(self, name: str) -> None:
        """Take an engine out now; its turns in flight move to the others."""
        await self._engines.remove(name)
        self._update_availability()
        self._dispatch()

    def available(self) -> bool:
        """Whether a turn sent now would be admitted by some engine (health checks)."""
        return bool(self._available)

    def _update_availability(self) -> None:
        available = not self._draining and bool(self._engines.admitting())
        if available != self._available:
            self._available = available
            if self.on_availability is not None:
                self.on_availability(available)

    # ---- weights and status ----------------------------------------------------------------

    async def update_weights(
        self, weights_path: str, version: int | None = None
    ) -> pb.UpdateWeightsResponse:
        """Stop admitting, let turns in flight finish, reload every engine, resume."""
        if not weights_path:
            raise TurnRejected("weights_path is empty")
        return await self._weights.update(weights_path, version, self._engines, self._quiesced)

    @contextlib.asynccontextmanager
    async def _quiesced(self) -> AsyncIterator[float]:
        """No turn is admitted while the block runs, and none is under way when it starts
        (the next segments of turns under way included); yields the seconds waited for them."""
        self._paused = True
        try:
            waited = time.monotonic()
            while self._engines.in_flight() or any(t.segments for t in self._queue):
                self._turn_done.clear()
                await self._turn_done.wait()
            yield time.monotonic() - waited
        finally:
            self._paused = False
            self._dispatch()

    def context_length(self) -> int:
        """The longest prompt + completion every engine that takes turns can hold (0 while
        none has said)."""
        limits = [e.max_model_len for e in self._engines.states() if e.healthy and e.max_model_len]
        return min(limits, default=0)

    def status(self) -> pb.GetSchedulerStatusResponse:
        return proto.status_response(
            self.policy_name,
            self._engines.states(),
            queued=len(self._queue),
            admitted=self.admitted_total,
            retried=self.retried_total,
            weights_version=self._weights.version,
            weights_path=self._weights.path,
        )
