"""A worker's pool of executors: queueing, retries on executor death, results."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections import deque
from typing import Any

from kubestar.sandbox import metrics
from kubestar.sandbox.backend import Backend, make_result, validate
from kubestar.sandbox.executor import (
    Executor,
    ExecutorConfig,
    ExecutorDied,
    IsolationUnavailable,
)
from kubestar.sandbox.limits import LimitPolicy
from kubestar.v1 import sandbox_pb2 as pb

log = logging.getLogger(__name__)

STATUS_BY_NAME = {
    "ok": pb.EXECUTION_STATUS_OK,
    "error": pb.EXECUTION_STATUS_ERROR,
    "timeout": pb.EXECUTION_STATUS_TIMEOUT,
    "memory": pb.EXECUTION_STATUS_MEMORY,
    "output-limit": pb.EXECUTION_STATUS_OUTPUT_LIMIT,
}
# A call is started at most this many times when its executor dies under it.
MAX_ATTEMPTS = 3


class ExecutorPool(Backend):
    """Runs calls on N pre-warmed executors; a call waits at most `queue_timeout` for one."""

    def __init__(
        self,
        executors: int,
        config: ExecutorConfig | None = None,
        queue_timeout: float = 30.0,
        name: str = "worker",
    ) -> None:
        self.config = config or ExecutorConfig()
        if self.config.pin_cpus is None:
            # Pin when the executors fill the usable CPUs (a small machine, an exclusive
            # cpuset); not on a big shared node, where every pod would pin to the same CPUs.
            pin = executors >= len(os.sched_getaffinity(0))
            self.config = dataclasses.replace(self.config, pin_cpus=pin)
        self.policy: LimitPolicy = self.config.policy
        self.queue_timeout = queue_timeout
        self.name = name
        self.executors = [
            Executor(i, self.config, f"{name}/", pool_size=executors) for i in range(executors)
        ]
        # Free executors, and calls waiting for one (oldest first): a freed executor goes
        # straight to the call that has waited longest (see _release).
        self._idle: deque[Executor] = deque()
        self._waiters: deque[asyncio.Future[Executor]] = deque()
        self._in_flight = 0
        self._queued = 0
        self._draining = False
        self._stopped = False
        # Executors still finishing a call whose caller went away (see `_reclaim`).
        self._reclaiming: set[asyncio.Task[None]] = set()

    @property
    def capacity(self) -> int:
        return len(self.executors)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    async def start(self) -> None:
        """Start every executor; if one cannot (IsolationUnavailable first), stop them all and
        raise: a worker serves with all its isolation or not at all."""
        started = await asyncio.gather(
            *(executor.start() for executor in self.executors), return_exceptions=True
        )
        failures = [error for error in started if isinstance(error, BaseException)]
        if failures:
            await self.stop()
            refused = [error for error in failures if isinstance(error, IsolationUnavailable)]
            raise (refused or failures)[0]
        for executor in self.executors:
            self._release(executor)
        isolation = self.executors[0].isolation
        log.info(
            "sandbox executors ready",
            extra={
                "fields": {
                    "executors": self.capacity,
                    "preload": list(self.config.preload),
                    "light_zygotes": self.executors[0].light is not None,
                    "code_in_huge_pages": self.executors[0].zygote.code_in_huge_pages,
                    **isolation,
                }
            },
        )
        if not self.config.isolation:
            log.warning(
                "sandbox isolation is off (--no-isolation): calls share this worker's network, "
                "files, processes and uid, with no syscall filter; for development only"
            )
        elif not self.config.syscall_filter:
            log.warning(
                "the syscall filter is off (--no-syscall-filter): calls may use ptrace, "
                "unshare, bpf, io_uring and the rest it refuses; for measuring and debugging only"
            )
        for note in isolation.get("notes", []):
            log.warning("sandbox isolation: %s", note)
        metrics.CAPACITY.set(self.capacity)

    async def stop(self) -> None:
        self._stopped = True
        await asyncio.gather(*(executor.stop() for executor in self.executors))

    async def drain(self, grace_seconds: float) -> None:
        """Stop taking calls; wait for the ones running to finish."""
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while (self._in_flight or self._queued) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def execute(self, execution: pb.Execution) -> pb.ExecutionResult:
        started = time.monotonic()
        try:
            limits = validate(execution, self.policy)
        except ValueError as error:
            return self._finish(
                make_result(execution.id, pb.EXECUTION_STATUS_INVALID, str(error)), started
            )
        if self._draining:
            return self._finish(
                make_result(
                    execution.id, pb.EXECUTION_STATUS_INTERNAL, "the worker is shutting down"
                ),
                started,
            )
        attempts = 0
        while True:
            executor = await self._acquire(started)
            if executor is None:
                return self._finish(
                    make_result(
                        execution.id,
                        pb.EXECUTION_STATUS_QUEUE_TIMEOUT,
                        f"no executor became free within {self.queue_timeout:g}s",
                    ),
                    started,
                )
            attempts += 1
            self._in_flight += 1
            metrics.IN_FLIGHT.inc()
            running = executor.submit(execution.code, execution.stdin, limits)
            try:
                answer = await asyncio.shield(running)
            except asyncio.CancelledError:
                # The caller went away (client deadline, broken stream): the executor still
                # finishes the call and must not be lost, nor answer the next call with this
                # call's result. It rejoins the pool once its answer was read.
                running.add_done_callback(functools.partial(self._reclaim, executor))
                raise
            except ExecutorDied as error:
                log.warning(
                    "executor died; restarting it",
                    extra={
                        "fields": {
                            "executor": executor.name,
                            "call": execution.id,
                            "error": str(error),
                        }
                    },
                )
                metrics.EXECUTOR_RESTARTS.inc()
                answer = None
                await self._restart(executor)
            finally:
                self._in_flight -= 1
                metrics.IN_FLIGHT.dec()
            if answer is not None:
                self._release(executor)
                return self._finish(self._to_result(execution.id, answer, attempts), started)
            if attempts >= MAX_ATTEMPTS:
                return self._finish(
                    make_result(
                        execution.id,
                        pb.EXECUTION_STATUS_INTERNAL,
                        f"the executor died {attempts} times while running this call",
                        attempts,
                    ),
                    started,
                )

    async def _acquire(self, started: float) -> Executor | None:
        if self._idle:  # then nobody is waiting (see _release): no timer, no future
            return self._idle.popleft()
        remaining = self.queue_timeout - (time.monotonic() - started)
        if remaining <= 0:
            return None
        waiter: asyncio.Future[Executor] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._queued += 1
        metrics.QUEUE_DEPTH.inc()
        try:
            async with asyncio.timeout(remaining):
                return await waiter
        except BaseException as stop:  # the queue timeout, or the caller went away
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed over as the wait ended: pass it on
            waiter.cancel()
            if isinstance(stop, TimeoutError):
                return None
            raise
        finally:
            self._queued -= 1
            metrics.QUEUE_DEPTH.dec()

    def _release(self, executor: Executor) -> None:
        """First come, first served: the call that has waited longest gets the executor, so a
        call arriving just now cannot take it from one already waiting (up to its timeout)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a done one gave up (timeout, caller gone)
                waiter.set_result(executor)
                return
        self._idle.append(executor)

    async def _restart(self, executor: Executor) -> None:
        await executor.stop()
        try:
            await executor.start()
        except Exception:
            log.exception("executor restart failed; retrying in the background")
            asyncio.get_running_loop().create_task(self._restart_later(executor))
            return
        self._release(executor)

    def _reclaim(self, executor: Executor, running: asyncio.Future[dict[str, Any]]) -> None:
        if self._stopped:
            return
        if not running.cancelled() and running.exception() is None:
            self._release(executor)
            return
        task = asyncio.get_running_loop().create_task(self._restart(executor))
        self._reclaiming.add(task)
        task.add_done_callback(self._reclaiming.discard)

    async def _restart_later(self, executor: Executor) -> None:
        await asyncio.sleep(1.0)
        await self._restart(executor)

    def _to_result(self, call_id: str, answer: dict[str, Any], attempts: int) -> pb.ExecutionResult:
        return pb.ExecutionResult(
            id=call_id,
            status=STATUS_BY_NAME[answer["status"]],
            exit_code=answer["exit_code"],
            stdout=answer["stdout"].decode("utf-8", "replace"),
            stderr=answer["stderr"].decode("utf-8", "replace"),
            stdout_truncated=answer["stdout_truncated"],
            stderr_truncated=answer["stderr_truncated"],
            wall_ms=answer["wall_ms"],
            cpu_ms=answer["cpu_ms"],
            message=answer["message"],
            executor=answer["executor"],
            attempts=attempts,
        )

    def _finish(self, result: pb.ExecutionResult, started: float) -> pb.ExecutionResult:
        metrics.observe_result(result, time.monotonic() - started)
        return result

    async def get_capacity(self) -> pb.GetCapacityResponse:
        return pb.GetCapacityResponse(
            capacity=self.capacity, in_flight=self._in_flight, queued=self._queued, ready_workers=1
        )
