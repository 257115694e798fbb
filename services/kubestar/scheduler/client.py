"""Async Python client of the rollout scheduler (what the agent loop and the trainer call).

Errors come back as `grpc.aio.AioRpcError`: UNAVAILABLE when no engine is left (or the
scheduler is shutting down), INVALID_ARGUMENT for a turn no engine can hold or an engine
refused, NOT_FOUND for an unknown engine name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.common.stubs import ServiceClient, message_options
from kubestar.v1 import rollout_pb2 as pb
from kubestar.v1 import rollout_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A scheduler pod that was replaced answers at a new connection: try to reconnect at least
# every second (gRPC's default backs off to 2 minutes), so that a caller waiting for it (the
# trainer's push retry) sees it back within a second.
_CHANNEL_OPTIONS = [
    *message_options(MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def sampling_params(sampling: pb.SamplingParams | Mapping[str, Any] | None) -> pb.SamplingParams:
    """A SamplingParams from a message, a dict of its fields (`{"temperature": 0.7}`), or None
    (greedy)."""
    if sampling is None:
        return pb.SamplingParams()
    if isinstance(sampling, pb.SamplingParams):
        return sampling
    return pb.SamplingParams(**dict(sampling))


def completions(response: pb.GenerateResponse) -> list[pb.Completion]:
    """Every completion of a Generate answer, in order. A scheduler from before n samples
    sends only the one-completion fields: they make the one completion then."""
    if response.completions:
        return list(response.completions)
    return [
        pb.Completion(
            token_ids=response.token_ids,
            text=response.text,
            logprobs=response.logprobs,
            finish_reason=response.finish_reason,
            stop_reason=response.stop_reason,
        )
    ]


class SchedulerClient(ServiceClient[pb_grpc.RolloutSchedulerServiceStub]):
    """One channel to a scheduler (see ServiceClient); `timeout` bounds each call except
    `update_weights` (its own `timeout`)."""

    def __init__(
        self, endpoint: str, timeout: float | None = None, token: str | None = None
    ) -> None:
        stub = pb_grpc.RolloutSchedulerServiceStub
        super().__init__(endpoint, stub, _CHANNEL_OPTIONS, timeout, token)

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: pb.SamplingParams | Mapping[str, Any] | None = None,
        n: int = 1,
    ) -> pb.GenerateResponse:
        """One turn, or `n` samples of it from one prefill (read them with `completions`)."""
        request = pb.GenerateRequest(
            trajectory_id=trajectory_id,
            prompt_token_ids=list(prompt_token_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling_params(sampling),
            n=n,
        )
        response: pb.GenerateResponse = await self.stub.Generate(
            request, timeout=self.timeout, metadata=self._metadata
        )
        return response

    async def end_trajectory(self, trajectory_id: str) -> None:
        await self.stub.EndTrajectory(
            pb.EndTrajectoryRequest(trajectory_id=trajectory_id),
            timeout=self.timeout,
            metadata=self._metadata,
        )

    async def status(self) -> pb.GetSchedulerStatusResponse:
        response: pb.GetSchedulerStatusResponse = await self.stub.GetSchedulerStatus(
            pb.GetSchedulerStatusRequest(), timeout=self.timeout, metadata=self._metadata
        )
        return response

    async def update_weights(
        self,
        weights_path: str,
        version: int | None = None,
        timeout: float | None = None,
    ) -> pb.UpdateWeightsResponse:
        """Every engine loads the weights in `weights_path`; no `version` means "next"."""
        response: pb.UpdateWeightsResponse = await self.stub.UpdateWeights(
            pb.UpdateWeightsRequest(weights_path=weights_path, version=version),
            timeout=timeout,
            metadata=self._metadata,
        )
        return response

    async def add_engine(self, name: str, url: str) -> None:
        await self.stub.AddEngine(
            pb.AddEngineRequest(name=name, url=url), timeout=self.timeout, metadata=self._metadata
        )

    async def remove_engine(self, name: str) -> None:
        await self.stub.RemoveEngine(
            pb.RemoveEngineRequest(name=name), timeout=self.timeout, metadata=self._metadata
        )
