"""Services on this machine: a free port to bind, and waiting until a gRPC server serves.

Used wherever kubestar starts its own services as local processes (`kubestar train -f`,
`kubestar eval`) and by the tests and benchmarks that do the same.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice; bind it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
