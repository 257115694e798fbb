"""The rollout scheduler's gRPC server: RolloutSchedulerService, health, metrics, drain."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubestar.common.bounds import ServiceBounds
from kubestar.common.net import check_can_listen, start_metrics_server
from kubestar.common.serving import grpc_server, serve_until_signal
from kubestar.common.stubs import message_options
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import RequestTooLarge
from kubestar.scheduler.discovery import KubernetesDiscovery
from kubestar.scheduler.errors import (
    NoEngineAvailable,
    SchedulerDraining,
    SchedulerError,
    TurnRejected,
    UnknownEngine,
)
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.scheduler.openai_front import OpenAIFront, OpenAIFrontConfig
from kubestar.scheduler.scheduler import Scheduler
from kubestar.v1 import rollout_pb2 as pb
from kubestar.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutSchedulerService"].full_name
# Long contexts are a few hundred kB of token ids; leave room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class DiscoveryConfig:
    """Engines found in Kubernetes: ready pods matching a label selector."""

    selector: str = ""
    namespace: str = "default"
    port: int = 8000
    interval: float = 5.0


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50061"
    engines: list[tuple[str, str]] = field(default_factory=list)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    discovery: DiscoveryConfig | None = None
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_address: str = "127.0.0.1"
    drain_seconds: float = 30.0
    bounds: ServiceBounds = field(default_factory=ServiceBounds)
    # The installation's token (kubestar.common.auth): every call but health checks must
    # carry it. "": no authentication. The engines' token is scheduler.engine_token.
    auth_token: str = field(default="", repr=False)
    # The OpenAI-compatible HTTP front (kubestar.scheduler.openai_front); None: off.
    openai: OpenAIFrontConfig | None = None


def _code(error: Exception) -> grpc.StatusCode:
    if isinstance(error, RequestTooLarge | TurnRejected):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, UnknownEngine):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, NoEngineAvailable | SchedulerDraining):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class RolloutSchedulerServicer(pb_grpc.RolloutSchedulerServiceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def _abort(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        message = str(error.args[0]) if error.args else repr(error)
        await context.abort(_code(error), message)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        try:
            return await self.scheduler.generate(
                request.trajectory_id,
                request.prompt_token_ids,
                request.max_new_tokens,
                request.sampling,
                n=request.n or 1,
            )
        except (SchedulerError, RequestTooLarge) as error:
            await self._abort(context, error)
            raise  # abort raises; this keeps type checkers content

    async def EndTrajectory(
        self, request: pb.EndTrajectoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndTrajectoryResponse:
        self.scheduler.end_trajectory(request.trajectory_id)
        return pb.EndTrajectoryResponse()

    async def GetSchedulerStatus(
        self, request: pb.GetSchedulerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSchedulerStatusResponse:
        return self.scheduler.status()

    async def AddEngine(
        self, request: pb.AddEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddEngineResponse:
        try:
            await self.scheduler.add_engine(request.name, request.url)
        except SchedulerError as error:
            await self._abort(context, error)
        return pb.AddEngineResponse()

    async def RemoveEngine(
        self, request: pb.RemoveEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoveEngineResponse:
        try:
            await self.scheduler.remove_engine(request.name)
        except SchedulerError as error:
            await self._abort(context, error)
        return pb.RemoveEngineResponse()

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        try:
            version = request.version if request.HasField("version") else None
            return await self.scheduler.update_weights(request.weights_path, version)
        except SchedulerError as error:
            await self._abort(context, error)
            raise


class SchedulerServer:
    """A started server; `port` is the bound port (useful with port 0 in tests)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = SchedulerMetrics()
        self.scheduler = Scheduler(config.engines, config.scheduler, self.metrics)
        self.scheduler.on_availability = self._availability_changed
        self.server = grpc_server(
            config.bounds, config.auth_token, message_options(MAX_MESSAGE_BYTES)
        )
        self.health = health.aio.HealthServicer()
        self.discovery: KubernetesDiscovery | None = None
        self.openai: OpenAIFront | None = None
        self.port = 0
        self._health_tasks: set[asyncio.Task[None]] = set()

    def _availability_changed(self, available: bool) -> None:
        """Health is SERVING while at least one engine takes turns."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if available
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

        async def publish() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

        task = asyncio.get_running_loop().create_task(publish())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)
        log.info("scheduler availability", extra={"fields": {"serving": available}})

    async def start(self) -> None:
        # Before anything starts: a taken address is the user's to fix, in one line.
        check_can_listen(self.config.listen, "--listen")
        if self.config.metrics_port:
            address = f"{self.config.metrics_address}:{self.config.metrics_port}"
            check_can_listen(address, "--metrics-port")
        if self.config.openai is not None:
            check_can_listen(self.config.openai.listen, "--openai-listen")
            # Loads the tokenizer: a missing one fails here, before anything serves.
            self.openai = OpenAIFront(self.scheduler, self.config.openai, self.config.auth_token)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        pb_grpc.add_RolloutSchedulerServiceServicer_to_server(
            RolloutSchedulerServicer(self.scheduler), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.config.listen)
        await self.scheduler.start()
        # Metrics first: a probe that finds the gRPC port open can read them.
        if self.config.metrics_port:
            start_metrics_server(
                self.config.metrics_port, self.config.metrics_address, self.metrics.registry
            )
        await self.server.start()
        if self.config.discovery is not None and self.config.discovery.selector:
            d = self.config.discovery
            self.discovery = KubernetesDiscovery(
                self.scheduler, d.selector, d.namespace, d.port, d.interval
            )
            self.discovery.start()
        if self.openai is not None:
            await self.openai.start()
        log.info(
            "scheduler serving",
            extra={
                "fields": {
                    "listen": self.config.listen,
                    "port": self.port,
                    "policy": self.config.scheduler.policy,
                    "engines": [name for name, _ in self.config.engines],
                    "metrics_port": self.config.metrics_port,
                    "authentication": bool(self.config.auth_token),
                }
            },
        )

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Graceful drain: NOT_SERVING, finish queued and running turns, then close."""
        grace = self.config.drain_seconds if grace_seconds is None else grace_seconds
        await self.health.enter_graceful_shutdown()
        if self.openai is not None:
            await self.openai.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.scheduler.drain(grace)
        await self.scheduler.stop()
        await self.server.stop(grace=1.0)
        if self._health_tasks:
            await asyncio.gather(*self._health_tasks, return_exceptions=True)
        log.info("scheduler stopped")


async def serve(config: ServerConfig) -> None:
    await serve_until_signal(SchedulerServer(config), log)
