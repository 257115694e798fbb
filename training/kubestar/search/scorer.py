"""The PPM as the search's `Scorer` (`kubestar.search.mcts`), wherever it lives: a folder
served in this process, or a running scoring service (`kubestar.scoring`). `kubestar solve`,
`kubestar eval --search`, `kubestar evolve` and the trainer's search evaluation all take their
PPM through here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kubestar.api.errors import KubestarError
from kubestar.common.net import check_grpc_serving
from kubestar.scoring.client import ScoringClient
from kubestar.search.mcts import Scorer
from kubestar.search.ppm_data import Encode, path_token_ids
from kubestar.search.tree import Node
from kubestar.v1 import scoring_pb2 as pb


@dataclass(frozen=True)
class PpmSource:
    """Where the PPM is: a folder to serve in this process, or a running scoring service."""

    folder: str = ""
    endpoint: str = ""
    device: str = "auto"
    tokenizer_sha256: str = ""  # of the policy's tokenizer: the PPM must read ids alike
    # What names the endpoint in an error (a flag, or a spec field).
    endpoint_option: str = "--ppm-endpoint"


@asynccontextmanager
async def ppm_scorer(source: PpmSource, encode: Encode) -> AsyncIterator[Scorer | None]:
    """The PPM as the search's Scorer (None without one); a folder is served on a free port
    of 127.0.0.1 for as long as the block runs."""
    if not source.folder and not source.endpoint:
        yield None
        return
    server = None
    endpoint, token = source.endpoint, None
    if source.folder:
        from kubestar.scoring.server import ScoringServer, ServerConfig  # torch: when used

        server = ScoringServer(
            ServerConfig(model=source.folder, listen="127.0.0.1:0", device=source.device)
        )
        await server.start()
        endpoint, token = f"127.0.0.1:{server.port}", ""
    else:
        await check_grpc_serving(endpoint, source.endpoint_option)
    client = ScoringClient(endpoint, timeout=600.0, token=token)
    try:
        yield PpmScorer(client, encode, source.tokenizer_sha256)
    finally:
        await client.close()
        if server is not None:
            await server.stop(grace_seconds=1.0)


class TokenizerMismatch(KubestarError, ValueError):
    """The scoring server's model reads token ids with another tokenizer than the policy's."""


class PpmScorer:
    """The search's `Scorer` (kubestar.search.mcts) on a scoring server: a node's value is
    the PPM's squashed reward of the token ids along its path (`path_token_ids`: the
    root's prompt ids, each step's ids and its encoded observation).

    `encode` turns observation text into ids with the policy's tokenizer. Give
    `tokenizer_sha256` (`kubestar.engine.models.tokenizer_sha256` of the policy's model
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
