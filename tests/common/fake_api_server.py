"""A stand-in Kubernetes API server on 127.0.0.1 for the tests of kubestar's API client and
of what uses it (the trainer's status patcher, the scheduler's engine discovery).

It serves on an event loop of its own in a background thread, so blocking callers and async
ones on pytest's loop can both call it. It records every request and answers each
(method, path) with what the test set in `responses` (404 otherwise). `in_cluster` lays out
what a pod would see: a service-account directory and KUBERNETES_SERVICE_HOST/PORT.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from aiohttp import web
from kubestar.common import kube

from tests.real_parts import missing

NOT_FOUND = {"kind": "Status", "status": "Failure", "reason": "NotFound", "message": "not here"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass(frozen=True)
class Certificate:
    """A self-signed certificate for 127.0.0.1: the server's and, as ca.crt, the CA a client
    trusts."""

    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path) -> Certificate:
        if shutil.which("openssl") is None:
            missing("openssl is not installed (it makes the test API server's certificate)")
        cert, key = directory / "server.crt", directory / "server.key"
        request = "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1"
        san = "subjectAltName=IP:127.0.0.1"
        subprocess.run(
            ["openssl", *request.split(), "-addext", san, "-keyout", str(key), "-out", str(cert)],
            check=True,
            capture_output=True,
        )
        return cls(cert, key)


class FakeApiServer:
    def __init__(self, certificate: Certificate | None = None) -> None:
        self.certificate = certificate
        self.requests: list[Request] = []
        self.responses: dict[tuple[str, str], tuple[int, Any]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="fake-api-server", daemon=True
        )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.certificate else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def answer(self, method: str, path: str, body: Any, status: int = 200) -> None:
        self.responses[method, path] = (status, body)

    async def _handle(self, request: web.Request) -> web.Response:
        text = await request.text()
        self.requests.append(
            Request(
                request.method,
                request.path,
                dict(request.query),
                dict(request.headers),
                json.loads(text) if text else None,
            )
        )
        status, body = self.responses.get((request.method, request.path), (404, NOT_FOUND))
        return web.json_response(body, status=status)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        context = None
        if self.certificate is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.certificate.cert, self.certificate.key)
        await web.SockSite(self._runner, self.sock, ssl_context=context).start()

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.sock.close()


def in_cluster(
    monkeypatch: pytest.MonkeyPatch,
    directory: Path,
    server: FakeApiServer,
    token: str = "service-account-token",
    namespace: str = "team",
) -> Path:
    """What a pod sees: its service account (token, ca.crt: the server's certificate,
    namespace) and the API server's address in KUBERNETES_SERVICE_HOST/PORT. Returns the
    token file (rewrite it to rotate the token)."""
    assert server.certificate is not None, "in cluster, the API server speaks TLS"
    account = directory / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(token + "\n")
    (account / "namespace").write_text(namespace)
    shutil.copy(server.certificate.cert, account / "ca.crt")
    monkeypatch.setattr(kube, "SA_DIR", account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return account / "token"
