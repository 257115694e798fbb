"""How a kubestar service process lives: it starts, serves until SIGTERM or SIGINT, then
drains (the sandbox, the rollout scheduler and the scoring service alike)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol


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
