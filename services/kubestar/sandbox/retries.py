"""The sandbox's own failures, told apart from the code's, and how its callers try again.

Two layers ask again:

* `SandboxClient` asks again, after RETRY_DELAYS, a server that refused an RPC before any
  call of it ran (`refused_before_running`): asking again is always safe.
* The executors above it (the trainer's stream and batch executors, the search's
  `SandboxExecutor`) see what got through: an RPC that failed (`rpc_failure` says how) or a
  result whose status says the sandbox, not the code, failed (`infra_failed`). They send
  such calls again as `SandboxRetries` says; a call still failed after the last attempt is
  answered `internal_result` (the trainer) or stops the search.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from kubestar.sandbox.metrics import status_label
from kubestar.v1 import sandbox_pb2 as pb

T = TypeVar("T")

# Waits before asking again a server that refused an RPC before running it: unreachable
# (UNAVAILABLE: restarting, or a stream refused while a connection starts) or over its bound
# on RPCs at once (RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!"). Some 25 s in all: a
# burst of a step's calls is slowed, not lost. A request too large is refused for good.
RETRY_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0)

# Statuses of a result that are the service's fault, not the code's (`unspecified`: an answer
# without a status, which no healthy sandbox sends).
INFRA_STATUSES = frozenset({"queue-timeout", "internal", "unspecified"})


def refused_before_running(error: grpc.RpcError) -> bool:
    """The server refused the RPC before any call of it ran: asking again is safe."""
    code = error.code()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = error.details() or ""  # type: ignore[attr-defined]
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in details


def with_retries(delays: Sequence[float], rpc: Callable[[], T]) -> T:
    for delay in (*delays, None):
        try:
            return rpc()
        except grpc.RpcError as error:
            if delay is None or not refused_before_running(error):
                raise
            time.sleep(delay)
    raise AssertionError("unreachable")


async def with_retries_async(delays: Sequence[float], rpc: Callable[[], Awaitable[T]]) -> T:
    for delay in (*delays, None):
        try:
            return await rpc()
        except grpc.RpcError as error:
            if delay is None or not refused_before_running(error):
                raise
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def infra_failed(result: pb.ExecutionResult) -> bool:
    """The sandbox failed the call itself (its status is in INFRA_STATUSES): the result says
    nothing about the code."""
    return status_label(result.status) in INFRA_STATUSES


def rpc_failure(what: str, error: grpc.RpcError) -> str:
    """What an executor says of an RPC of `what` ("stream", "batch") that failed."""
    return f"sandbox {what} failed: {error.code()}: {error.details()}"  # type: ignore[attr-defined]


def internal_result(call_id: str, message: str) -> pb.ExecutionResult:
    """The answer to a call the sandbox failed for good: status `internal`, saying why."""
    return pb.ExecutionResult(id=call_id, status=pb.EXECUTION_STATUS_INTERNAL, message=message)


@dataclass(frozen=True)
class SandboxRetries:
    """How often a call the sandbox failed is sent: `attempts` in all (at least one), the
    next one `delay` x n seconds after its n-th failure."""

    attempts: int = 3
    delay: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "attempts", max(1, self.attempts))

    def again(self, failures: int) -> bool:
        """Whether a call that failed `failures` times is sent again."""
        return failures < self.attempts

    async def wait(self, failures: int) -> None:
        """The pause before sending again a call that failed `failures` times."""
        await asyncio.sleep(self.delay * failures)

    async def run(self, attempt: Callable[[int], Awaitable[bool]]) -> bool:
        """`attempt(n)` for n = 1, 2, ... until it returns True (done), waiting between
        failures; False when the last attempt failed too."""
        failures = 0
        while not await attempt(failures + 1):
            failures += 1
            if not self.again(failures):
                return False
            await self.wait(failures)
        return True


# Three attempts, the second 0.5 s after the first failure, the third 1 s after the second.
DEFAULT_RETRIES = SandboxRetries()
