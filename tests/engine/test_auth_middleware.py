"""The engines' auth middleware: every path but /health, /ping and /metrics needs the
installation's bearer token (vLLM's --api-key guards only /v1, not the development endpoints
weights are pushed through). Checked on a small ASGI app, and applied the way vLLM applies a
`--middleware` class."""

from __future__ import annotations

import importlib.util
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE
from kubestar.engine.auth_middleware import BearerTokenMiddleware, Message, Receive, Scope, Send
from kubestar.engine.client import EngineClient, EngineError
from kubestar.engine.launch import AUTH_MIDDLEWARE, EngineSettings

from tests.real_parts import missing
from tests.scheduler.fake_engine import FakeEngine

TOKEN = "kubestar-test-token-0123456789abcdef"


class App:
    """Answers 200 to anything and remembers the paths it served."""

    def __init__(self) -> None:
        self.served: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            self.served.append("lifespan")
            return
        self.served.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def request(
    app: BearerTokenMiddleware, path: str, authorization: str | None = None, method: str = "POST"
) -> tuple[int, dict[str, Any]]:
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope: Scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": headers,
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(body) if status != 200 else {})


@pytest.mark.parametrize(
    "path", ["/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/v1/completions"]
)
async def test_paths_off_health_and_metrics_need_the_token(path: str) -> None:
    inner = App()
    app = BearerTokenMiddleware(inner, token=TOKEN)
    status, body = await request(app, path)
    assert status == 401 and ENV_TOKEN_FILE in body["error"]
    status, body = await request(app, path, f"Bearer {TOKEN[:-1]}0")
    assert status == 401 and "not this engine's" in body["error"]
    status, _ = await request(app, path, f"Basic {TOKEN}")
    assert status == 401
    assert inner.served == []
    status, _ = await request(app, path, f"Bearer {TOKEN}")
    assert status == 200 and inner.served == [path]


@pytest.mark.parametrize("path", ["/health", "/ping", "/metrics"])
async def test_probes_and_scrapes_need_no_token(path: str) -> None:
    inner = App()
    status, _ = await request(BearerTokenMiddleware(inner, token=TOKEN), path, method="GET")
    assert status == 200 and inner.served == [path]


async def test_a_lookalike_path_is_not_open() -> None:
    app = BearerTokenMiddleware(App(), token=TOKEN)
    for path in ("/health/../collective_rpc", "/healthz", "/metrics/../pause", "/v1/health"):
        assert (await request(app, path))[0] == 401


async def test_lifespan_passes_and_a_websocket_without_the_token_is_closed() -> None:
    inner = App()
    app = BearerTokenMiddleware(inner, token=TOKEN)

    async def nothing() -> Message:
        return {}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, nothing, send)
    assert inner.served == ["lifespan"]
    await app({"type": "websocket", "path": "/v1/realtime", "headers": []}, nothing, send)
    assert sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008


def test_the_token_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    with pytest.raises(RuntimeError, match=ENV_TOKEN_FILE):
        BearerTokenMiddleware(App())
    monkeypatch.setenv(ENV_TOKEN_FILE, str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match="cannot read the auth token file"):
        BearerTokenMiddleware(App())
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(ENV_TOKEN_FILE, str(tmp_path / "token"))
    BearerTokenMiddleware(App())


def test_vllm_applies_the_middleware_to_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `vllm serve --middleware kubestar.engine.auth_middleware.BearerTokenMiddleware`
    does: vLLM's own registration (app.add_middleware with the class alone)."""
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    (tmp_path / "token").write_text(TOKEN)
    monkeypatch.setenv(ENV_TOKEN_FILE, str(tmp_path / "token"))
    app = FastAPI()
    for path in ("/collective_rpc", "/pause", "/health"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST", "GET"])
    args = Namespace(
        allowed_origins=["*"],
        allow_credentials=False,
        allowed_methods=["*"],
        allowed_headers=["*"],
        api_key=None,
        enable_request_id_headers=False,
        middleware=[AUTH_MIDDLEWARE],
    )
    init_entrypoints_middleware(args, app, ())
    with TestClient(app) as client:
        assert client.post("/collective_rpc").status_code == 401
        assert client.post("/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
        authorized = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/collective_rpc", headers=authorized).status_code == 200
        assert client.get("/health").status_code == 200


def test_launch_passes_the_middleware_only_with_a_token_file() -> None:
    def middleware(command: list[str]) -> list[str]:
        return [command[i + 1] for i, arg in enumerate(command) if arg == "--middleware"]

    weights = "kubestar.engine.weight_sync.WeightRoutes"
    plain = EngineSettings(model="m")
    assert middleware(plain.command()) == [weights]
    guarded = EngineSettings(model="m", auth_token_file="/var/run/secrets/kubestar/auth/token")
    # Last, so outermost: the token is checked before the weights route.
    assert middleware(guarded.command()) == [weights, AUTH_MIDDLEWARE]
    assert guarded.environment()[ENV_TOKEN_FILE] == "/var/run/secrets/kubestar/auth/token"


async def test_the_engine_client_sends_the_token() -> None:
    async with FakeEngine(token=TOKEN) as engine:
        client = EngineClient(engine.url, timeout=10, token=TOKEN)
        try:
            await client.load_weights("/weights/step-1")
            assert (await client.complete([1, 2, 3], 2)).token_ids
        finally:
            await client.close()
        assert engine.reloads == ["/weights/step-1"] and engine.refused == 0
        anonymous = EngineClient(engine.url, timeout=10, token="")
        try:
            with pytest.raises(EngineError) as error:
                await anonymous.load_weights("/weights/step-2")
            assert error.value.status == 401
            assert await anonymous.healthy()
        finally:
            await anonymous.close()
