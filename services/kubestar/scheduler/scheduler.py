"""The async rollout scheduler: a queue of trajectory turns in front of a fleet of vLLM engines.

Each turn waits in one FIFO queue until the policy (`kubestar.scheduler.core`) finds it an
engine; it then holds a reservation of prompt + max new tokens on that engine until it
finishes. Under kv-aware a turn longer than `segment_tokens` runs in segments: each reserves
only its own context + new tokens, and the next one is queued ahead of new turns (same engine
while it has room). Segments are invisible to callers: one turn, one response.

Every engine is scraped (/metrics) every `poll_interval` seconds; between scrapes the
scheduler's own bookkeeping (reservations, released blocks) keeps the picture current.

Failures: a turn whose engine cannot be reached (connection refused or reset, HTTP 5xx,
timeout) takes that engine out, and every turn in flight there is sent again elsewhere. An
engine is also taken out after `failure_threshold` failed scrapes in a row: at once when it
refuses connections, but only after `unresponsive_seconds` without an answer when its scrapes
merely time out (a busy machine makes a live engine slow, not dead). Engines out are
probed every `probe_interval` seconds and come back (with the current weights loaded) when
they answer. A turn fails only when no engine is left (or after `max_attempts` engines failed
under it); an HTTP 4xx is the turn's own fault and is returned as is, without a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kubestar.engine.client import Completion, EngineClient, EngineError
from kubestar.scheduler.core import (
    DEFAULT_STARVATION_SECONDS,
    KV_AWARE,
    LEAST_REQUESTS,
    POLICIES,
    ROUND_ROBIN,
    EngineState,
    RunningSegment,
    TurnRequest,
    apply_sample,
    check_fits,
    find_split_stop,
    parse_vllm_metrics,
    plan_admissions,
    record_decode,
    release,
    segment_new_tokens,
    segment_to_move,
    tokens_through,
)
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)

POLICY_TO_PROTO = {
    KV_AWARE: pb.SCHEDULING_POLICY_KV_AWARE,
    LEAST_REQUESTS: pb.SCHEDULING_POLICY_LEAST_REQUESTS,
    ROUND_ROBIN: pb.SCHEDULING_POLICY_ROUND_ROBIN,
}


class SchedulerError(RuntimeError):
    """A turn or a request to the scheduler could not be served."""


class NoEngineAvailable(SchedulerError):
    """No engine is left to run the turn (all failed or were removed)."""


class TurnRejected(SchedulerError):
    """The turn is invalid, or an engine refused it (HTTP 4xx): retrying would not help."""


class SchedulerDraining(SchedulerError):
    """The scheduler is shutting down and takes no new turns."""


class UnknownEngine(SchedulerError, KeyError):
    """No engine has that name."""


@dataclass
class SchedulerConfig:
    policy: str = KV_AWARE
    # Seconds between /metrics scrapes of a healthy engine, and between probes of a failed one.
    poll_interval: float = 0.2
    probe_interval: float = 1.0
    scrape_timeout: float = 5.0
    # Failed scrapes in a row that take an engine out (a failed turn does it at once).
    failure_threshold: int = 3
    # Scrapes that time out take an engine out only after this long without an answer.
    unresponsive_seconds: float = 30.0
    # The longest one turn may take on an engine.
    request_timeout: float = 3600.0
    # A turn fails after this many engines failed under it.
    max_attempts: int = 4
    starvation_seconds: float = DEFAULT_STARVATION_SECONDS
    # Trajectories whose engine is remembered (oldest forgotten first).
    affinity_limit: int = 100_000
    # How long start() and add_engine() wait for the first probe of an engine.
    startup_timeout: float = 10.0
    # kv-aware: the most new tokens one admission reserves room for; a longer turn runs in
    # segments of this size (0: the whole turn at once). Best a multiple of the block size.
    segment_tokens: int = 256

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.segment_tokens < 0:
            raise ValueError("segment_tokens must be 0 (whole turns) or more")


@dataclass(eq=False)
class _Turn:
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
    # Set before cancelling the turn's task when its engine failed or was removed.
    retry_on_cancel: bool = False
    # Set before cancelling the turn's task to restart its segment on an idle engine.
    moving: bool = False
    # When its current admission was sent (monotonic seconds).
    sent_at: float = 0.0
    # What the segments done so far generated.
    segments: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.whole.max_new_tokens - len(self.token_ids)


@dataclass(eq=False)
class _Engine:
    state: EngineState
    client: EngineClient
    turns: set[_Turn] = field(default_factory=set)
    watcher: asyncio.Task[None] | None = None
    first_probe: asyncio.Event = field(default_factory=asyncio.Event)
    # Blocks released by finished turns, ever (to tell which a scrape may not show yet).
    released_total: int = 0
    failures: int = 0
    # When the engine last answered a scrape (monotonic seconds).
    last_answer: float = field(default_factory=time.monotonic)


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
        self.metrics.watch_engines(lambda: [e.state for e in self._engines.values()])
        self.on_availability: Callable[[bool], None] | None = None
        self._initial = list(engines)
        self._engines: dict[str, _Engine] = {}
        self._queue: deque[_Turn] = deque()
        self._seq = itertools.count()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._weights_version = 0
        self._weights_path = ""
        self._weights_lock = asyncio.Lock()
        self._turn_done = asyncio.Event()
        self._paused = False
        self._draining = False
        self._recheck_fits = False
        self._available: bool | None = None
        self.admitted_total = 0
        self.retried_total = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching the initial engines; wait (bounded) for their first probe."""
        for name, url in self._initial:
            self._add(name, url)
        await self._wait_first_probes(list(self._engines.values()))
        self._update_availability()

    async def drain(self, timeout: float) -> None:
        """Take no new turns; wait up to `timeout` seconds for queued and running ones."""
        self._draining = True
        self._update_availability()
        deadline = time.monotonic() + timeout
        while (self._queue or self._in_flight()) and time.monotonic() < deadline:
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
        engines = list(self._engines.values())
        self._engines.clear()
        await asyncio.gather(*(self._close_engine(e, retry=False) for e in engines))

    # ---- turns -----------------------------------------------------------------------------

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: pb.SamplingParams | None = None,
    ) -> pb.GenerateResponse:
        if self._draining:
            raise SchedulerDraining("the scheduler is shutting down")
        if not prompt_token_ids:
            raise TurnRejected("prompt_token_ids is empty")
        if max_new_tokens <= 0:
            raise TurnRejected("max_new_tokens must be at least 1")
        now = time.monotonic()
        whole = TurnRequest(
            trajectory_id=trajectory_id,
            prompt_tokens=len(prompt_token_ids),
            max_new_tokens=max_new_tokens,
            seq=next(self._seq),
            enqueued_at=now,
        )
        if not self._alive():
            self.metrics.failed.labels("no-engine").inc()
            raise NoEngineAvailable(self._no_engine_message())
        try:
            check_fits(self._states(), whole)
        except ValueError:
            self.metrics.failed.labels("too-large").inc()
            raise
        turn = _Turn(
            whole=whole,
            request=replace(
                whole, max_new_tokens=self._segment(max_new_tokens, len(prompt_token_ids))
            ),
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling if sampling is not None else pb.SamplingParams(),
            future=asyncio.get_running_loop().create_future(),
            arrived=now,
            queued_since=now,
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
        name = self._affinity.pop(trajectory_id, None)
        if name is not None and name in self._engines:
            self._engines[name].state.trajectories.discard(trajectory_id)

    def _abandon(self, turn: _Turn) -> None:
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
            if not self._alive():
                message = self._no_engine_message()
                while self._queue:
                    self._fail(self._queue.popleft(), NoEngineAvailable(message), "no-engine")
                return
            if self._recheck_fits:
                self._recheck_fits = False
                self._fail_unfit()
            # While weights are being replaced only turns already under way go on (their
            # next segments), so that no turn mixes two versions of the weights.
            candidates = [t for t in self._queue if t.segments] if self._paused else self._queue
            if not candidates:
                return
            now = time.monotonic()
            plan = plan_admissions(
                [t.request for t in candidates],
                self._states(),
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
                self._start(by_seq[request.seq], self._engines[state.name], now)
        finally:
            self.metrics.queue_length.set(len(self._queue))

    def _fail_unfit(self) -> None:
        states = self._states()
        keep: deque[_Turn] = deque()
        for turn in self._queue:
            try:
                check_fits(states, turn.whole)
            except ValueError as error:
                self._fail(turn, error, "too-large")
            else:
                keep.append(turn)
        self._queue = keep

    def _start(self, turn: _Turn, engine: _Engine, now: float) -> None:
        turn.reserved = engine.state.need(turn.request)
        turn.attempts = max(turn.attempts, 1)
        turn.queue_seconds += now - turn.queued_since
        self._set_affinity(turn.request.trajectory_id, engine)
        engine.turns.add(turn)
        self.admitted_total += 1
        self.metrics.admitted.labels(engine.state.name).inc()
        turn.task = asyncio.create_task(
            self._run(turn, engine), name=f"turn {turn.request.seq} on {engine.state.name}"
        )

    async def _run(self, turn: _Turn, engine: _Engine) -> None:
        sampling = turn.sampling
        context = turn.prompt_token_ids + turn.token_ids if turn.segments else turn.prompt_token_ids
        started = turn.sent_at = time.monotonic()
        try:
            completion = await engine.client.complete(
                context,
                turn.request.max_new_tokens,
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
                # To an idle engine: first in the queue, not a failed attempt.
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
                self._engine_failed(engine, error)
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
        record_decode(engine.state, len(completion.token_ids), now - started)
        self._finish(turn, engine, len(context) + len(completion.token_ids))
        finish_reason, stop_reason = self._take_segment(turn, completion)
        if finish_reason == "length" and turn.remaining > 0 and not turn.future.done():
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
            turn.future.set_result(self._response(turn, engine, finish_reason, stop_reason))
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
            for engine in self._engines.values()
            for turn in engine.turns
            if turn.task is not None and not turn.moving and not turn.retry_on_cancel
            for segment in [RunningSegment(turn.request, engine.state, now - turn.sent_at)]
        }
        choice = segment_to_move(self._states(), [segment for _, segment in running.values()])
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
        block_size = max((e.state.block_size for e in self._engines.values()), default=0)
        return segment_new_tokens(remaining, self.segment_tokens, context_tokens, block_size)

    def _take_segment(self, turn: _Turn, completion: Completion) -> tuple[str, str]:
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
        return finish_reason, stop_reason

    def _response(
        self, turn: _Turn, engine: _Engine, finish_reason: str, stop_reason: str
    ) -> pb.GenerateResponse:
        finish = pb.FINISH_REASON_LENGTH if finish_reason == "length" else pb.FINISH_REASON_STOP
        return pb.GenerateResponse(
            token_ids=turn.token_ids,
            text=turn.text,
            logprobs=turn.logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            engine=engine.state.name,
            queue_ms=turn.queue_seconds * 1000.0,
            generate_ms=turn.generate_seconds * 1000.0,
            attempts=turn.attempts,
            weights_version=engine.state.weights_version,
        )

    def _finish(self, turn: _Turn, engine: _Engine, used_tokens: int) -> None:
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

    def _requeue(self, turn: _Turn, reason: str) -> None:
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

    def _fail(self, turn: _Turn, error: Exception, reason: str = "") -> None:
        if not turn.future.done():
            turn.future.set_exception(error)
            if reason:
                self.metrics.failed.labels(reason).inc()

    # ---- engines ---------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self._weights_version

    def engines(self) -> list[EngineState]:
        return self._states()

    def _states(self) -> list[EngineState]:
        return [e.state for e in self._engines.values()]

    def _in_flight(self) -> int:
        return sum(e.state.in_flight for e in self._engines.values())

    def _alive(self) -> bool:
        """Some engine takes turns now, or has not been probed yet."""
        return any(
            e.state.admitting or not (e.state.probed or e.state.removing)
            for e in self._engines.values()
        )

    def _no_engine_message(self) -> str:
        if not self._engines:
            return "no engines are configured"
        names = ", ".join(sorted(self._engines))
        return f"no healthy engine left (engines: {names})"

    def _add(self, name: str, url: str) -> _Engine:
        engine = _Engine(
            state=EngineState(name=name, url=url.rstrip("/")),
            client=EngineClient(url, timeout=self.config.request_timeout),
        )
        self._engines[name] = engine
        engine.watcher = asyncio.create_task(self._watch(engine), name=f"watch {name}")
        log.info("engine added", extra={"fields": {"engine": name, "url": url}})
        return engine

    async def _wait_first_probes(self, engines: list[_Engine]) -> None:
        waits = [asyncio.create_task(e.first_probe.wait()) for e in engines]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.config.startup_timeout)
            for task in pending:
                task.cancel()

    async def add_engine(self, name: str, url: str) -> None:
        """Add an engine (no-op if the name is known); waits (bounded) for its first probe."""
        if not name or not url:
            raise TurnRejected("an engine needs a name and a URL")
        if self._draining:
            raise SchedulerDraining("the scheduler is shutting down")
        if name in self._engines:
            return
        await self._wait_first_probes([self._add(name, url)])

    async def remove_engine(self, name: str) -> None:
        """Take an engine out now; its turns in flight are sent again elsewhere."""
        engine = self._engines.pop(name, None)
        if engine is None:
            raise UnknownEngine(f"no engine named {name!r}")
        log.info("engine removed", extra={"fields": {"engine": name}})
        self._recheck_fits = True
        await self._close_engine(engine, retry=True)
        self._update_availability()
        self._dispatch()

    async def _close_engine(self, engine: _Engine, retry: bool) -> None:
        engine.state.removing = True
        engine.state.healthy = False
        self._drop_affinity(engine)
        tasks = [t.task for t in engine.turns if t.task is not None]
        for turn in list(engine.turns):
            turn.retry_on_cancel = retry
            if turn.task is not None:
                turn.task.cancel()
        if engine.watcher is not None:
            engine.watcher.cancel()
            tasks.append(engine.watcher)
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.client.close()

    def _engine_failed(self, engine: _Engine, error: BaseException) -> None:
        """Take a failed engine out: its turns go elsewhere, it is probed until it answers."""
        state = engine.state
        if state.healthy:
            state.healthy = False
            self.metrics.engine_failures.labels(state.name).inc()
            log.warning(
                "engine taken out",
                extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
            )
        state.probed = True
        if self._weights_path:
            # It may come back restarted, with its original weights: reload them then.
            state.weights_version = 0
        self._recheck_fits = True
        self._drop_affinity(engine)
        for turn in list(engine.turns):
            if turn.task is not None:
                turn.retry_on_cancel = True
                turn.task.cancel()
        self._update_availability()

    async def _watch(self, engine: _Engine) -> None:
        # The flag, not only the cancellation, ends the loop: before Python 3.12 a cancel can
        # be lost when it races an awaited call's own completion.
        while not engine.state.removing:
            await self._probe(engine)
            engine.first_probe.set()
            self._dispatch()
            healthy = engine.state.healthy
            await asyncio.sleep(
                self.config.poll_interval if healthy else self.config.probe_interval
            )

    async def _probe(self, engine: _Engine) -> None:
        state = engine.state
        released_before = engine.released_total
        try:
            async with asyncio.timeout(self.config.scrape_timeout):
                text = await engine.client.metrics_text()
            sample = parse_vllm_metrics(text)
        except (EngineError, TimeoutError, ValueError) as error:
            engine.failures += 1
            if state.healthy and self._unresponsive(engine, error):
                self._engine_failed(engine, error)
            elif not state.probed:
                log.warning(
                    "engine not answering",
                    extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
                )
            state.probed = True
            self._update_availability()
            return
        engine.failures = 0
        engine.last_answer = time.monotonic()
        if (sample.block_size, sample.num_blocks) != (state.block_size, state.num_blocks):
            self._recheck_fits = True
        apply_sample(state, sample, engine.released_total - released_before)
        if not state.healthy:
            try:
                await self._bring_up(engine)
            except (EngineError, TimeoutError) as error:
                log.warning(
                    "engine answers but could not be brought up",
                    extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
                )
                state.probed = True
                return
            state.healthy = True
            log.info(
                "engine up",
                extra={
                    "fields": {
                        "engine": state.name,
                        "capacity_tokens": state.capacity_tokens,
                        "block_size": state.block_size,
                        "max_model_len": state.max_model_len,
                        "weights_version": state.weights_version,
                    }
                },
            )
        state.probed = True
        self._update_availability()

    def _unresponsive(self, engine: _Engine, error: Exception) -> bool:
        if engine.failures < self.config.failure_threshold:
            return False
        slow = isinstance(error, TimeoutError) or isinstance(error.__cause__, TimeoutError)
        silent = time.monotonic() - engine.last_answer
        return not slow or silent >= self.config.unresponsive_seconds

    async def _bring_up(self, engine: _Engine) -> None:
        """Before an engine takes turns: learn its context length, load the current weights."""
        state = engine.state
        state.max_model_len = await engine.client.max_model_len()
        # Waits for an update in progress, which this engine would otherwise miss.
        async with self._weights_lock:
            if state.weights_version != self._weights_version and self._weights_path:
                await engine.client.reload_weights(self._weights_path)
                state.weights_version = self._weights_version

    def _set_affinity(self, trajectory_id: str, engine: _Engine) -> None:
        if not trajectory_id:
            return
        previous = self._affinity.get(trajectory_id)
        if previous != engine.state.name and previous in self._engines:
            self._engines[previous].state.trajectories.discard(trajectory_id)
        self._affinity[trajectory_id] = engine.state.name
        self._affinity.move_to_end(trajectory_id)
        engine.state.trajectories.add(trajectory_id)
        while len(self._affinity) > self.config.affinity_limit:
            old, name = self._affinity.popitem(last=False)
            if name in self._engines:
                self._engines[name].state.trajectories.discard(old)

    def _drop_affinity(self, engine: _Engine) -> None:
        for trajectory_id in engine.state.trajectories:
            if self._affinity.get(trajectory_id) == engine.state.name:
                del self._affinity[trajectory_id]
        engine.state.trajectories.clear()

    def _update_availability(self) -> None:
        available = not self._draining and any(e.state.admitting for e in self._engines.values())
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
        async with self._weights_lock:
            self._paused = True
            try:
                waited = time.monotonic()
                while self._in_flight() or any(t.segments for t in self._queue):
                    self._turn_done.clear()
                    await self._turn_done.wait()
                waited = time.monotonic() - waited
                targets = [e for e in self._engines.values() if e.state.admitting]
                new_version = self._weights_version + 1 if version is None else version
                if not targets:
                    # Every engine is away (restarting, or out of the endpoints for a
                    # moment): each one loads these weights when it comes back, before it
                    # takes a turn (`_bring_up`), so the update is not lost and the trainer
                    # need not fail.
                    self._weights_version = new_version
                    self._weights_path = weights_path
                    self.metrics.weights_version.set(new_version)
                    log.warning(
                        "weights recorded with no engine up; engines load them on return",
                        extra={"fields": {"version": new_version, "path": weights_path}},
                    )
                    return pb.UpdateWeightsResponse(version=new_version, engines=[], seconds=0.0)
                started = time.monotonic()
                results = await asyncio.gather(
                    *(e.client.reload_weights(weights_path) for e in targets),
                    return_exceptions=True,
                )
                loaded: list[str] = []
                errors: list[str] = []
                for engine, result in zip(targets, results, strict=True):
                    if isinstance(result, BaseException):
                        if not isinstance(result, Exception):
                            raise result
                        errors.append(f"{engine.state.name}: {result}")
                        self._engine_failed(engine, result)
                    else:
                        engine.state.weights_version = new_version
                        loaded.append(engine.state.name)
                seconds = time.monotonic() - started
                if not loaded:
                    raise NoEngineAvailable(
                        "loading the weights failed on every engine: " + "; ".join(errors)
                    )
                self._weights_version = new_version
                self._weights_path = weights_path
                self.metrics.weights_version.set(new_version)
                self.metrics.weights_reload_seconds.observe(seconds)
                log.info(
                    "weights updated",
                    extra={
                        "fields": {
                            "version": new_version,
                            "path": weights_path,
                            "engines": loaded,
                            "failed": errors,
                            "reload_seconds": round(seconds, 3),
                            "waited_seconds": round(waited, 3),
                        }
                    },
                )
                return pb.UpdateWeightsResponse(
                    version=new_version, engines=loaded, seconds=seconds
                )
            finally:
                self._paused = False
                self._dispatch()

    def status(self) -> pb.GetSchedulerStatusResponse:
        return pb.GetSchedulerStatusResponse(
            policy=POLICY_TO_PROTO[self.policy_name],
            engines=[
                pb.EngineStatus(
                    name=s.name,
                    url=s.url,
                    healthy=s.admitting,
                    capacity_tokens=s.capacity_tokens,
                    kv_usage=s.kv_usage,
                    running=s.running,
                    waiting=s.waiting,
                    reserved_tokens=s.reserved_tokens,
                    in_flight=s.in_flight,
                    preemptions=s.preemptions,
                )
                for s in self._states()
            ],
            queued=len(self._queue),
            admitted=self.admitted_total,
            retried=self.retried_total,
            weights_version=self._weights_version,
        )
