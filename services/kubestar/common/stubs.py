"""A gRPC stub made on first use: the async clients of kubestar's services (rollout
scheduler, scoring, sandbox) and the trainer's tool executor each hold one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc

StubT = TypeVar("StubT")


class LazyStub(Generic[StubT]):
    """An aio channel to `endpoint` and the stub `make` builds on it, created by the first
    `get()`: inside the event loop that uses them (an aio channel belongs to the loop it was
    made in). `close()` closes the channel; a later `get()` opens a new one."""

    def __init__(
        self,
        endpoint: str,
        make: Callable[[grpc.aio.Channel], StubT],
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.endpoint = endpoint
        self._make = make
        self._options = list(options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: StubT | None = None

    def get(self) -> StubT:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.endpoint, options=self._options)
            self._stub = self._make(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
