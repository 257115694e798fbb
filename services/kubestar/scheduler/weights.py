"""Weight updates: every engine loads the trainer's new policy weights between turns.

An update stops admission, lets the turns in flight finish (so that no turn mixes two
versions of the weights), has every engine that takes turns load them, and resumes. The
weights come from a folder every engine reads, or from the trainer's WeightServer
(`broadcast://HOST:PORT`), which broadcasts them to all the engines of an update at once,
in one session (kubestar.engine.weight_sync). An engine that fails to load, or has not
finished loading after `reload_timeout` seconds, is taken out (it loads the current weights
when it comes back, before its first turn); an update with no engine up is recorded for the
same reason, so the trainer need not fail.

A scheduler starts knowing no weights. The trainer owns them: before each rollout it asks
which weights the scheduler serves and pushes its latest again when a restart lost them
(kubestar.training.resilience.ensure_weights); engines that join afterwards load those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from kubestar.engine.weight_sync import is_broadcast, new_session
from kubestar.scheduler import proto
from kubestar.scheduler.errors import NoEngineAvailable
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.scheduler.records import Engine
from kubestar.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """What an update needs of the engines (`kubestar.scheduler.engines.Engines`)."""

    def admitting(self) -> list[Engine]:
        """The engines that take turns: they load the new weights."""
        ...

    def failed(self, engine: Engine, error: BaseException) -> None:
        """Take out an engine that failed to load them."""
        ...


class WeightUpdates:
    """The weights the engines serve (version and path) and replacing them on every engine."""

    def __init__(self, metrics: SchedulerMetrics, reload_timeout: float = 600.0) -> None:
        self.metrics = metrics
        self.reload_timeout = reload_timeout
        self.version = 0
        self.path = ""
        # Held by an update, and by an engine coming back while it loads the current weights.
        self.lock = asyncio.Lock()

    async def load_current(self, engine: Engine) -> None:
        """Before an engine takes turns: load the current weights unless it has them."""
        # Waits for an update in progress, which this engine would otherwise miss.
        async with self.lock:
            # By (version, path), not version: an engine that never loaded any weights says
            # version 0, which is also the version the trainer gives its SFT weights.
            if self.path and engine.weights != (self.version, self.path):
                await self._load([engine], self.path, self.version, raise_first=True)

    def forget_loaded(self, engine: Engine) -> None:
        """A failed engine may come back restarted, with its original weights: reload then."""
        # Also during an update, before its weights are recorded: an engine that loaded them
        # and then failed (restarted) before the others finished must load them again.
        engine.weights = None
        engine.state.weights_version = 0

    async def update(
        self,
        weights_path: str,
        version: int | None,
        engines: Fleet,
        quiesced: Callable[[], AbstractAsyncContextManager[float]],
    ) -> pb.UpdateWeightsResponse:
        """Reload every engine that takes turns, inside `quiesced()` (no turn under way; it
        yields the seconds it waited for the turns in flight)."""
        async with self.lock, quiesced() as waited:
            targets = engines.admitting()
            new_version = self.version + 1 if version is None else version
            if not targets:
                # Every engine is away (restarting, or out of the endpoints for a moment):
                # each one loads these weights when it comes back, before it takes a turn
                # (`load_current`), so the update is not lost and the trainer need not fail.
                self._record(new_version, weights_path)
                log.warning(
                    "weights recorded with no engine up; engines load them on return",
                    extra={"fields": {"version": new_version, "path": weights_path}},
                )
                return proto.weights_response(new_version, [], 0.0)
            started = time.monotonic()
            results = await self._load(targets, weights_path, new_version)
            loaded: list[str] = []
            failed: list[tuple[Engine, Exception]] = []
            for engine, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException):
                    if not isinstance(result, Exception):
                        raise result
                    failed.append((engine, result))
                else:
                    loaded.append(engine.state.name)
            seconds = time.monotonic() - started
            for engine, error in failed:
                engines.failed(engine, error)
            errors = [f"{engine.state.name}: {error}" for engine, error in failed]
            if not loaded:
                raise NoEngineAvailable(
                    "loading the weights failed on every engine: " + "; ".join(errors)
                )
            self._record(new_version, weights_path)
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
            return proto.weights_response(new_version, loaded, seconds)

    async def _load(
        self, targets: list[Engine], source: str, version: int, raise_first: bool = False
    ) -> list[int | BaseException]:
        """Every target loads `source` as `version`: each from the folder, or all of them in
        one broadcast session. Per engine, the bytes loaded or what went wrong."""
        session = new_session() if is_broadcast(source) else ""

        async def load(index: int, engine: Engine) -> int:
            try:
                async with asyncio.timeout(self.reload_timeout):
                    if session:
                        loaded = await engine.client.receive_weights(
                            source, session, index, len(targets), version, self.reload_timeout
                        )
                    else:
                        loaded = await engine.client.load_weights(source)
            except TimeoutError:
                raise TimeoutError(
                    f"loading weights v{version} from {source} did not finish in "
                    f"{self.reload_timeout:g} s"
                ) from None
            # Recorded as soon as this engine has them, not when every target has: if it
            # fails before the others are done, forget_loaded() must not be overwritten.
            engine.weights = (version, source)
            engine.state.weights_version = version
            return loaded

        loads = (load(index, engine) for index, engine in enumerate(targets))
        if raise_first:
            return list(await asyncio.gather(*loads))
        return list(await asyncio.gather(*loads, return_exceptions=True))

    def _record(self, version: int, path: str) -> None:
        self.version = version
        self.path = path
        self.metrics.weights_version.set(version)
