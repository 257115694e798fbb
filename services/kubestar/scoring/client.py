"""Async Python client of the scoring service, and `PpmScorer`: the search's `Scorer` backed
by it (what MCTS and beam search call at test time).

Errors come back as `grpc.aio.AioRpcError`: INVALID_ARGUMENT for a request outside the
limits (the details name the field), UNAUTHENTICATED without the installation's token,
INTERNAL when the model failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubestar.api.errors import KubestarError
from kubestar.common.auth import call_metadata, client_token
from kubestar.common.stubs import LazyStub
from kubestar.search.ppm_data import Encode, path_token_ids
from kubestar.search.tree import Node
from kubestar.v1 import scoring_pb2 as pb
from kubestar.v1 import scoring_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class Reward:
    raw: float  # the head's output
    squashed: float  # tanh(raw / reward_scale), in [-1, 1]


class ScoringClient:
    """One channel to a scoring server; create and use it inside one event loop.

    `timeout` (seconds) bounds each call. `token`: the installation's bearer token
    (kubestar.common.auth); None takes it from the environment (KUBESTAR_AUTH_TOKEN_FILE,
    KUBESTAR_AUTH_TOKEN), "" sends none.
    """

    def __init__(
        self, endpoint: str, timeout: float | None = None, token: str | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._metadata = call_metadata(client_token(token))
        self._stub = LazyStub(endpoint, pb_grpc.ScoringServiceStub, _CHANNEL_OPTIONS)

    @property
    def stub(self) -> pb_grpc.ScoringServiceStub:
        return self._stub.get()

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

    async def close(self) -> None:
        await self._stub.close()

    async def __aenter__(self) -> ScoringClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class TokenizerMismatch(KubestarError, ValueError):
    """The scoring server's model reads token ids with another tokenizer than the policy's."""


class PpmScorer:
    """The search's `Scorer` (kubestar.search.mcts) on a scoring server: a node's value is
    the PPM's squashed reward of the token ids along its path (`path_token_ids`: the
    root's prompt ids, each step's ids and its encoded observation).

    `encode` turns observation text into ids with the policy's tokenizer. Give
    `tokenizer_sha256` (`kubestar.search.ppm_data.tokenizer_sha256` of the policy's model
    folder) to have the first call check that the PPM reads ids the same way. A path longer
    than the server takes keeps its last tokens, as the PPM was trained; a search's nodes
    are sent in as few requests as the server's limit allows.
    """

    def __init__(self, client: ScoringClient, encode: Encode, tokenizer_sha256: str = "") -> None:
        self.client = client
        self.encode = encode
        self.tokenizer_sha256 = tokenizer_sha256
        self._info: pb.GetModelInfoResponse | None = None

    async def info(self) -> pb.GetModelInfoResponse:
        """The server's model and limits (asked once)."""
        if self._info is None:
            info = await self.client.model_info()
            if self.tokenizer_sha256 and info.tokenizer_sha256 != self.tokenizer_sha256:
                raise TokenizerMismatch(
                    f"the scoring server at {self.client.endpoint} serves {info.model}, whose "
                    "tokenizer differs from the policy's: train the PPM from the policy's "
                    "model (`kubestar ppm train --model`)"
                )
            self._info = info
        return self._info

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        if not nodes:
            return []
        info = await self.info()
        longest = info.max_sequence_tokens
        sequences = [path_token_ids(node, self.encode)[-longest:] for node in nodes]
        per_request = info.max_request_sequences
        values: list[float] = []
        for start in range(0, len(sequences), per_request):
            rewards = await self.client.score(sequences[start : start + per_request])
            values.extend(reward.squashed for reward in rewards)
        return values
