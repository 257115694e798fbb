"""The installation's bearer token: kubestar's services (sandbox, rollout scheduler, engines)
require it of their callers when one is configured.

A process finds the token in a file named by a flag (`--auth-token-file`) or by
KUBESTAR_AUTH_TOKEN_FILE, or in KUBESTAR_AUTH_TOKEN itself; with none of them it neither
requires nor sends one (a laptop's local runs). On a cluster the chart makes one random token
per installation (a Secret); the operator derives each namespace's own from it
(`namespace_token`) and mounts that, as a file, into every pod of the namespace that serves
or calls these services. A namespace's token opens its own services only: one tenant's
Secrets give nothing to call another's with.

Callers send `authorization: Bearer TOKEN`: gRPC metadata, or an HTTP header. Servers compare
it in constant time and refuse anything else, gRPC with UNAUTHENTICATED, HTTP with 401; gRPC
health checks stay open to probes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from kubestar.api.errors import KubestarError

ENV_TOKEN_FILE = "KUBESTAR_AUTH_TOKEN_FILE"
ENV_TOKEN = "KUBESTAR_AUTH_TOKEN"
HEADER = "authorization"
SCHEME = "bearer"
# Probes (the kubelet's, a dispatcher's watch of its workers) need no token.
HEALTH_SERVICE = "grpc.health.v1.Health"

MISSING = (
    f"this server requires the installation's bearer token (`{HEADER}: Bearer TOKEN`): "
    f"set {ENV_TOKEN_FILE} to a file that holds it (or {ENV_TOKEN} to the token)"
)
WRONG = (
    f"the bearer token is not this server's: {ENV_TOKEN_FILE} (or {ENV_TOKEN}) must hold "
    "this namespace's token (the Secret the operator made beside the resource)"
)


def namespace_token(token: str, namespace: str) -> str:
    """The token of `namespace`'s services and callers: an HMAC of the namespace under the
    installation's token (64 hex digits). Only the operator, which holds the installation's
    token, can make it; knowing one namespace's token tells nothing of another's."""
    message = f"kubestar.dev/namespace/{namespace}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


class AuthConfigError(KubestarError):
    """The configured token cannot be used (an unreadable or empty file, a malformed token)."""


def check_token(token: str, where: str) -> str:
    """`token` when it can travel in a header (printable ASCII, no spaces), else raises."""
    if not token:
        raise AuthConfigError(f"{where} is empty: it must hold the installation's token")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise AuthConfigError(
            f"{where}: the token must be printable ASCII without spaces (a random string)"
        )
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace and newlines dropped)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise AuthConfigError(f"cannot read the auth token file {path}: {reason}") from None
    return check_token(text.strip(), f"the auth token file {path}")


def load_token(token_file: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The token from `token_file`, else $KUBESTAR_AUTH_TOKEN_FILE, else $KUBESTAR_AUTH_TOKEN;
    "" when none is configured."""
    env = os.environ if environ is None else environ
    path = token_file or env.get(ENV_TOKEN_FILE, "")
    if path:
        return read_token_file(path)
    token = env.get(ENV_TOKEN, "").strip()
    return check_token(token, ENV_TOKEN) if token else ""


def client_token(token: str | None = None) -> str:
    """What a client sends: `token` when given ("" sends none), else the environment's."""
    return load_token() if token is None else token


def header_value(token: str) -> str:
    return f"Bearer {token}"


def call_metadata(token: str) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata that carries `token` (None without a token)."""
    return ((HEADER, header_value(token)),) if token else None


def refusal(authorization: str | bytes | None, token: str) -> str | None:
    """Why a request with this `authorization` value is refused by a server that requires
    `token` (None: accepted)."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    if not authorization:
        return MISSING
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME or not presented:
        return MISSING
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return WRONG
    return None


def _metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key.lower() == HEADER:
            return value
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without the token (UNAUTHENTICATED, one line saying what to set),
    except to `open_services` (gRPC health by default)."""

    def __init__(self, token: str, open_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        self._token = check_token(token, "the server's auth token")
        self._open = frozenset(open_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        service = method.lstrip("/").partition("/")[0]
        if handler is None or service in self._open:
            return handler
        metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
        problem = refusal(_metadata_value(metadata), self._token)
        if problem is None:
            return handler
        return _refusing(handler, problem)


def _unparsed(_: bytes) -> None:
    """The request of a refused call: its bytes are never parsed."""


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that refuses the call without parsing its request (a
    caller without the token costs no protobuf decoding, however large its message)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[type-arg]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serializers: dict[str, Any] = {
        "request_deserializer": _unparsed,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """What a kubestar gRPC server is built with: the token check when `token` is set."""
    return [BearerTokenInterceptor(token)] if token else []
