"""The sandbox's HTTP front: the dialects of the sandboxes verl and rStar2-Agent users already
call, served by a sandbox server (worker or dispatcher) next to its gRPC service, on the same
backend, so with the same executors, queue, limits and isolation.

- SandboxFusion's (`kubestar.sandbox.sandbox_fusion`): `POST /run_code`, `GET /v1/ping`.
- code-judge's (`kubestar.sandbox.code_judge`): `POST /run`, `/run/batch`, `/run/long-batch`,
  `GET /ping`.

Both are written with `kubestar.sandbox.http_dialect` (request fields, errors, running calls).

Both peers are FastAPI services, so bad input is answered as FastAPI answers it: HTTP 422 with
`{"detail": [{"type", "loc", "msg"}]}`, where `msg` is one line that names the field. Other
errors are `{"detail": "..."}` with their status (401, 404, 413, 503); never a traceback.

Authentication: the installation's token, when there is one, as `Authorization: Bearer
TOKEN` or as HTTP Basic credentials whose password is the token. The second is what a client
that cannot set headers sends when the token is in its URL (`http://kubestar:TOKEN@host:port/
run_code`): verl's SandboxFusion utilities (requests) and the rStar2-Agent recipe (aiohttp)
both turn a URL's credentials into that header. The ping paths stay open, for probes.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from kubestar.common.auth import refusal
from kubestar.common.bounds import ServiceBounds
from kubestar.common.net import check_can_listen
from kubestar.sandbox import code_judge, sandbox_fusion
from kubestar.sandbox.backend import Backend
from kubestar.sandbox.http_dialect import FieldError, Runner, detail, unprocessable
from kubestar.sandbox.limits import MAX_REQUEST_BYTES, LimitPolicy, MiB

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Probes: open without the token.
OPEN_PATHS = frozenset({"/v1/ping", "/ping"})


# ---- the server ---------------------------------------------------------------------------

Routes = Callable[[web.Application, Runner], None]


class HttpFront:
    """The HTTP dialects of one sandbox server, on their own address (`--http-listen`)."""

    def __init__(
        self,
        listen: str,
        backend: Backend,
        policy: LimitPolicy,
        auth_token: str = "",
        bounds: ServiceBounds | None = None,
    ) -> None:
        self.listen = listen
        self.runner = Runner(backend, policy)
        self.auth_token = auth_token
        # Requests in progress, as the gRPC server bounds its RPCs: more are refused (503).
        self.max_requests = (bounds or ServiceBounds()).max_concurrent_rpcs
        self.requests = 0
        self._app_runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_REQUEST_BYTES)
        for routes in (sandbox_fusion.add_routes, code_judge.add_routes):
            routes(app, self.runner)
        return app

    async def start(self) -> None:
        check_can_listen(self.listen, "--http-listen")
        host, _, port = self.listen.rpartition(":")
        self._app_runner = web.AppRunner(self.app(), access_log=None)
        await self._app_runner.setup()
        site = web.TCPSite(
            self._app_runner, host.strip("[]") or "0.0.0.0", int(port), reuse_port=False
        )
        await site.start()
        self.port = int(self._app_runner.addresses[0][1])
        log.info(
            "sandbox http serving",
            extra={"fields": {"listen": self.listen, "port": self.port}},
        )

    async def stop(self) -> None:
        if self._app_runner is not None:
            await self._app_runner.cleanup()
            self._app_runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.auth_token and request.path not in OPEN_PATHS:
            why = refusal(bearer(request.headers.get("Authorization")), self.auth_token)
            if why:
                return detail(why, 401, {"WWW-Authenticate": 'Bearer realm="kubestar"'})
        if self.requests >= self.max_requests:
            return detail(
                f"this sandbox has {self.max_requests} requests in progress: retry later", 503
            )
        self.requests += 1
        try:
            return await handler(request)
        except FieldError as error:
            return unprocessable(error.loc, error.message, error.kind)
        except web.HTTPRequestEntityTooLarge:
            return detail(f"the request body is over {MAX_REQUEST_BYTES // MiB} MiB: split it", 413)
        except web.HTTPException as error:  # 404, 405: FastAPI's shape
            if error.status >= 400:
                return detail(error.reason, error.status)
            raise
        except Exception as error:
            log.exception("sandbox http request failed")
            return detail(f"internal error: {type(error).__name__}: {error}", 500)
        finally:
            self.requests -= 1


def bearer(authorization: str | None) -> str | None:
    """`Authorization` as kubestar's check takes it: a Basic header becomes `Bearer PASSWORD`
    (the token travels as the password of a URL's credentials)."""
    if not authorization:
        return authorization
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return authorization
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("latin-1")
    except (binascii.Error, ValueError):
        return None
    return f"Bearer {decoded.partition(':')[2]}"
