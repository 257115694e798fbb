"""Python client of the sandbox service."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from kubestar.common.auth import call_metadata, client_token
from kubestar.common.stubs import LazyStub
from kubestar.sandbox.limits import MAX_MESSAGE_BYTES, message_options
from kubestar.sandbox.metrics import status_label
from kubestar.sandbox.retries import RETRY_DELAYS, with_retries, with_retries_async
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = message_options()


@dataclass(frozen=True)
class Call:
    """One tool call. Zero limits take the server's defaults."""

    code: str
    id: str = ""
    stdin: str = ""
    timeout_seconds: float = 0.0
    memory_bytes: int = 0
    output_bytes: int = 0


def to_execution(call: Call | str, call_id: str) -> pb.Execution:
    """The call as the sandbox's proto has it; `call_id` when the call has no id."""
    if isinstance(call, str):
        call = Call(code=call)
    return pb.Execution(
        id=call.id or call_id,
        code=call.code,
        stdin=call.stdin,
        limits=pb.ExecutionLimits(
            timeout_seconds=call.timeout_seconds,
            memory_bytes=call.memory_bytes,
            output_bytes=call.output_bytes,
        ),
    )


def result_to_dict(result: pb.ExecutionResult) -> dict[str, object]:
    return {
        "id": result.id,
        "status": status_label(result.status),
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "wall_ms": round(result.wall_ms, 3),
        "cpu_ms": round(result.cpu_ms, 3),
        "message": result.message,
        "executor": result.executor,
        "attempts": result.attempts,
    }


class SandboxClient:
    """Blocking and async access to a sandbox endpoint (dispatcher or worker).

    Ids are filled in when a call has none; results of `execute_batch` are in call order.
    `token`: the installation's bearer token (kubestar.common.auth); None takes it from the
    environment (KUBESTAR_AUTH_TOKEN_FILE, KUBESTAR_AUTH_TOKEN), "" sends none.
    `retries`: ask again, after RETRY_DELAYS, a server that refused an RPC before running it
    (False: fail at once, as a one-shot command should when nothing serves there).
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float | None = None,
        token: str | None = None,
        retries: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self._delays = RETRY_DELAYS if retries else ()
        self.timeout = timeout
        self._metadata = call_metadata(client_token(token))
        self._ids = itertools.count()
        self._channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.SandboxServiceStub(self._channel)
        self._aio = LazyStub(endpoint, pb_grpc.SandboxServiceStub, _CHANNEL_OPTIONS)

    def _next_id(self) -> str:
        return f"call-{next(self._ids)}"

    def execute(self, call: Call | str) -> pb.ExecutionResult:
        request = pb.ExecuteRequest(execution=to_execution(call, self._next_id()))
        response: pb.ExecuteResponse = with_retries(
            self._delays,
            lambda: self._stub.Execute(request, timeout=self.timeout, metadata=self._metadata),
        )
        return response.result

    def execute_batch(self, calls: Sequence[Call | str]) -> list[pb.ExecutionResult]:
        request = pb.ExecuteBatchRequest(
            executions=[to_execution(call, self._next_id()) for call in calls]
        )
        response: pb.ExecuteBatchResponse = with_retries(
            self._delays,
            lambda: self._stub.ExecuteBatch(request, timeout=self.timeout, metadata=self._metadata),
        )
        return list(response.results)

    def capacity(self) -> pb.GetCapacityResponse:
        response: pb.GetCapacityResponse = with_retries(
            self._delays,
            lambda: self._stub.GetCapacity(
                pb.GetCapacityRequest(), timeout=self.timeout, metadata=self._metadata
            ),
        )
        return response

    async def aexecute(self, call: Call | str) -> pb.ExecutionResult:
        request = pb.ExecuteRequest(execution=to_execution(call, self._next_id()))
        response: pb.ExecuteResponse = await with_retries_async(
            self._delays,
            lambda: self._aio.get().Execute(request, timeout=self.timeout, metadata=self._metadata),
        )
        return response.result

    async def aexecute_batch(self, calls: Sequence[Call | str]) -> list[pb.ExecutionResult]:
        request = pb.ExecuteBatchRequest(
            executions=[to_execution(call, self._next_id()) for call in calls]
        )
        response: pb.ExecuteBatchResponse = await with_retries_async(
            self._delays,
            lambda: self._aio.get().ExecuteBatch(
                request, timeout=self.timeout, metadata=self._metadata
            ),
        )
        return list(response.results)

    async def aexecute_stream(self, calls: Sequence[Call | str]) -> list[pb.ExecutionResult]:
        """Send calls over one stream; returns results in call order once all arrived."""
        executions = [to_execution(call, self._next_id()) for call in calls]

        async def requests() -> AsyncIterator[pb.ExecuteStreamRequest]:
            for execution in executions:
                yield pb.ExecuteStreamRequest(execution=execution)

        by_id: dict[str, pb.ExecutionResult] = {}
        async for response in self._aio.get().ExecuteStream(
            requests(), timeout=self.timeout, metadata=self._metadata
        ):
            by_id[response.result.id] = response.result
        return [by_id[execution.id] for execution in executions]

    def close(self) -> None:
        self._channel.close()

    async def aclose(self) -> None:
        await self._aio.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MAX_MESSAGE_BYTES", "Call", "SandboxClient", "result_to_dict", "to_execution"]
