"""Executors and workers die mid-batch, callers go away: every call still gets one result."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from kubestar.sandbox import executor as executor_module
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.dispatcher import WorkerDispatcher
from kubestar.sandbox.pool import ExecutorPool
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

from tests.real_parts import missing
from tests.sandbox.support import (
    ServerProcess,
    ThreadedServer,
    assert_still_serving,
    children,
    executor_config,
    leftover_processes,
    pool_of,
    process_alive,
    wait_for,
    zygote_pids,
)

OK = pb.EXECUTION_STATUS_OK


def slow_calls(count: int, seconds: float = 0.3, zygote: str = "light") -> list[Call]:
    """Calls that sleep; naming a preloaded module (see TEST_PRELOAD) sends them to the
    executors' preloading zygotes instead of their light ones."""
    imports = "time" if zygote == "light" else "time, glob"
    return [
        Call(id=f"call-{i}", code=f"import {imports}\ntime.sleep({seconds})\nprint({i})")
        for i in range(count)
    ]


LIGHT_EXECUTORS = {"worker/executor-0/light", "worker/executor-1/light"}


def assert_each_call_answered_once(calls: list[Call], results: list[pb.ExecutionResult]) -> None:
    assert [result.id for result in results] == [call.id for call in calls]
    assert len({result.id for result in results}) == len(calls)  # no duplicates
    for index, result in enumerate(results):
        assert result.status == OK, result
        assert result.stdout == f"{index}\n", result
        assert result.attempts >= 1


@pytest.fixture
def own_server() -> Iterator[ThreadedServer]:
    """A server of the test's own: these tests kill its executors."""
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0", executors=2, queue_timeout=30, executor=executor_config()
        )
    ).start()
    yield threaded
    threaded.stop()


@pytest.mark.parametrize("zygote", ["light", "preloaded"])
@pytest.mark.parametrize("victim", ["executor", "zygote"])
def test_executor_killed_mid_batch(own_server: ThreadedServer, victim: str, zygote: str) -> None:
    pool = pool_of(own_server)
    executor = pool.executors[0]
    process = executor.light if zygote == "light" else executor.zygote
    assert process is not None and process.pid is not None
    if victim == "zygote":
        if not executor.isolation.get("pid_namespace"):
            missing("the zygote is the executor process itself without a PID namespace")
        (target,) = children(process.pid)  # PID 1 of the executor's namespace
    else:
        target = process.pid
    old_pid = process.pid
    calls = slow_calls(12, zygote=zygote)
    with SandboxClient(own_server.endpoint, timeout=60) as client, ThreadPoolExecutor(1) as bg:
        batch = bg.submit(client.execute_batch, calls)
        wait_for(lambda: pool.in_flight == 2)
        os.kill(target, signal.SIGKILL)
        results = batch.result(timeout=60)
        assert_each_call_answered_once(calls, results)
        assert any(result.attempts == 2 for result in results)  # the killed call ran again
        assert process.pid != old_pid  # restarted...
        assert not process_alive(old_pid)
        assert process.isolation == pool.executors[1].isolation  # ...isolated as before
        for result in client.execute_batch(["print('still serving')"] * 4):
            assert (result.status, result.stdout) == (OK, "still serving\n")
        assert {r.executor for r in client.execute_batch(slow_calls(2, 0.2))} == LIGHT_EXECUTORS
        assert {
            r.executor for r in client.execute_batch(slow_calls(2, 0.2, zygote="preloaded"))
        } == {"worker/executor-0", "worker/executor-1"}


def test_idle_executor_killed(own_server: ThreadedServer) -> None:
    pool = pool_of(own_server)
    pids = [process.pid for executor in pool.executors for process in executor.processes]
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    with SandboxClient(own_server.endpoint, timeout=60) as client:
        for zygote in ("light", "preloaded"):
            calls = slow_calls(6, 0.05, zygote)
            assert_each_call_answered_once(calls, client.execute_batch(calls))
    assert all(
        process.pid not in pids for executor in pool.executors for process in executor.processes
    )


def test_a_zygote_that_stops_answering_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    # A zygote that hangs (here: stopped) answers nothing; after the call's timeout and the
    # grace period the worker gives up on it, restarts the executor and runs the call again.
    monkeypatch.setattr(executor_module, "ANSWER_GRACE_SECONDS", 0.5)
    config = ServerConfig(listen="127.0.0.1:0", executors=1, executor=executor_config())
    threaded = ThreadedServer(config).start()
    try:
        stopped = zygote_pids(pool_of(threaded))
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        with SandboxClient(threaded.endpoint, timeout=60) as client:
            result = client.execute(Call(code="print('answered')", timeout_seconds=0.5))
            assert (result.status, result.stdout, result.attempts) == (OK, "answered\n", 2)
            wait_for(lambda: not any(process_alive(pid) for pid in stopped))
            assert_still_serving(client)
    finally:
        threaded.stop()


def test_abandoned_calls_do_not_lose_executors(own_server: ThreadedServer) -> None:
    # Regression: a call whose client gave up (deadline) kept its executor forever, and
    # once every executor was lost the server answered only QUEUE_TIMEOUT.
    with SandboxClient(own_server.endpoint, timeout=0.3) as impatient:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as raised:
                impatient.execute("import time; time.sleep(1.0); print('abandoned')")
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pool = pool_of(own_server)
    with SandboxClient(own_server.endpoint, timeout=60) as client:
        # None answers with an abandoned call's result.
        for _ in range(4):
            assert_still_serving(client)
        # Both executors come back once their abandoned calls ended.
        wait_for(lambda: len(pool._idle) == pool.capacity)
        assert leftover_processes(pool) == []
        calls = slow_calls(4, 0.2)
        results = client.execute_batch(calls)
        assert_each_call_answered_once(calls, results)
        assert {result.executor for result in results} == LIGHT_EXECUTORS


