"""Services on this machine: a free port to bind (below the kernel's ephemeral range), an
address checked before a server binds it, and waiting until a gRPC server serves.

Used wherever kubestar starts its own services as local processes (`kubestar train -f`,
`kubestar eval`) and by the tests and benchmarks that do the same.
"""

from __future__ import annotations

import collections
import contextlib
import random
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.api.errors import KubestarError
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

# The servers kubestar starts on this machine take ports below the kernel's ephemeral range
# (32768-60999 by default) and below Kubernetes' NodePorts (30000-32767): between choosing a
# port and binding it (an engine binds after loading its model, tens of seconds later), a
# port there cannot be handed to another process's bind to port 0 (Ray's processes make
# dozens) or to an outgoing connection.
SERVER_PORTS = range(20000, 30000)
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports this process handed out lately, not bound yet perhaps (a stack chooses all its ports
# before its engines bind theirs): not handed out again.
_handed_out: collections.deque[int] = collections.deque(maxlen=1000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now and not handed out lately by this process, from
    SERVER_PORTS below the kernel's ephemeral range (the kernel's choice where that range
    leaves none free); bind it soon."""
    ports = range(SERVER_PORTS.start, min(SERVER_PORTS.stop, _ephemeral_start()))
    for port in random.sample(ports, min(64, len(ports))):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class CannotListen(KubestarError, OSError):
    """An address a server was told to listen on is taken (or not this machine's)."""


def check_can_listen(address: str, option: str) -> None:
    """Raise CannotListen, naming `address` and the `option` that gave it, when a server could
    not bind it: found before gRPC tries (which logs lines of its own) or a metrics server
    fails with an error that names no address."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port_text.isdigit() or int(port_text) == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return  # no such address family here: the server's own bind decides
    with sock:
        # As a server binds: a port left in TIME_WAIT is free, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port_text)))
        except OSError as error:
            raise CannotListen(
                f"{option} {address}: {error.strerror}: pick another address"
            ) from None


def start_metrics_server(port: int, address: str, registry: CollectorRegistry = REGISTRY) -> None:
    """Prometheus metrics on http://ADDRESS:PORT/metrics (from --metrics-port/--metrics-address)."""
    check_can_listen(f"{address}:{port}", "--metrics-port")
    start_http_server(port, addr=address, registry=registry)


class ServiceUnreachable(KubestarError, ConnectionError):
    """A service a command was pointed at does not answer."""


async def check_grpc_serving(endpoint: str, option: str, timeout: float = 10.0) -> None:
    """Raise ServiceUnreachable, naming `option` and `endpoint`, unless the gRPC server there
    answers its health check: checked before work starts, so that a wrong address is one clear
    error rather than every request failing."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
            reason = "nothing answers" if code == grpc.StatusCode.UNAVAILABLE else str(code)
            raise ServiceUnreachable(
                f"{option} {endpoint}: {reason}: start the service, or give the address it "
                "listens on"
            ) from None


async def check_http_serving(url: str, option: str, timeout: float = 10.0) -> None:
    """The same for an HTTP server (a vLLM engine): its /health answers 200."""
    health = f"{url.rstrip('/')}/health"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(health) as response,
        ):
            if response.status == 200:
                return
            reason = f"{health} answered HTTP {response.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        reason = f"nothing answers ({type(error).__name__})"
    raise ServiceUnreachable(
        f"{option} {url}: {reason}: start the engine, or give the URL it listens on"
    )


def wait_serving(
    endpoint: str,
    process: subprocess.Popen[bytes] | None = None,
    *,
    what: str = "server",
    timeout: float = 180.0,
    log: Path | None = None,
    service: str = "",
    interval: float = 0.3,
) -> None:
    """Until the gRPC health check of `endpoint` (for `service`; "": the whole server) says
    SERVING. Raises RuntimeError when `process` exits first (naming `log`, where its output
    went), TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with {process.returncode}" + (f"; see {log}" if log else "")
                )
            with contextlib.suppress(grpc.RpcError):
                request = health_pb2.HealthCheckRequest(service=service)
                answer = stub.Check(request, timeout=2)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} at {endpoint} not serving after {timeout:g}s")
            time.sleep(interval)
