"""The scheduler's engines: each one's health, and which engine holds a trajectory's prefix.

Every engine is scraped (/metrics) every `poll_interval` seconds; between scrapes the
scheduler's own bookkeeping (reservations, released blocks) keeps the picture current. An
engine is taken out after `failure_threshold` failed scrapes in a row: at once when it
refuses connections, but only after `unresponsive_seconds` without an answer when its
scrapes merely time out (a busy machine makes a live engine slow, not dead). A failed turn
takes its engine out at once (`Engines.failed`). Engines out are probed every
`probe_interval` seconds and come back, with the current weights loaded, when they answer.
When an engine goes out, the turns running there are cancelled and sent again elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from kubestar.engine.client import EngineClient, EngineError
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import EngineState, apply_sample, parse_vllm_metrics
from kubestar.scheduler.errors import UnknownEngine
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.scheduler.records import Engine
from kubestar.scheduler.weights import WeightUpdates

log = logging.getLogger(__name__)


class Engines:
    """The engines by name, each watched by a task of its own.

    `on_probed()` is called after every scrape or probe (turns may fit now), and
    `on_health_change()` whenever an engine may have gone out or come back.
    `capacity_changed` is set when an engine's capacity changed or it left: queued turns
    must be checked again against what is left.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        metrics: SchedulerMetrics,
        weights: WeightUpdates,
        on_probed: Callable[[], None],
        on_health_change: Callable[[], None],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.weights = weights
        self.on_probed = on_probed
        self.on_health_change = on_health_change
        self.by_name: dict[str, Engine] = {}
        self.capacity_changed = False
        # Trajectory id -> the engine that ran its last turn (and so holds its prefix).
        self._affinity: OrderedDict[str, str] = OrderedDict()

    # ---- the set ---------------------------------------------------------------------------

    def states(self) -> list[EngineState]:
        return [e.state for e in self.by_name.values()]

    def admitting(self) -> list[Engine]:
        return [e for e in self.by_name.values() if e.state.admitting]

    def in_flight(self) -> int:
        return sum(e.state.in_flight for e in self.by_name.values())

    def alive(self) -> bool:
        """Some engine takes turns now, or has not been probed yet."""
        return any(
            e.state.admitting or not (e.state.probed or e.state.removing)
            for e in self.by_name.values()
        )

    def largest_block_size(self) -> int:
        return max((e.state.block_size for e in self.by_name.values()), default=0)

    def no_engine_message(self) -> str:
        if not self.by_name:
            return "no engines are configured"
        names = ", ".join(sorted(self.by_name))
        return f"no healthy engine left (engines: {names})"

    def add(self, name: str, url: str) -> Engine:
        engine = Engine(
            state=EngineState(name=name, url=url.rstrip("/")),
            client=EngineClient(
                url, timeout=self.config.request_timeout, token=self.config.engine_token
            ),
        )
        self.by_name[name] = engine
        engine.watcher = asyncio.create_task(self._watch(engine), name=f"watch {name}")
        log.info("engine added", extra={"fields": {"engine": name, "url": url}})
        return engine

    async def wait_first_probes(self, engines: list[Engine]) -> None:
        """Until each engine was probed once, or `startup_timeout` passed."""
        waits = [asyncio.create_task(e.first_probe.wait()) for e in engines]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.config.startup_timeout)
            for task in pending:
                task.cancel()

    async def remove(self, name: str) -> None:
        """Take an engine out now (a scale-down, a pod going away): its turns in flight move
        to the other engines, first in the queue, with the segments they finished; a move
        is not a failed attempt."""
        engine = self.by_name.pop(name, None)
        if engine is None:
            raise UnknownEngine(f"no engine named {name!r}")
        log.info("engine removed", extra={"fields": {"engine": name}})
        self.capacity_changed = True
        await self._close(engine, move=True)

    async def remove_all(self) -> None:
        """Stop watching every engine and close its connection; its turns fail."""
        engines = list(self.by_name.values())
        self.by_name.clear()
        await asyncio.gather(*(self._close(e, move=False) for e in engines))

    async def _close(self, engine: Engine, move: bool) -> None:
        engine.state.removing = True
        engine.state.healthy = False
        self._drop_affinity(engine)
        tasks = [t.task for t in engine.turns if t.task is not None]
        for turn in list(engine.turns):
            turn.moving = move
            turn.removals += 1 if move else 0
            if turn.task is not None:
                turn.task.cancel()
        if engine.watcher is not None:
            engine.watcher.cancel()
            tasks.append(engine.watcher)
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.client.close()

    # ---- health ----------------------------------------------------------------------------

    def failed(self, engine: Engine, error: BaseException) -> None:
        """Take a failed engine out: its turns go elsewhere, it is probed until it answers."""
        state = engine.state
        state.error = str(error)[:300] or type(error).__name__
        if state.healthy:
            state.healthy = False
            self.metrics.engine_failures.labels(state.name).inc()
            log.warning(
                "engine taken out",
                extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
            )
        state.probed = True
        self.weights.forget_loaded(engine)
        self.capacity_changed = True
        self._drop_affinity(engine)
        for turn in list(engine.turns):
            if turn.task is not None:
                turn.retry_on_cancel = True
                turn.task.cancel()
        self.on_health_change()

    async def _watch(self, engine: Engine) -> None:
        # The flag, not only the cancellation, ends the loop: before Python 3.12 a cancel can
        # be lost when it races an awaited call's own completion.
        while not engine.state.removing:
            await self._probe(engine)
            engine.first_probe.set()
            self.on_probed()
            healthy = engine.state.healthy
            await asyncio.sleep(
                self.config.poll_interval if healthy else self.config.probe_interval
            )

    async def _probe(self, engine: Engine) -> None:
        state = engine.state
        released_before = engine.released_total
        try:
            async with asyncio.timeout(self.config.scrape_timeout):
                text = await engine.client.metrics_text()
            sample = parse_vllm_metrics(text)
        except (EngineError, TimeoutError, ValueError) as error:
            engine.failures += 1
            if state.healthy and self._unresponsive(engine, error):
                self.failed(engine, error)
            elif not state.probed:
                log.warning(
                    "engine not answering",
                    extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
                )
            state.probed = True
            self.on_health_change()
            return
        engine.failures = 0
        engine.last_answer = time.monotonic()
        if (sample.block_size, sample.num_blocks) != (state.block_size, state.num_blocks):
            self.capacity_changed = True
        apply_sample(state, sample, engine.released_total - released_before)
        if not state.healthy:
            try:
                await self._bring_up(engine)
            except (EngineError, TimeoutError) as error:
                log.warning(
                    "engine answers but could not be brought up",
                    extra={"fields": {"engine": state.name, "error": str(error)[:500]}},
                )
                state.error = str(error)[:300] or type(error).__name__
                state.probed = True
                return
            state.healthy = True
            state.error = ""
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
        self.on_health_change()

    def _unresponsive(self, engine: Engine, error: Exception) -> bool:
        if engine.failures < self.config.failure_threshold:
            return False
        slow = isinstance(error, TimeoutError) or isinstance(error.__cause__, TimeoutError)
        silent = time.monotonic() - engine.last_answer
        return not slow or silent >= self.config.unresponsive_seconds

    async def _bring_up(self, engine: Engine) -> None:
        """Before an engine takes turns: learn its context length, load the current weights."""
        engine.state.max_model_len = await engine.client.max_model_len()
        await self.weights.load_current(engine)

    # ---- prefix affinity -------------------------------------------------------------------

    def remember(self, trajectory_id: str, engine: Engine) -> None:
        """The trajectory's turn runs on `engine`, which then holds its prefix."""
        if not trajectory_id:
            return
        previous = self._affinity.get(trajectory_id)
        if previous != engine.state.name and previous in self.by_name:
            self.by_name[previous].state.trajectories.discard(trajectory_id)
        self._affinity[trajectory_id] = engine.state.name
        self._affinity.move_to_end(trajectory_id)
        engine.state.trajectories.add(trajectory_id)
        while len(self._affinity) > self.config.affinity_limit:
            old, name = self._affinity.popitem(last=False)
            if name in self.by_name:
                self.by_name[name].state.trajectories.discard(old)

    def forget(self, trajectory_id: str) -> None:
        """The trajectory ended: no engine needs to keep its prefix for it."""
        name = self._affinity.pop(trajectory_id, None)
        if name is not None and name in self.by_name:
            self.by_name[name].state.trajectories.discard(trajectory_id)

    def _drop_affinity(self, engine: Engine) -> None:
        for trajectory_id in engine.state.trajectories:
            if self._affinity.get(trajectory_id) == engine.state.name:
                del self._affinity[trajectory_id]
        engine.state.trajectories.clear()
