"""The dispatcher: spreads calls over sandbox workers by free capacity and retries lost ones.

Each worker is reached through one long-lived ExecuteStream, so a call costs a stream message
rather than an RPC. A worker that goes away fails only the calls it was running; they are
started again on another worker, and each call still gets exactly one result.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.common.auth import call_metadata
from kubestar.sandbox import metrics
from kubestar.sandbox.backend import Backend, make_result, validate
from kubestar.sandbox.limits import CallLimits, LimitPolicy, message_options
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
RECONNECT_SECONDS = 0.5
CONNECT_TIMEOUT_SECONDS = 2.0
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


class WorkerLost(RuntimeError):
    """The worker's stream broke before the call's result arrived."""


class WorkerLink:
    """One worker: its capacity, the calls it runs now, and the stream they travel on."""

    def __init__(
        self,
        endpoint: str,
        on_change: asyncio.Condition,
        policy: LimitPolicy | None = None,
        auth_token: str = "",
    ) -> None:
        self.endpoint = endpoint
        # Large enough for the largest result the policy allows: a result over gRPC's default
        # 4 MiB would break the stream, and with it every call running on the worker.
        self._channel_options = message_options(policy)
        self._metadata = call_metadata(auth_token)
        self._refused = False
        self.capacity = 0
        self.in_flight = 0
        self.ready = False
        self._on_change = on_change
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[pb.ExecutionResult]] = {}
        self._outbox: asyncio.Queue[pb.ExecuteStreamRequest] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight if self.ready else 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._maintain(), name=f"worker-link {self.endpoint}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, execution: pb.Execution) -> pb.ExecutionResult:
        """Run a call on this worker; raises WorkerLost if the worker goes away first."""
        internal_id = f"{next(self._ids)}"
        future: asyncio.Future[pb.ExecutionResult] = asyncio.get_running_loop().create_future()
        self._pending[internal_id] = future
        forwarded = pb.Execution()
        forwarded.CopyFrom(execution)
        forwarded.id = internal_id
        self._outbox.put_nowait(pb.ExecuteStreamRequest(execution=forwarded))
        try:
            result = await future
        finally:
            self._pending.pop(internal_id, None)
        result.id = execution.id
        return result

    async def _maintain(self) -> None:
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # any transport failure: the worker is gone for now
                refused = (
                    error.details()
                    if isinstance(error, grpc.aio.AioRpcError)
                    and error.code() == grpc.StatusCode.UNAUTHENTICATED
                    else None
                )
                if refused is not None and not self._refused:
                    # Said once, not every reconnect: the tokens differ until a restart.
                    log.warning(
                        "sandbox worker refused the dispatcher's token",
                        extra={"fields": {"endpoint": self.endpoint, "error": refused}},
                    )
                elif self.ready:
                    log.warning(
                        "sandbox worker lost",
                        extra={"fields": {"endpoint": self.endpoint, "error": repr(error)}},
                    )
                self._refused = refused is not None
            await self._set_ready(False)
            lost = WorkerLost(f"worker {self.endpoint} went away")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(lost)
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _session(self) -> None:
        async with grpc.aio.insecure_channel(
            self.endpoint, options=self._channel_options
        ) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            capacity = await stub.GetCapacity(
                pb.GetCapacityRequest(), timeout=CONNECT_TIMEOUT_SECONDS, metadata=self._metadata
            )
            stream = stub.ExecuteStream(metadata=self._metadata)
            self.capacity = capacity.capacity
            # Calls queued for a previous session were failed and retried already.
            self._outbox = asyncio.Queue()
            log.info(
                "sandbox worker ready",
                extra={"fields": {"endpoint": self.endpoint, "capacity": self.capacity}},
            )
            await self._set_ready(True)
            writer = asyncio.create_task(self._write(stream))
            watcher = asyncio.create_task(self._watch_health(channel))
            try:
                async for response in stream:
                    future = self._pending.get(response.result.id)
                    if future is not None and not future.done():
                        future.set_result(response.result)
                raise WorkerLost("stream ended")
            finally:
                writer.cancel()
                watcher.cancel()
                stream.cancel()

    async def _watch_health(self, channel: grpc.aio.Channel) -> None:
        """Route no new calls to a worker that is draining (NOT_SERVING after SIGTERM).

        Its running calls still finish on the open stream; once it exits the stream breaks
        and the link reconnects when a worker serves on the endpoint again.
        """
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        call = stub.Watch(request)
        try:
            async for response in call:
                serving = response.status == health_pb2.HealthCheckResponse.SERVING
                if serving != self.ready:
                    if not serving:
                        log.info(
                            "sandbox worker draining", extra={"fields": {"endpoint": self.endpoint}}
                        )
                    await self._set_ready(serving)
        except grpc.RpcError:
            pass  # no health service, or the worker went away (the stream notices that)
        finally:
            call.cancel()

    async def _write(self, stream: grpc.aio.StreamStreamCall) -> None:  # type: ignore[type-arg]
        while True:
            await stream.write(await self._outbox.get())

    async def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        async with self._on_change:
            self._on_change.notify_all()


class WorkerDispatcher(Backend):
    def __init__(
        self,
        endpoints: list[str],
        policy: LimitPolicy | None = None,
        queue_timeout: float = 30.0,
        auth_token: str = "",
    ) -> None:
        self.policy = policy or LimitPolicy()
        self.queue_timeout = queue_timeout
        self._changed = asyncio.Condition()
        self.links = [
            WorkerLink(endpoint, self._changed, self.policy, auth_token) for endpoint in endpoints
        ]
        self._queued = 0
        self._draining = False

    async def start(self) -> None:
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))

    async def drain(self, grace_seconds: float) -> None:
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _busy(self) -> bool:
        return bool(self._queued or any(link.in_flight for link in self.links))

    async def wait_ready(self, workers: int, timeout: float) -> None:
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: sum(link.ready for link in self.links) >= workers),
                timeout,
            )

    async def execute(self, execution: pb.Execution) -> pb.ExecutionResult:
        started = time.monotonic()
        try:
            limits = validate(execution, self.policy)
        except ValueError as error:
            return self._finish(
                make_result(execution.id, pb.EXECUTION_STATUS_INVALID, str(error)), started
            )
        # The limits it left unset become this dispatcher's defaults (--call-*: a pool's
        # spec.limits) before the call goes to a worker, whatever that worker's own are.
        execution = with_limits(execution, limits)
        if self._draining:
            return self._finish(
                make_result(
                    execution.id, pb.EXECUTION_STATUS_INTERNAL, "the dispatcher is shutting down"
                ),
                started,
            )
        attempts = 0
        while True:
            link = await self._acquire(started + self.queue_timeout)
            if link is None:
                if not any(link.ready for link in self.links):
                    status, message = (
                        pb.EXECUTION_STATUS_INTERNAL,
                        "no sandbox worker is reachable",
                    )
                else:
                    status, message = (
                        pb.EXECUTION_STATUS_QUEUE_TIMEOUT,
                        f"no worker had room within {self.queue_timeout:g}s",
                    )
                return self._finish(make_result(execution.id, status, message, attempts), started)
            attempts += 1
            try:
                result = await link.submit(execution)
            except WorkerLost as error:
                metrics.RETRIES.inc()
                if attempts >= MAX_ATTEMPTS:
                    return self._finish(
                        make_result(
                            execution.id,
                            pb.EXECUTION_STATUS_INTERNAL,
                            f"{error}; gave up after {attempts} attempts",
                            attempts,
                        ),
                        started,
                    )
                continue
            finally:
                await self._release(link)
            if result.status == pb.EXECUTION_STATUS_INTERNAL and result.attempts == 0:
                # The worker refused the call without starting it (it began draining before
                # its health said so): run the call elsewhere.
                metrics.RETRIES.inc()
                if attempts < MAX_ATTEMPTS:
                    continue
                result.message = f"{result.message}; gave up after {attempts} attempts"
            result.attempts += attempts - 1
            return self._finish(result, started)

    async def _acquire(self, deadline: float) -> WorkerLink | None:
        self._queued += 1
        metrics.QUEUE_DEPTH.inc()
        try:
            async with self._changed:

                def most_free() -> WorkerLink | None:
                    best = max(self.links, key=lambda link: link.free, default=None)
                    return best if best is not None and best.free > 0 else None

                link = most_free()
                while link is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    try:
                        await asyncio.wait_for(self._changed.wait(), remaining)
                    except TimeoutError:
                        return None
                    link = most_free()
                link.in_flight += 1
                metrics.IN_FLIGHT.inc()
                return link
        finally:
            self._queued -= 1
            metrics.QUEUE_DEPTH.dec()

    async def _release(self, link: WorkerLink) -> None:
        link.in_flight -= 1
        metrics.IN_FLIGHT.dec()
        async with self._changed:
            self._changed.notify()

    def _finish(self, result: pb.ExecutionResult, started: float) -> pb.ExecutionResult:
        metrics.READY_WORKERS.set(sum(link.ready for link in self.links))
        metrics.observe_result(result, time.monotonic() - started)
        return result

    async def get_capacity(self) -> pb.GetCapacityResponse:
        ready = [link for link in self.links if link.ready]
        return pb.GetCapacityResponse(
            capacity=sum(link.capacity for link in ready),
            in_flight=sum(link.in_flight for link in self.links),
            queued=self._queued,
            ready_workers=len(ready),
        )


def with_limits(execution: pb.Execution, limits: CallLimits) -> pb.Execution:
    """A copy of `execution` that sets every limit, as resolved by the dispatcher."""
    resolved = pb.Execution()
    resolved.CopyFrom(execution)
    resolved.limits.timeout_seconds = limits.timeout_seconds
    resolved.limits.memory_bytes = limits.memory_bytes
    resolved.limits.output_bytes = limits.output_bytes
    return resolved
