"""Errors a person can act on: every failure the CLI expects becomes one line on stderr that
names the endpoint, file, field or port and says what to do; the traceback only with
`kubestar --debug` or KUBESTAR_DEBUG=1."""

from __future__ import annotations

import errno
import os
import re

from kubestar.api.errors import KubestarError

DEBUG_ENV = "KUBESTAR_DEBUG"
DEBUG_HINT = "(`kubestar --debug` or KUBESTAR_DEBUG=1 shows the traceback)"
# gRPC names the address it tried in its details: "ipv4:127.0.0.1:1: Failed to connect ...".
GRPC_TARGET = re.compile(r"(?:ipv4|ipv6|dns):(\[?[\w.:-]+\]?:\d+)")
GRPC_BIND = re.compile(r"Failed to bind to address (\S+?);")


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe(error: BaseException) -> str:
    """One line for `error`: what failed, where, and what to do."""
    if isinstance(error, KubestarError):
        return _one_line(str(error))
    grpc_message = _describe_grpc(error)
    if grpc_message:
        return grpc_message
    http_message = _describe_http(error)
    if http_message:
        return http_message
    if isinstance(error, OSError):
        return _describe_os_error(error)
    bind = GRPC_BIND.search(str(error))
    if bind:
        return f"{bind.group(1)}: cannot listen there (the port is in use?): pick another address"
    return f"{type(error).__name__}: {_one_line(str(error))} {DEBUG_HINT}"


def _describe_grpc(error: BaseException) -> str:
    try:
        import grpc
    except ImportError:
        return ""
    if not isinstance(error, grpc.RpcError) or not hasattr(error, "code"):
        return ""
    code = error.code()
    details = error.details() or ""
    found = GRPC_TARGET.search(details)
    where = found.group(1) if found else "the service"
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"{where}: nothing is serving there ({_reason(details)}): start the service, "
            "or give the endpoint it listens on"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{where}: no answer before the deadline: is the service overloaded or stuck?"
    return f"{where}: {code.name}: {_one_line(details)}"


def _describe_http(error: BaseException) -> str:
    try:
        import aiohttp
    except ImportError:
        return ""
    if isinstance(error, aiohttp.ClientConnectorError):
        return (
            f"{error.host}:{error.port}: cannot connect ({error.os_error.strerror or error}): "
            "start the service, or give the URL it listens on"
        )
    if isinstance(error, aiohttp.ClientResponseError):
        return f"{error.request_info.real_url}: HTTP {error.status} {error.message}"
    return ""


def _describe_os_error(error: OSError) -> str:
    where = error.filename or ""
    if error.errno == errno.EADDRINUSE:
        return f"{error.strerror}: pick another port"
    if error.errno == errno.ECONNREFUSED:
        return f"connection refused ({_one_line(str(error))}): is the service running?"
    if isinstance(error, FileNotFoundError) and where:
        return f"{where}: no such file or directory"
    if isinstance(error, PermissionError) and where:
        return f"{where}: permission denied"
    if error.errno is None:  # a message of its own, or none (a bare TimeoutError)
        return _one_line(str(error)) or f"{type(error).__name__} {DEBUG_HINT}"
    return f"{where + ': ' if where else ''}{error.strerror or _one_line(str(error))}"


def _reason(details: str) -> str:
    lowered = details.lower()
    if "connection refused" in lowered:
        return "connection refused"
    if "timeout" in lowered or "deadline" in lowered:
        return "no answer"
    return _one_line(details.rsplit(":", 1)[-1].strip()) or "unavailable"


def _one_line(text: str) -> str:
    return " ".join(text.split())
