"""How the agent loop runs tool calls: many trajectories' calls share a connection to the
sandbox, and a slow call holds up only the trajectory that made it.

* `SandboxStreamExecutor` (default): one long-lived `ExecuteStream`. Calls go out the moment a
  trajectory makes them; each result comes back as soon as its call finishes (matched by id),
  so a call that sleeps for a second never delays the others. A broken stream is reopened
  and the calls still waiting are sent again (a few times, then they get an `internal`
  result); while the sandbox is unreachable, calls wait for it (up to `deadline`). Every
  call gets exactly one result.
* `SandboxBatchExecutor`: micro-batches over `ExecuteBatch`: calls made within `window`
  seconds (or `max_batch` of them) go out together; several batches may be in flight. A
  batch's results come back together, so a slow call delays its batch-mates (not generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from kubestar.common.auth import call_metadata, client_token
from kubestar.common.stubs import LazyStub, message_options
from kubestar.sandbox.client import MAX_MESSAGE_BYTES, Call, SandboxClient, to_execution
from kubestar.sandbox.retries import (
    DEFAULT_RETRIES,
    SandboxRetries,
    internal_result,
    rpc_failure,
)
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    *message_options(MAX_MESSAGE_BYTES),
    # Find a restarted sandbox within seconds (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


class ToolExecutor(Protocol):
    async def execute(self, call: Call) -> pb.ExecutionResult: ...

    async def close(self) -> None: ...


@dataclass
class _Waiting:
    execution: pb.Execution
    future: asyncio.Future[pb.ExecutionResult]
    attempts: int = 0


@dataclass(eq=False)
class _Stream:
    number: int
    queue: asyncio.Queue[pb.Execution | None] = field(default_factory=asyncio.Queue)
    waiting: dict[str, _Waiting] = field(default_factory=dict)
    sent: int = 0
    closing: bool = False
    reader: asyncio.Task[None] | None = None


class SandboxStreamExecutor:
    """Tool calls over one long-lived bidirectional stream (see the module docstring).

    `retries`: how often a call a broken stream left unanswered is sent again.
    `max_calls_per_stream`: a stream is half-closed and replaced after this many calls (the
    server remembers each stream's ids). `deadline`: seconds after which a call that got no
    result is answered `internal` (0: wait as long as it takes). `token`: the installation's
    bearer token (kubestar.common.auth); None takes it from the environment, "" sends none.
    """

    def __init__(
        self,
        endpoint: str,
        retries: SandboxRetries = DEFAULT_RETRIES,
        max_calls_per_stream: int = 100_000,
        deadline: float = 900.0,
        token: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._metadata = call_metadata(client_token(token))
        self.retries = retries
        self.max_calls_per_stream = max_calls_per_stream
        self.deadline = deadline
        self._prefix = f"tc{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self._ids = itertools.count()
        self._streams = itertools.count()
        self._stub = LazyStub(endpoint, pb_grpc.SandboxServiceStub, _CHANNEL_OPTIONS)
        self._current: _Stream | None = None
        self._live: set[_Stream] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.streams_opened = 0
        self.resent = 0

    async def execute(self, call: Call) -> pb.ExecutionResult:
        if self._closed:
            raise RuntimeError("executor closed")
        call_id = call.id or f"{self._prefix}-{next(self._ids)}"
        future: asyncio.Future[pb.ExecutionResult] = asyncio.get_running_loop().create_future()
        self._submit(_Waiting(to_execution(call, call_id), future))
        if not self.deadline:
            return await future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.deadline)
        except TimeoutError:
            future.cancel()
            return internal_result(call_id, f"no result from the sandbox in {self.deadline:g}s")

    def _stream(self) -> _Stream:
        stream = self._current
        if stream is None or stream.closing or stream.sent >= self.max_calls_per_stream:
            if stream is not None and not stream.closing:
                stream.closing = True
                stream.queue.put_nowait(None)  # half-close: the server finishes what it has
            stream = _Stream(next(self._streams))
            stream.reader = asyncio.create_task(self._run(stream))
            self._live.add(stream)
            stream.reader.add_done_callback(functools.partial(self._ended, stream))
            self._current = stream
            self.streams_opened += 1
        return stream

    def _ended(self, stream: _Stream, _task: asyncio.Task[None]) -> None:
        self._live.discard(stream)

    def _submit(self, waiting: _Waiting) -> None:
        if waiting.future.done():
            return
        stream = self._stream()
        stream.waiting[waiting.execution.id] = waiting
        stream.sent += 1
        stream.queue.put_nowait(waiting.execution)

    async def _run(self, stream: _Stream) -> None:
        async def requests() -> AsyncIterator[pb.ExecuteStreamRequest]:
            while (execution := await stream.queue.get()) is not None:
                yield pb.ExecuteStreamRequest(execution=execution)

        failure = ""
        # wait_for_ready: while the sandbox is unreachable (restarting, not up yet) calls
        # wait for it instead of failing at once; `deadline` bounds the wait.
        responses = self._stub.get().ExecuteStream(
            requests(), wait_for_ready=True, metadata=self._metadata
        )
        try:
            async for response in responses:
                waiting = stream.waiting.pop(response.result.id, None)
                if waiting is not None and not waiting.future.done():
                    waiting.future.set_result(response.result)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:
            failure = rpc_failure("stream", exc)
        except Exception as exc:  # never leave callers waiting
            failure = f"sandbox stream failed: {exc!r}"
        finally:
            stream.closing = True
            stream.queue.put_nowait(None)  # ends the request iterator
            responses.cancel()  # no-op when the call is over
            if self._current is stream:
                self._current = None
        left = list(stream.waiting.values())
        stream.waiting.clear()
        if left:
            log.warning(
                "sandbox stream ended with calls unanswered; sending them again",
                extra={"fields": {"calls": len(left), "error": failure}},
            )
        for waiting in left:
            waiting.attempts += 1
            if not self.retries.again(waiting.attempts) or self._closed:
                if not waiting.future.done():
                    waiting.future.set_result(
                        internal_result(
                            waiting.execution.id, failure or "sandbox stream ended early"
                        )
                    )
            else:
                task = asyncio.create_task(self._resend(waiting))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _resend(self, waiting: _Waiting) -> None:
        await self.retries.wait(waiting.attempts)
        self.resent += 1
        self._submit(waiting)

    async def close(self) -> None:
        """Let calls in flight finish (up to 5 s), then answer the rest `internal`."""
        self._closed = True
        self._current = None
        for task in list(self._tasks):
            task.cancel()
        for stream in list(self._live):
            stream.queue.put_nowait(None)
            assert stream.reader is not None
            if any(not waiting.future.done() for waiting in stream.waiting.values()):
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(stream.reader), 5)
            stream.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream.reader
            for waiting in stream.waiting.values():
                if not waiting.future.done():
                    waiting.future.set_result(
                        internal_result(waiting.execution.id, "the executor was closed")
                    )
        self._live.clear()
        await self._stub.close()


class SandboxBatchExecutor:
    """Micro-batches of calls over ExecuteBatch (see the module docstring); a batch the
    sandbox refused is sent again as `retries` says."""

    def __init__(
        self,
        endpoint: str,
        window: float = 0.005,
        max_batch: int = 256,
        retries: SandboxRetries = DEFAULT_RETRIES,
        timeout: float | None = 900.0,
    ) -> None:
        self.client = SandboxClient(endpoint, timeout=timeout)
        self.window = window
        self.max_batch = max_batch
        self.retries = retries
        self._prefix = f"tb{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self._ids = itertools.count()
        self._buffer: list[tuple[Call, asyncio.Future[pb.ExecutionResult]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.batch_sizes: list[int] = []

    async def execute(self, call: Call) -> pb.ExecutionResult:
        loop = asyncio.get_running_loop()
        call = Call(
            code=call.code,
            id=call.id or f"{self._prefix}-{next(self._ids)}",
            stdin=call.stdin,
            timeout_seconds=call.timeout_seconds,
            memory_bytes=call.memory_bytes,
            output_bytes=call.output_bytes,
        )
        future: asyncio.Future[pb.ExecutionResult] = loop.create_future()
        self._buffer.append((call, future))
        if len(self._buffer) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._buffer = self._buffer, []
        if batch:
            task = asyncio.create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[Call, asyncio.Future[pb.ExecutionResult]]]) -> None:
        self.batches += 1
        self.batch_sizes.append(len(batch))
        calls = [call for call, _ in batch]
        failure = ""
        started = time.monotonic()

        async def attempt(_: int) -> bool:
            nonlocal failure
            try:
                results = await self.client.aexecute_batch(calls)
            except grpc.RpcError as exc:
                failure = rpc_failure("batch", exc)
                return False
            by_id = {result.id: result for result in results}
            for call, future in batch:
                if not future.done():
                    future.set_result(
                        by_id.get(call.id) or internal_result(call.id, "no result in the batch")
                    )
            return True

        if await self.retries.run(attempt):
            return
        log.warning(
            "sandbox batch failed",
            extra={
                "fields": {
                    "calls": len(batch),
                    "error": failure,
                    "seconds": time.monotonic() - started,
                }
            },
        )
        for call, future in batch:
            if not future.done():
                future.set_result(internal_result(call.id, failure))

    async def close(self) -> None:
        self._flush()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.client.aclose()
        self.client.close()
