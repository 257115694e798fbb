"""The scoring service with a real tiny PPM on 127.0.0.1: scores equal the model's own,
concurrent requests share forward passes (read from the server's metrics), bad input is
INVALID_ARGUMENT naming the field, the installation's token is required, health, the
search's Scorer on the service, and `kubestar ppm serve`."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.real_parts import REPO, require_modules, tiny_model

require_modules("torch", "transformers", "safetensors")

import torch  # noqa: E402
from kubestar.common.net import free_port  # noqa: E402
from kubestar.engine.models import tokenizer_sha256  # noqa: E402
from kubestar.scoring.batcher import BatchingConfig  # noqa: E402
from kubestar.scoring.client import ScoringClient  # noqa: E402
from kubestar.scoring.model import ProcessPreferenceModel, squash  # noqa: E402
from kubestar.scoring.server import SERVICE_NAME, ScoringServer, ServerConfig  # noqa: E402
from kubestar.search.ppm_data import path_token_ids  # noqa: E402
from kubestar.search.scorer import PpmScorer, TokenizerMismatch  # noqa: E402
from kubestar.search.tree import Node, add_children  # noqa: E402
from kubestar.training.chat import ChatTokenizer  # noqa: E402

TOKEN = "kubestar-test-token-0123456789abcdef"
MAX_TOKENS = 64
MAX_SEQUENCES = 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


@pytest.fixture(scope="module")
def ppm(model_dir: Path) -> ProcessPreferenceModel:
    """The tiny model with a head that gives spread-out scores (a fresh one scores ~0)."""
    model = ProcessPreferenceModel.load(model_dir, device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        torch.nn.init.normal_(model.head.summary.weight, std=2.0)
    return model.eval()


def config(**overrides: object) -> ServerConfig:
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "batching": BatchingConfig(max_batch_sequences=8, max_wait_ms=5.0),
        "max_sequence_tokens": MAX_TOKENS,
        "max_request_sequences": MAX_SEQUENCES,
        "drain_seconds": 2.0,
    }
    values.update(overrides)
    return ServerConfig(**values)  # type: ignore[arg-type]


async def started(ppm: ProcessPreferenceModel, **overrides: object) -> ScoringServer:
    server = ScoringServer(config(**overrides), model=ppm)
    await server.start()
    return server


@pytest.fixture
async def server(ppm: ProcessPreferenceModel) -> AsyncIterator[ScoringServer]:
    running = await started(ppm)
    yield running
    await running.stop(grace_seconds=2.0)


@pytest.fixture
async def client(server: ScoringServer) -> AsyncIterator[ScoringClient]:
    async with ScoringClient(f"127.0.0.1:{server.port}", timeout=60, token="") as scoring:
        yield scoring


def sequences(count: int, start: int = 100) -> list[list[int]]:
    """Sequences of different lengths (1 to 20 tokens)."""
    return [list(range(start + i, start + i + 1 + (i * 7) % 20)) for i in range(count)]


def direct(ppm: ProcessPreferenceModel, rows: list[list[int]]) -> list[float]:
    """The model's own scores, one sequence per forward pass."""
    return [ppm.score([row])[0] for row in rows]


def value(server: ScoringServer, name: str, labels: dict[str, str] | None = None) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


async def health_status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        status: int = response.status
        return status


async def test_scores_equal_the_models_direct_scores(
    client: ScoringClient, ppm: ProcessPreferenceModel
) -> None:
    rows = sequences(5)
    rewards = await client.score(rows)
    assert [r.raw for r in rewards] == pytest.approx(direct(ppm, rows), rel=1e-5, abs=1e-6)
    assert len({round(r.raw, 4) for r in rewards}) == 5  # the head tells them apart
    for reward in rewards:
        assert reward.squashed == pytest.approx(math.tanh(reward.raw / 5))