async def test_cancelled_stream_does_not_lose_executors(own_server: ThreadedServer) -> None:
    async def requests() -> AsyncIterator[pb.ExecuteStreamRequest]:
        for index in range(2):
            yield pb.ExecuteStreamRequest(
                execution=pb.Execution(id=f"s{index}", code="import time; time.sleep(1.0)")
            )
        await asyncio.sleep(60)  # keep the stream open

    async with grpc.aio.insecure_channel(own_server.endpoint) as channel:
        stub = pb_grpc.SandboxServiceStub(channel)
        call = stub.ExecuteStream(requests())
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
    client = SandboxClient(own_server.endpoint, timeout=60)
    try:
        results = await client.aexecute_batch(["print('after')"] * 4)
        assert [(r.status, r.stdout) for r in results] == [(OK, "after\n")] * 4
    finally:
        await client.aclose()
        client.close()


@pytest.fixture
def two_workers(log_dir: Path) -> Iterator[list[ServerProcess]]:
    workers = [ServerProcess(log_dir, executors=3) for _ in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def dispatcher(two_workers: list[ServerProcess]) -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            workers=[worker.endpoint for worker in two_workers],
            queue_timeout=30,
        )
    ).start()
    backend = threaded.server.backend
    assert isinstance(backend, WorkerDispatcher)
    threaded.run(backend.wait_ready(2, timeout=30))
    yield threaded
    threaded.stop()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_worker_lost_mid_batch(
    dispatcher: ThreadedServer, two_workers: list[ServerProcess], log_dir: Path, how: str
) -> None:
    """SIGKILL: the worker's running calls are lost and run again elsewhere. SIGTERM (e.g. a
    rolling update): it finishes its running calls, and the ones the dispatcher sends it while
    it drains are refused and run elsewhere (regression: they used to come back INTERNAL)."""
    victim = two_workers[0]
    backend = dispatcher.server.backend
    assert isinstance(backend, WorkerDispatcher)
    calls = slow_calls(64)
    with SandboxClient(dispatcher.endpoint, timeout=120) as client:
        assert client.capacity().capacity == 6
        with ThreadPoolExecutor(1) as background:
            batch = background.submit(client.execute_batch, calls)
            (link,) = [link for link in backend.links if link.endpoint == victim.endpoint]
            wait_for(lambda: link.in_flight > 0)
            time.sleep(0.5)
            if how == "SIGKILL":
                victim.kill()
            else:
                victim.process.send_signal(signal.SIGTERM)
            results = batch.result(timeout=120)
        assert_each_call_answered_once(calls, results)
        if how == "SIGKILL":
            assert any(result.attempts > 1 for result in results)  # lost with the worker
        else:
            assert victim.process.wait(timeout=30) == 0
        wait_for(lambda: client.capacity().ready_workers == 1)
        assert client.capacity().capacity == 3
        assert_still_serving(client)

        # A worker that comes back on the same address is used again.
        revived = ServerProcess(log_dir, executors=3, port=victim.port)
        try:
            revived.wait_ready()
            wait_for(lambda: client.capacity().ready_workers == 2, timeout=20)
            calls = slow_calls(12, 0.2)
            assert_each_call_answered_once(calls, client.execute_batch(calls))
        finally:
            revived.stop()


def test_refused_calls_are_retried_a_bounded_number_of_times() -> None:
    """A call a worker refuses without starting it (INTERNAL, 0 attempts: it is draining) is
    tried again, at most MAX_ATTEMPTS times. Here the worker drains while its health still
    says SERVING, so the dispatcher keeps choosing it."""
    worker = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", executors=1, executor=executor_config())
    ).start()
    dispatcher: ThreadedServer | None = None
    try:
        dispatcher = ThreadedServer(
            ServerConfig(listen="127.0.0.1:0", workers=[worker.endpoint], queue_timeout=10)
        ).start()
        backend = dispatcher.server.backend
        assert isinstance(backend, WorkerDispatcher)
        dispatcher.run(backend.wait_ready(1, timeout=30))
        worker.run(pool_of(worker).drain(0.0))
        with SandboxClient(dispatcher.endpoint, timeout=60) as client:
            result = client.execute(Call(id="r", code="print(1)"))
        assert result.status == pb.EXECUTION_STATUS_INTERNAL, result
        assert result.id == "r"
        assert result.message == "the worker is shutting down; gave up after 3 attempts"
        assert result.attempts == 2  # started 0 times (the worker's) + the two retries
    finally:
        if dispatcher is not None:
            dispatcher.stop()
        worker.stop()


async def test_a_freed_executor_goes_to_the_call_that_waited_first() -> None:
    # The pool's queue alone (no processes): a call arriving just as an executor is put back
    # must queue behind the call already waiting, not take the executor from it.
    pool = ExecutorPool(1, executor_config(), queue_timeout=0.3)
    (executor,) = pool.executors
    waiting = asyncio.create_task(pool._acquire(time.monotonic()))
    await asyncio.sleep(0)  # the first call is now waiting
    pool._release(executor)  # a call finished
    newcomer = await pool._acquire(time.monotonic())  # runs before the waiter wakes
    assert await waiting is executor
    assert newcomer is None  # it waited its queue timeout: nobody put the executor back
