"""A gRPC stub made on first use: the async clients of kubestar's services (rollout
scheduler, scoring, sandbox) and the trainer's tool executor each hold one. `ServiceClient`
is the shell of the scheduler's and the scoring service's clients around it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Self, TypeVar

import grpc
from kubestar.common.auth import call_metadata, client_token

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


def message_options(max_bytes: int) -> list[tuple[str, Any]]:
    """Channel (and server) options for messages of up to `max_bytes` either way."""
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


class ServiceClient(Generic[StubT]):
    """One channel to a kubestar service; create and use it inside one event loop.

    `timeout` (seconds) bounds each call. `token`: the installation's bearer token
    (kubestar.common.auth); None takes it from the environment (KUBESTAR_AUTH_TOKEN_FILE,
    KUBESTAR_AUTH_TOKEN), "" sends none.
    """

    def __init__(
        self,
        endpoint: str,
        make: Callable[[grpc.aio.Channel], StubT],
        options: Sequence[tuple[str, Any]],
        timeout: float | None,
        token: str | None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._metadata = call_metadata(client_token(token))
        self._stub = LazyStub(endpoint, make, options)

    @property
    def stub(self) -> StubT:
        return self._stub.get()

    async def close(self) -> None:
        await self._stub.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