async def test_concurrent_requests_are_answered_in_shared_batches(
    ppm: ProcessPreferenceModel,
) -> None:
    """Eight requests of one sequence each, at once: a batch closes when it holds eight (the
    long wait is never reached), so all of them share one forward pass."""
    server = await started(
        ppm, batching=BatchingConfig(max_batch_sequences=8, max_wait_ms=30_000.0)
    )
    rows = sequences(8)
    try:
        async with ScoringClient(f"127.0.0.1:{server.port}", timeout=60, token="") as client:
            answers = await asyncio.gather(*(client.score([row]) for row in rows))
    finally:
        await server.stop(grace_seconds=2.0)
    raws = [answer[0].raw for answer in answers]
    assert raws == pytest.approx(direct(ppm, rows), rel=1e-5, abs=1e-6)
    assert value(server, "kubestar_scoring_requests_total", {"code": "ok"}) == 8
    assert value(server, "kubestar_scoring_batches_total") == 1
    assert value(server, "kubestar_scoring_batch_sequences_sum") == 8
    assert value(server, "kubestar_scoring_sequences_total") == 8
    assert value(server, "kubestar_scoring_queued_sequences") == 0


async def test_a_large_request_spans_batches_and_keeps_its_order(
    client: ScoringClient, server: ScoringServer, ppm: ProcessPreferenceModel
) -> None:
    rows = sequences(20)
    rewards = await client.score(rows)
    assert [r.raw for r in rewards] == pytest.approx(direct(ppm, rows), rel=1e-5, abs=1e-6)
    # All 20 queue at once: batches of 8, 8 and 4.
    assert value(server, "kubestar_scoring_batches_total") == 3
    assert value(server, "kubestar_scoring_batch_sequences_count") == 3
    assert value(server, "kubestar_scoring_batch_sequences_bucket", {"le": "8.0"}) == 3
    assert value(server, "kubestar_scoring_batch_sequences_bucket", {"le": "4.0"}) == 1


