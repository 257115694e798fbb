"""Dynamic batching: the sequences of concurrent Score requests share forward passes.

A search asks for a few scores at a time (the children of one expansion), and many searches
run at once; one forward pass over their sequences together costs little more than over one
of them. Every sequence joins one queue; the batching loop takes the oldest, then waits at
most `max_wait_ms` for more, closing the batch as soon as it holds `max_batch_sequences`
sequences or the next one would take the padded batch (rows x the longest row) past
`max_batch_tokens` (that one opens the next batch). The model runs in a worker thread, one
batch at a time, so requests keep arriving while it computes and the next batch fills. A
request's sequences may land in several batches; its answer waits for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubestar.scoring.metrics import ScoringMetrics

# Raw rewards of a batch of token sequences, in order (runs in a worker thread).
ScoreBatch = Callable[[list[list[int]]], list[float]]


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_sequences: int = 32
    max_batch_tokens: int = 65536  # rows x the longest row of one forward pass
    max_wait_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.max_batch_sequences < 1:
            raise ValueError("max_batch_sequences must be at least 1")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be at least 1")
        if self.max_wait_ms < 0:
            raise ValueError("max_wait_ms must be 0 or more")


@dataclass
class _Item:
    ids: list[int]
    future: asyncio.Future[float]


class Batcher:
    """Scores sequences in batches (see the module docstring). Start it inside the event
    loop that serves the requests."""

    def __init__(
        self, score_batch: ScoreBatch, config: BatchingConfig, metrics: ScoringMetrics
    ) -> None:
        self.score_batch = score_batch
        self.config = config
        self.metrics = metrics
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._held: _Item | None = None  # did not fit the last batch: opens the next
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for item in self._drop_queue():
            if not item.future.done():
                item.future.set_exception(RuntimeError("the scoring server is stopping"))

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """Raw rewards of `sequences`, in order, once the batches holding them have run."""
        loop = asyncio.get_running_loop()
        items = [_Item(list(ids), loop.create_future()) for ids in sequences]
        for item in items:
            self._queue.put_nowait(item)
        self.metrics.queued.inc(len(items))
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        finally:
            for item in items:  # a cancelled request: its sequences are skipped
                item.future.cancel()

    def _drop_queue(self) -> list[_Item]:
        dropped = [self._held] if self._held is not None else []
        self._held = None
        while not self._queue.empty():
            dropped.append(self._queue.get_nowait())
        self.metrics.queued.dec(len(dropped))
        return dropped

    async def _next(self, timeout: float | None) -> _Item | None:
        """The oldest waiting sequence whose request still waits (None after `timeout`)."""
        while True:
            if self._held is not None:
                item, self._held = self._held, None
            elif not self._queue.empty():  # wait_for would time out at 0 before a get
                item = self._queue.get_nowait()
                self.metrics.queued.dec()
            elif timeout is not None and timeout <= 0:
                return None
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout)
                except TimeoutError:
                    return None
                self.metrics.queued.dec()
            if not item.future.done():
                return item

    async def _gather(self) -> list[_Item]:
        first = await self._next(None)
        assert first is not None  # no timeout: waits for one
        batch, longest = [first], len(first.ids)
        deadline = time.monotonic() + self.config.max_wait_ms / 1000
        while len(batch) < self.config.max_batch_sequences:
            item = await self._next(max(deadline - time.monotonic(), 0.0))
            if item is None:
                break
            width = max(longest, len(item.ids))
            if (len(batch) + 1) * width > self.config.max_batch_tokens:
                self._held = item
                break
            batch.append(item)
            longest = width
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._gather()
            started = time.monotonic()
            try:
                rewards = await asyncio.to_thread(self.score_batch, [item.ids for item in batch])
            except Exception as error:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(error)
                continue
            m = self.metrics
            m.batches.inc()
            m.sequences.inc(len(batch))
            m.batch_sequences.observe(len(batch))
            m.batch_tokens.observe(len(batch) * max(len(item.ids) for item in batch))
            m.batch_seconds.observe(time.monotonic() - started)
            for item, reward in zip(batch, rewards, strict=True):
                if not item.future.done():
                    item.future.set_result(reward)
