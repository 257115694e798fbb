"""ASGI middleware for a vLLM engine's server: every path but /health, /ping and /metrics
requires the installation's bearer token (`Authorization: Bearer TOKEN`).

vLLM's own `--api-key` guards only its /v1 paths, while the development endpoints the trainer
pushes weights through (/collective_rpc, /pause, /reset_prefix_cache, ...) stay open; this
guards them all. vLLM applies it with `--middleware
kubestar.engine.auth_middleware.BearerTokenMiddleware` (`app.add_middleware(cls)`, which
passes only the app), so the token comes from the environment: the file named by
KUBESTAR_AUTH_TOKEN_FILE, else KUBESTAR_AUTH_TOKEN. Without either the server does not start.

The module imports nothing but the standard library: images that have vLLM but not kubestar
(vLLM's own GPU images) load it from a copy of this file (see
kubestar.operator.build_fleet).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

ENV_TOKEN_FILE = "KUBESTAR_AUTH_TOKEN_FILE"
ENV_TOKEN = "KUBESTAR_AUTH_TOKEN"
# What probes and scrapers reach without the token.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MISSING = (
    "this engine requires the installation's bearer token (Authorization: Bearer TOKEN): "
    f"set {ENV_TOKEN_FILE} to a file that holds it (or {ENV_TOKEN} to the token)"
)
WRONG = (
    f"the bearer token is not this engine's: {ENV_TOKEN_FILE} (or {ENV_TOKEN}) must hold the "
    "installation's token"
)


def token_from_environment(environ: MutableMapping[str, str] | None = None) -> str:
    """The token the engine requires; raises RuntimeError (the server does not start) when
    none is configured or its file cannot be read."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_TOKEN_FILE, "")
    if path:
        try:
            with open(path) as handle:
                token = handle.read().strip()
        except OSError as error:
            raise RuntimeError(
                f"cannot read the auth token file {path} ({ENV_TOKEN_FILE}): {error.strerror}"
            ) from None
        where = f"the auth token file {path}"
    else:
        token = env.get(ENV_TOKEN, "").strip()
        where = ENV_TOKEN
    if not token:
        raise RuntimeError(
            f"{where} is empty or unset: the engine's auth middleware needs the installation's "
            f"token in the file {ENV_TOKEN_FILE} names (or in {ENV_TOKEN})"
        )
    return token


def refusal(authorization: bytes | None, token: bytes) -> str | None:
    """Why a request with this Authorization header is refused (None: accepted)."""
    if not authorization:
        return MISSING
    scheme, _, presented = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not presented:
        return MISSING
    if not hmac.compare_digest(presented.strip(), token):
        return WRONG
    return None


class BearerTokenMiddleware:
    """Pure ASGI: HTTP and WebSocket requests off OPEN_PATHS need the token; a refused HTTP
    request gets 401 with a JSON body naming what to set, a WebSocket is closed (1008)."""

    def __init__(self, app: App, token: str | None = None) -> None:
        self.app = app
        self._token = (token or token_from_environment()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path.rstrip("/") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                authorization = value
                break
        problem = refusal(authorization, self._token)
        if problem is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
            return
        body = json.dumps({"error": problem}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
