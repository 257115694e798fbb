"""The PPM as the search's `Scorer`, wherever it lives: a folder served in this process, or a
running scoring service. `kubestar solve`, `kubestar eval --search`, `kubestar evolve` and the
trainer's search evaluation all take their PPM through here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubestar.search.mcts import Scorer
    from kubestar.search.ppm_data import Encode


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
    from kubestar.common.net import check_grpc_serving
    from kubestar.scoring.client import PpmScorer, ScoringClient

    if not source.folder and not source.endpoint:
        yield None
        return
    server = None
    endpoint, token = source.endpoint, None
    if source.folder:
        from kubestar.scoring.server import ScoringServer, ServerConfig

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
