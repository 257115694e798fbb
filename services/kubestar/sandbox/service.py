"""The gRPC face of a sandbox server: the same service for a worker and a dispatcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
from kubestar.common.bounds import ServiceBounds
from kubestar.sandbox.backend import Backend, make_result
from kubestar.sandbox.limits import MAX_ID_BYTES
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

# ExecuteBatch takes at most this many calls per request.
MAX_BATCH = 1024


class SandboxServicer(pb_grpc.SandboxServiceServicer):
    def __init__(
        self,
        backend: Backend,
        max_in_flight_per_stream: int = ServiceBounds.max_in_flight_per_stream,
    ) -> None:
        self.backend = backend
        self.max_in_flight_per_stream = max_in_flight_per_stream

    async def Execute(
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        return pb.ExecuteResponse(result=await self._execute_checked(request.execution))

    async def ExecuteBatch(
        self, request: pb.ExecuteBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteBatchResponse:
        executions = request.executions
        if len(executions) > MAX_BATCH:
            message = f"executions has {len(executions)} calls; the maximum is {MAX_BATCH}"
            return pb.ExecuteBatchResponse(
                results=[
                    make_result(e.id, pb.EXECUTION_STATUS_INVALID, message) for e in executions
                ]
            )
        duplicated = _duplicate_ids(e.id for e in executions)
        results = await asyncio.gather(*(self._execute_unique(e, duplicated) for e in executions))
        return pb.ExecuteBatchResponse(results=results)

    async def ExecuteStream(
        self,
        request_iterator: AsyncIterator[pb.ExecuteStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ExecuteStreamResponse]:
        results: asyncio.Queue[pb.ExecutionResult | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()
        seen: set[str] = set()
        # Calls of this stream not yet answered: the next request waits for a free slot. A
        # slot is freed when its result is sent, so a client that does not read its results
        # holds at most this many, here and in the calls behind them.
        slots = asyncio.Semaphore(self.max_in_flight_per_stream)

        async def run(execution: pb.Execution, duplicate: bool) -> None:
            try:
                if duplicate:
                    result = make_result(
                        execution.id,
                        pb.EXECUTION_STATUS_INVALID,
                        f"id {execution.id!r} is already in use in this stream",
                    )
                else:
                    result = await self._execute_checked(execution)
            except BaseException:
                slots.release()  # nothing to send
                raise
            await results.put(result)

        async def read_requests() -> None:
            async for request in request_iterator:
                await slots.acquire()
                execution = request.execution
                duplicate = execution.id in seen
                seen.add(execution.id)
                task = asyncio.create_task(run(execution, duplicate))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*list(pending))
            await results.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (result := await results.get()) is not None:
                yield pb.ExecuteStreamResponse(result=result)
                slots.release()  # sent (the transport took it): the stream may run another
            await reader
        finally:
            reader.cancel()
            for task in list(pending):
                task.cancel()

    async def GetCapacity(
        self, request: pb.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCapacityResponse:
        return await self.backend.get_capacity()

    async def _execute_unique(
        self, execution: pb.Execution, duplicated: set[str]
    ) -> pb.ExecutionResult:
        if execution.id in duplicated:
            return make_result(
                execution.id,
                pb.EXECUTION_STATUS_INVALID,
                f"id {execution.id!r} appears more than once in the batch",
            )
        return await self._execute_checked(execution)

    async def _execute_checked(self, execution: pb.Execution) -> pb.ExecutionResult:
        size = len(execution.id.encode())
        if size > MAX_ID_BYTES:
            return make_result(
                execution.id,
                pb.EXECUTION_STATUS_INVALID,
                f"id is {size} bytes; the maximum is {MAX_ID_BYTES}",
            )
        return await self.backend.execute(execution)


def _duplicate_ids(ids: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    duplicated: set[str] = set()
    for call_id in ids:
        (duplicated if call_id in seen else seen).add(call_id)
    return duplicated
