"""What the gRPC service runs calls on: a local executor pool or a set of remote workers."""

from __future__ import annotations

import abc

from kubestar.sandbox.limits import CallLimits, LimitPolicy
from kubestar.v1 import sandbox_pb2 as pb


class Backend(abc.ABC):
    """Runs one call and always returns exactly one result for it (never raises for a call)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def drain(self, grace_seconds: float) -> None: ...

    @abc.abstractmethod
    async def execute(self, execution: pb.Execution) -> pb.ExecutionResult: ...

    @abc.abstractmethod
    async def get_capacity(self) -> pb.GetCapacityResponse: ...


def make_result(
    call_id: str, status: pb.ExecutionStatus, message: str, attempts: int = 0
) -> pb.ExecutionResult:
    """A result for a call that did not run to completion in an executor."""
    return pb.ExecutionResult(
        id=call_id, status=status, message=message, exit_code=-1, attempts=attempts
    )


def validate(execution: pb.Execution, policy: LimitPolicy) -> CallLimits:
    """Check a request before it runs; ValueError's message names the offending field."""
    if not execution.code.strip():
        raise ValueError("code is empty")
    code_bytes = len(execution.code.encode())
    if code_bytes > policy.max_code_bytes:
        raise ValueError(f"code is {code_bytes} bytes; the maximum is {policy.max_code_bytes}")
    if "\x00" in execution.code:
        raise ValueError("code contains a NUL byte")
    stdin_bytes = len(execution.stdin.encode())
    if stdin_bytes > policy.max_stdin_bytes:
        raise ValueError(f"stdin is {stdin_bytes} bytes; the maximum is {policy.max_stdin_bytes}")
    limits = execution.limits
    return policy.resolve(limits.timeout_seconds, limits.memory_bytes, limits.output_bytes)
