"""The scoring service's gRPC server: ScoringService over a process preference model,
dynamic batching, health, metrics, the installation's token, drain."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubestar.common.bounds import ServiceBounds
from kubestar.common.net import check_can_listen, start_metrics_server
from kubestar.common.serving import grpc_server, serve_until_signal
from kubestar.common.stubs import message_options
from kubestar.scoring.batcher import Batcher, BatchingConfig
from kubestar.scoring.metrics import ScoringMetrics
from kubestar.scoring.model import ProcessPreferenceModel, squash
from kubestar.v1 import scoring_pb2 as pb
from kubestar.v1 import scoring_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ScoringService"].full_name
DEFAULT_LISTEN = "127.0.0.1:50071"
# A request of max_request_sequences x max_sequence_tokens ids (about 5 bytes each).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class ServerConfig:
    # A PPM folder (`kubestar ppm train --out`), or a causal LM's folder or model name
    # (a fresh, untrained head: for trying the service out).
    model: str = "SmolLM2-135M-Instruct"
    listen: str = DEFAULT_LISTEN
    device: str = "auto"
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Limits of one Score request; longer or more is INVALID_ARGUMENT.
    max_sequence_tokens: int = 4096
    max_request_sequences: int = 1024
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_address: str = "127.0.0.1"
    drain_seconds: float = 30.0
    bounds: ServiceBounds = field(default_factory=ServiceBounds)
    # The installation's token (kubestar.common.auth): every call but health checks must
    # carry it. "": no authentication.
    auth_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.max_sequence_tokens < 1 or self.max_request_sequences < 1:
            raise ValueError("max_sequence_tokens and max_request_sequences must be at least 1")
        if self.max_sequence_tokens > self.batching.max_batch_tokens:
            raise ValueError(
                f"max_sequence_tokens {self.max_sequence_tokens} is more than max_batch_tokens "
                f"{self.batching.max_batch_tokens}: the longest sequence must fit in a batch"
            )


class InvalidRequest(ValueError):
    """A Score request the server will not run; the message names the field."""


def check_sequences(
    sequences: Sequence[Sequence[int]], vocab_size: int, config: ServerConfig
) -> None:
    """Raise InvalidRequest, naming the field, for a request outside the limits."""
    if not sequences:
        raise InvalidRequest("sequences: empty: give at least one sequence to score")
    if len(sequences) > config.max_request_sequences:
        raise InvalidRequest(
            f"sequences: {len(sequences)} sequences, at most {config.max_request_sequences} "
            "per request (max_request_sequences): split the request"
        )
    for index, ids in enumerate(sequences):
        where = f"sequences[{index}].token_ids"
        if not ids:
            raise InvalidRequest(f"{where}: empty: every sequence needs at least one token")
        if len(ids) > config.max_sequence_tokens:
            raise InvalidRequest(
                f"{where}: {len(ids)} tokens, at most {config.max_sequence_tokens} "
                "(max_sequence_tokens): keep the last tokens, where the step being scored is"
            )
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidRequest(
                f"{where}: token id {bad} is outside the vocabulary (0 to {vocab_size - 1}): "
                "score ids of the PPM's tokenizer"
            )


class ScoringServicer(pb_grpc.ScoringServiceServicer):
    def __init__(
        self,
        model: ProcessPreferenceModel,
        batcher: Batcher,
        config: ServerConfig,
        metrics: ScoringMetrics,
    ) -> None:
        self.model = model
        self.batcher = batcher
        self.config = config
        self.metrics = metrics

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        started = time.monotonic()
        sequences = [list(sequence.token_ids) for sequence in request.sequences]
        try:
            check_sequences(sequences, self.model.vocab_size, self.config)
            raw = await self.batcher.score(sequences)
        except InvalidRequest as error:
            self._count(grpc.StatusCode.INVALID_ARGUMENT, started)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            raise  # abort raises; this keeps type checkers content
        except Exception as error:  # the model failed (out of memory, ...) or the server stops
            log.exception("scoring failed")
            self._count(grpc.StatusCode.INTERNAL, started)
            message = f"scoring failed: {type(error).__name__}: {error}"
            await context.abort(grpc.StatusCode.INTERNAL, message)
            raise
        self._count(grpc.StatusCode.OK, started)
        scale = self.model.reward_scale
        return pb.ScoreResponse(
            rewards=[pb.Reward(raw=value, squashed=squash(value, scale)) for value in raw]
        )

    def _count(self, code: grpc.StatusCode, started: float) -> None:
        """Counted before the answer leaves: a caller holding its answer sees its request in
        /metrics (abort sends the status at once, before any `finally` would run)."""
        self.metrics.requests.labels(code.name.lower().replace("_", "-")).inc()
        self.metrics.request_seconds.observe(time.monotonic() - started)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        batching = self.config.batching
        return pb.GetModelInfoResponse(
            model=str(self.model.source),
            vocab_size=self.model.vocab_size,
            tokenizer_sha256=self.model.tokenizer_sha256,
            max_sequence_tokens=self.config.max_sequence_tokens,
            max_request_sequences=self.config.max_request_sequences,
            reward_scale=self.model.reward_scale,
            max_batch_sequences=batching.max_batch_sequences,
            max_wait_ms=batching.max_wait_ms,
        )


class ScoringServer:
    """A started server; `port` is the bound port (useful with port 0 in tests). Give
    `model` to serve one already loaded (else `config.model` is loaded on start)."""

    def __init__(self, config: ServerConfig, model: ProcessPreferenceModel | None = None) -> None:
        self.config = config
        self.model = model
        self.metrics = ScoringMetrics()
        self.server = grpc_server(
            config.bounds, config.auth_token, message_options(MAX_MESSAGE_BYTES)
        )
        self.health = health.aio.HealthServicer()
        self.batcher: Batcher | None = None
        self.port = 0

    def _score_batch(self, sequences: list[list[int]]) -> list[float]:
        assert self.model is not None
        return self.model.score(sequences, batch_size=len(sequences))

    async def start(self) -> None:
        # Before the model loads: a taken address is the user's to fix, in one line.
        check_can_listen(self.config.listen, "--listen")
        if self.config.metrics_port:
            address = f"{self.config.metrics_address}:{self.config.metrics_port}"
            check_can_listen(address, "--metrics-port")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.model is None:
            self.model = await asyncio.to_thread(
                ProcessPreferenceModel.load, self.config.model, self.config.device
            )
        self.model.eval()
        self.batcher = Batcher(self._score_batch, self.config.batching, self.metrics)
        await self.batcher.start()
        servicer = ScoringServicer(self.model, self.batcher, self.config, self.metrics)
        pb_grpc.add_ScoringServiceServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.config.listen)
        # Metrics first: a probe that finds the gRPC port open can read them.
        if self.config.metrics_port:
            start_metrics_server(
                self.config.metrics_port, self.config.metrics_address, self.metrics.registry
            )
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "scoring serving",
            extra={
                "fields": {
                    "listen": self.config.listen,
                    "port": self.port,
                    "model": str(self.model.source),
                    "device": str(self.model.device),
                    "max_batch_sequences": self.config.batching.max_batch_sequences,
                    "max_wait_ms": self.config.batching.max_wait_ms,
                    "metrics_port": self.config.metrics_port,
                    "authentication": bool(self.config.auth_token),
                }
            },
        )

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Graceful drain: NOT_SERVING, answer the requests in flight, then close."""
        grace = self.config.drain_seconds if grace_seconds is None else grace_seconds
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace)
        if self.batcher is not None:
            await self.batcher.stop()
        log.info("scoring stopped")


async def serve(config: ServerConfig) -> None:
    await serve_until_signal(ScoringServer(config), log)