async def test_a_batch_stays_within_its_token_budget(ppm: ProcessPreferenceModel) -> None:
    """Rows x the longest row never passes max_batch_tokens: the sequence that would push a
    batch past it opens the next one."""
    batching = BatchingConfig(max_batch_sequences=8, max_batch_tokens=64, max_wait_ms=5.0)
    server = await started(ppm, batching=batching)
    rows = [list(range(10, 26))] * 4 + [list(range(10, 74))]  # 4 x 16 tokens, then 64
    try:
        async with ScoringClient(f"127.0.0.1:{server.port}", timeout=60, token="") as client:
            rewards = await client.score(rows)
    finally:
        await server.stop(grace_seconds=2.0)
    assert [r.raw for r in rewards] == pytest.approx(direct(ppm, rows), rel=1e-5, abs=1e-6)
    assert value(server, "kubestar_scoring_batches_total") == 2
    assert value(server, "kubestar_scoring_batch_tokens_sum") == 64 + 64


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "sequences: empty"),
        ([[1, 2], []], "sequences[1].token_ids: empty"),
        ([[1] * (MAX_TOKENS + 1)], f"sequences[0].token_ids: {MAX_TOKENS + 1} tokens, at most"),
        ([[1]] * (MAX_SEQUENCES + 1), f"sequences: {MAX_SEQUENCES + 1} sequences, at most"),
        ([[1], [2, 49152]], "sequences[1].token_ids: token id 49152 is outside the vocabulary"),
        ([[-3]], "sequences[0].token_ids: token id -3 is outside"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    client: ScoringClient, server: ScoringServer, rows: list[list[int]], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.score(rows)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details() or ""
    assert details.startswith(message) and "\n" not in details
    assert value(server, "kubestar_scoring_requests_total", {"code": "invalid-argument"}) == 1
    assert value(server, "kubestar_scoring_sequences_total") == 0  # nothing ran


async def test_model_info_and_health(
    client: ScoringClient, server: ScoringServer, model_dir: Path
) -> None:
    info = await client.model_info()
    assert info.model == str(model_dir) and info.vocab_size == 49152
    assert info.tokenizer_sha256 == tokenizer_sha256(model_dir) != ""
    assert (info.max_sequence_tokens, info.max_request_sequences) == (MAX_TOKENS, MAX_SEQUENCES)
    assert info.reward_scale == 5.0 and info.max_batch_sequences == 8
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.SERVING


async def test_the_installations_token_is_required(ppm: ProcessPreferenceModel) -> None:
    server = await started(ppm, auth_token=TOKEN)
    endpoint = f"127.0.0.1:{server.port}"
    try:
        for token in ("", TOKEN[:-1] + "0"):
            async with ScoringClient(endpoint, timeout=30, token=token) as client:
                for call in (lambda: client.score([[1, 2]]), client.model_info):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await call()
                    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert value(server, "kubestar_scoring_sequences_total") == 0
        # Health stays open to probes.
        assert await health_status(server.port) == health_pb2.HealthCheckResponse.SERVING
        async with ScoringClient(endpoint, timeout=30, token=TOKEN) as client:
            assert len(await client.score([[1, 2]])) == 1
    finally:
        await server.stop(grace_seconds=2.0)


def tree(prompt_ids: list[int]) -> list[Node]:
    root = Node.root("question", prompt_ids)
    a, b = add_children(root, [("step a", [300, 301]), ("step b", [302])])
    a.observation = " printed 7"
    (a1,) = add_children(a, [("answer", [303, 304, 305])])
    return [a, b, a1]


async def test_the_search_scorer_values_each_nodes_path(
    client: ScoringClient, ppm: ProcessPreferenceModel, model_dir: Path
) -> None:
    encode = ChatTokenizer.from_model(model_dir).encode
    scorer = PpmScorer(client, encode, tokenizer_sha256(model_dir))
    nodes = tree([400, 401, 402])
    values = await scorer.score(nodes)
    expected = [squash(s) for s in direct(ppm, [path_token_ids(n, encode) for n in nodes])]
    assert values == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert await scorer.score([]) == []
    # A path longer than the server takes keeps its last tokens.
    (deep,) = tree(list(range(1000, 1000 + MAX_TOKENS)))[2:]
    ids = path_token_ids(deep, encode)
    assert len(ids) > MAX_TOKENS
    (cut,) = await scorer.score([deep])
    assert cut == pytest.approx(squash(ppm.score([ids[-MAX_TOKENS:]])[0]), rel=1e-5, abs=1e-6)
    # More nodes than one request may hold go in several requests.
    many = [nodes[2]] * (MAX_SEQUENCES + 3)
    assert await scorer.score(many) == pytest.approx([expected[2]] * len(many), abs=1e-6)
    with pytest.raises(TokenizerMismatch, match="tokenizer differs"):
        await PpmScorer(client, encode, "0" * 64).score(nodes)


async def test_cli_serves_with_metrics_and_drains_on_sigterm(model_dir: Path) -> None:
    port, metrics_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBESTAR_AUTH")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kubestar.cli.main",
        "ppm",
        "serve",
        "--model",
        str(model_dir),
        "--listen",
        endpoint,
        "--device",
        "cpu",
        "--metrics-port",
        str(metrics_port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    try:
        for _ in range(600):
            try:
                if await health_status(port) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        async with ScoringClient(endpoint, timeout=60, token="") as client:
            rewards = await client.score(sequences(3))
        assert len(rewards) == 3 and all(abs(r.squashed) < 1e-3 for r in rewards)  # fresh head
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        )
        assert b"kubestar_scoring_sequences_total 3.0" in metrics
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 60) == 0
        assert process.stdout is not None
        log = (await process.stdout.read()).decode()
        assert '"msg": "scoring serving"' in log and '"msg": "scoring stopped"' in log
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
