"""Async Python client of the scoring service. (The search's `Scorer` on it is
`kubestar.search.scorer.PpmScorer`.)

Errors come back as `grpc.aio.AioRpcError`: INVALID_ARGUMENT for a request outside the
limits (the details name the field), UNAUTHENTICATED without the installation's token,
INTERNAL when the model failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubestar.common.stubs import ServiceClient, message_options
from kubestar.v1 import scoring_pb2 as pb
from kubestar.v1 import scoring_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = message_options(MAX_MESSAGE_BYTES)


@dataclass(frozen=True)
class Reward:
    raw: float  # the head's output
    squashed: float  # tanh(raw / reward_scale), in [-1, 1]


class ScoringClient(ServiceClient[pb_grpc.ScoringServiceStub]):
    """One channel to a scoring server (see ServiceClient)."""

    def __init__(
        self, endpoint: str, timeout: float | None = None, token: str | None = None
    ) -> None:
        super().__init__(endpoint, pb_grpc.ScoringServiceStub, _CHANNEL_OPTIONS, timeout, token)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[Reward]:
        """One reward per token sequence, in order."""
        request = pb.ScoreRequest(
            sequences=[pb.TokenSequence(token_ids=list(ids)) for ids in sequences]
        )
        response: pb.ScoreResponse = await self.stub.Score(
            request, timeout=self.timeout, metadata=self._metadata
        )
        return [Reward(reward.raw, reward.squashed) for reward in response.rewards]

    async def model_info(self) -> pb.GetModelInfoResponse:
        response: pb.GetModelInfoResponse = await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
        )
        return response
