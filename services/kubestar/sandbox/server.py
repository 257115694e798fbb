"""Run a sandbox server: a worker (local executors), a dispatcher (remote workers), or both."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubestar.common.bounds import ServiceBounds
from kubestar.common.net import check_can_listen, start_metrics_server
from kubestar.common.serving import grpc_server, serve_until_signal
from kubestar.sandbox.backend import Backend
from kubestar.sandbox.dispatcher import WorkerDispatcher
from kubestar.sandbox.executor import ExecutorConfig
from kubestar.sandbox.http_front import HttpFront
from kubestar.sandbox.limits import server_message_options
from kubestar.sandbox.pool import ExecutorPool
from kubestar.sandbox.service import SandboxServicer
from kubestar.v1 import sandbox_pb2
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    # Remote workers make this a dispatcher; none makes it a worker with local executors.
    workers: list[str] = field(default_factory=list)
    executors: int = 4
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    queue_timeout: float = 30.0
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_address: str = "127.0.0.1"
    drain_seconds: float = 30.0
    bounds: ServiceBounds = field(default_factory=ServiceBounds)
    # The installation's token (kubestar.common.auth): every call but health checks must
    # carry it, and a dispatcher sends it to its workers. "": no authentication.
    auth_token: str = field(default="", repr=False)
    # HOST:PORT of the HTTP dialects (SandboxFusion's, code-judge's: kubestar.sandbox.
    # http_front), on the same backend and token; "": off.
    http_listen: str = ""


def build_backend(config: ServerConfig) -> Backend:
    if config.workers:
        return WorkerDispatcher(
            config.workers, config.executor.policy, config.queue_timeout, config.auth_token
        )
    return ExecutorPool(config.executors, config.executor, config.queue_timeout)


class SandboxServer:
    """A started server; `port` is the bound port (useful with port 0 in tests)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.backend = build_backend(config)
        bounds = config.bounds
        self.server = grpc_server(
            bounds, config.auth_token, server_message_options(config.executor.policy)
        )
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.http: HttpFront | None = None
        if config.http_listen:
            self.http = HttpFront(
                config.http_listen,
                self.backend,
                config.executor.policy,
                config.auth_token,
                config.bounds,
            )

    async def start(self) -> None:
        # Before anything starts: a taken address is the user's to fix, in one line.
        check_can_listen(self.config.listen, "--listen")
        if self.config.metrics_port:
            address = f"{self.config.metrics_address}:{self.config.metrics_port}"
            check_can_listen(address, "--metrics-port")
        if self.config.http_listen:
            check_can_listen(self.config.http_listen, "--http-listen")
        await self.backend.start()
        servicer = SandboxServicer(self.backend, self.config.bounds.max_in_flight_per_stream)
        pb_grpc.add_SandboxServiceServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.config.listen)
        # Metrics first: a probe that finds the gRPC port open can read them.
        if self.config.metrics_port:
            start_metrics_server(self.config.metrics_port, self.config.metrics_address)
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        role = "dispatcher" if self.config.workers else "worker"
        log.info(
            "sandbox serving",
            extra={
                "fields": {
                    "role": role,
                    "listen": self.config.listen,
                    "port": self.port,
                    "workers": self.config.workers,
                    "executors": self.config.executors,
                    "metrics_port": self.config.metrics_port,
                    "http_port": self.http.port if self.http is not None else None,
                    "authentication": bool(self.config.auth_token),
                }
            },
        )

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Graceful drain: report NOT_SERVING, finish running calls, then close."""
        grace = self.config.drain_seconds if grace_seconds is None else grace_seconds
        await self.health.enter_graceful_shutdown()
        await self.backend.drain(grace)
        if self.http is not None:  # its running requests were answered in the drain
            await self.http.stop()
        await self.server.stop(grace=1.0)
        await self.backend.stop()
        log.info("sandbox stopped")


async def serve(config: ServerConfig) -> None:
    await serve_until_signal(SandboxServer(config), log)
