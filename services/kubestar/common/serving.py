"""How a kubestar service process lives: its gRPC server is made one way (`grpc_server`),
it starts, serves until SIGTERM or SIGINT, then drains (the sandbox, the rollout scheduler
and the scoring service alike)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from kubestar.common.auth import server_interceptors
from kubestar.common.bounds import ServiceBounds


def grpc_server(
    bounds: ServiceBounds, auth_token: str, message_options: Sequence[tuple[str, Any]]
) -> grpc.aio.Server:
    """A service's gRPC server: messages as `message_options` allow, `bounds` (RPCs at once,
    keepalive), the installation's token checked when set, and no SO_REUSEPORT (a second
    server on a port in use fails instead of sharing it)."""
    return grpc.aio.server(
        options=[*message_options, *bounds.server_options(), ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=bounds.max_concurrent_rpcs,
        interceptors=server_interceptors(auth_token),
    )


class Service(Protocol):
    """A server with a graceful stop (its drain)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_signal(service: Service, log: logging.Logger) -> None:
    """Start `service`, wait for SIGTERM or SIGINT, then stop it (logged on `log`, the
    service's own logger)."""
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining on signal")
    await service.stop()
