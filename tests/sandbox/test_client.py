"""SandboxClient (blocking and async), GetCapacity, health checks, a dispatcher's happy path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.sandbox.client import Call, SandboxClient, result_to_dict
from kubestar.sandbox.dispatcher import WorkerDispatcher
from kubestar.sandbox.limits import LimitPolicy
from kubestar.sandbox.server import SERVICE_NAME, ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ThreadedServer, assert_still_serving

OK = pb.EXECUTION_STATUS_OK
ERROR = pb.EXECUTION_STATUS_ERROR
TIMEOUT = pb.EXECUTION_STATUS_TIMEOUT
INVALID = pb.EXECUTION_STATUS_INVALID


def sleepy_calls(count: int) -> list[Call | str]:
    """Later calls finish first, so completion order is the reverse of call order."""
    calls: list[Call | str] = []
    for index in range(count):
        delay = 0.05 * (count - index)
        code = f"import time\ntime.sleep({delay})\nprint({index})"
        calls.append(Call(id=f"mine-{index}", code=code) if index % 2 else code)
    return calls


@pytest.fixture
async def aclient(server: ThreadedServer) -> AsyncIterator[SandboxClient]:
    sandbox = SandboxClient(server.endpoint, timeout=60)
    yield sandbox
    await sandbox.aclose()
    sandbox.close()


class TestBlockingClient:
    def test_execute_a_string(self, client: SandboxClient) -> None:
        result = client.execute("print(6 * 7)")
        assert (result.status, result.stdout) == (OK, "42\n")
        assert result.id.startswith("call-")

    def test_ids_are_filled_and_unique(self, client: SandboxClient) -> None:
        ids = [client.execute("pass").id for _ in range(3)]
        ids += [result.id for result in client.execute_batch(["pass"] * 3)]
        assert all(call_id for call_id in ids)
        assert len(set(ids)) == 6

    def test_batch_preserves_order(self, client: SandboxClient) -> None:
        calls = sleepy_calls(6)
        results = client.execute_batch(calls)
        assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        assert all(result.status == OK for result in results)
        for index, result in enumerate(results):
            if index % 2:
                assert result.id == f"mine-{index}"
            else:
                assert result.id.startswith("call-")
        assert len({result.id for result in results}) == 6

    def test_batch_mixes_statuses(self, client: SandboxClient) -> None:
        results = client.execute_batch(
            [
                "print('fine')",
                "raise RuntimeError('nope')",
                Call(code="while True: pass", timeout_seconds=0.3),
                "",
            ]
        )
        assert [result.status for result in results] == [OK, ERROR, TIMEOUT, INVALID]

    def test_empty_batch(self, client: SandboxClient) -> None:
        assert client.execute_batch([]) == []

    def test_capacity_idle(self, client: SandboxClient) -> None:
        capacity = client.capacity()
        assert (capacity.capacity, capacity.in_flight, capacity.queued) == (2, 0, 0)
        assert capacity.ready_workers == 1

    def test_capacity_while_busy(self, server: ThreadedServer, client: SandboxClient) -> None:
        with ThreadPoolExecutor(1) as background:
            batch = background.submit(client.execute_batch, ["import time; time.sleep(1.5)"] * 3)
            deadline = time.monotonic() + 15
            with SandboxClient(server.endpoint, timeout=10) as observer:
                while True:
                    capacity = observer.capacity()
                    if capacity.in_flight == 2 and capacity.queued == 1:
                        break
                    assert time.monotonic() < deadline, capacity
                    time.sleep(0.05)
            assert all(result.status == OK for result in batch.result(timeout=30))
        assert client.capacity().in_flight == 0

    def test_result_to_dict(self, client: SandboxClient) -> None:
        result = client.execute(Call(id="d", code="print('x')"))
        as_dict = result_to_dict(result)
        assert as_dict["id"] == "d"
        assert as_dict["status"] == "ok"
        assert as_dict["stdout"] == "x\n"
        assert as_dict["exit_code"] == 0
        assert set(as_dict) == {
            "id",
            "status",
            "exit_code",
            "stdout",
            "stderr",
            "stdout_truncated",
            "stderr_truncated",
            "wall_ms",
            "cpu_ms",
            "message",
            "executor",
            "attempts",
        }
        assert result_to_dict(client.execute(""))["status"] == "invalid"

    def test_unreachable_endpoint_raises(self) -> None:
        from kubestar.common.net import free_port

        with (
            SandboxClient(f"127.0.0.1:{free_port()}", timeout=2, retries=False) as client,
            pytest.raises(grpc.RpcError) as raised,
        ):
            client.execute("print(1)")
        assert raised.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )


class TestAsyncClient:
    async def test_aexecute(self, aclient: SandboxClient) -> None:
        result = await aclient.aexecute(Call(code="print(input()[::-1])", stdin="abc\n"))
        assert (result.status, result.stdout) == (OK, "cba\n")
        assert result.id.startswith("call-")

    async def test_concurrent_aexecute(self, aclient: SandboxClient) -> None:
        results = await asyncio.gather(*(aclient.aexecute(f"print({i})") for i in range(6)))
        assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        assert len({result.id for result in results}) == 6

    async def test_aexecute_batch_preserves_order(self, aclient: SandboxClient) -> None:
        results = await aclient.aexecute_batch(sleepy_calls(6))
        assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        assert results[1].id == "mine-1"

    async def test_aexecute_stream_returns_call_order(self, aclient: SandboxClient) -> None:
        calls = sleepy_calls(6)
        results = await aclient.aexecute_stream(calls)
        assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        assert results[3].id == "mine-3"
        assert len({result.id for result in results}) == 6

    async def test_aexecute_stream_mixed_statuses(self, aclient: SandboxClient) -> None:
        results = await aclient.aexecute_stream(
            ["print('a')", "import sys; sys.exit(2)", "   ", Call(id="z", code="print('z')")]
        )
        assert [result.status for result in results] == [OK, ERROR, INVALID, OK]
        assert results[1].exit_code == 2
        assert results[3].id == "z"

    async def test_aexecute_stream_empty(self, aclient: SandboxClient) -> None:
        assert await aclient.aexecute_stream([]) == []

    async def test_blocking_and_async_side_by_side(
        self, aclient: SandboxClient, client: SandboxClient
    ) -> None:
        blocking = asyncio.to_thread(client.execute, "print('sync')")
        results = await asyncio.gather(blocking, aclient.aexecute("print('async')"))
        assert [result.stdout for result in results] == ["sync\n", "async\n"]


class TestHealth:
    @pytest.mark.parametrize("service", ["", SERVICE_NAME])
    def test_serving(self, server: ThreadedServer, service: str) -> None:
        assert SERVICE_NAME == "kubestar.v1.SandboxService"
        with grpc.insecure_channel(server.endpoint) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10
            )
        assert response.status == health_pb2.HealthCheckResponse.SERVING

    def test_unknown_service(self, server: ThreadedServer) -> None:
        with (
            grpc.insecure_channel(server.endpoint) as channel,
            pytest.raises(grpc.RpcError) as raised,
        ):
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
            )
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def dispatcher(server: ThreadedServer) -> Iterator[ThreadedServer]:
    """A dispatcher in front of the module's worker."""
    threaded = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", workers=[server.endpoint], queue_timeout=30)
    ).start()
    backend = threaded.server.backend
    assert isinstance(backend, WorkerDispatcher)
    threaded.run(backend.wait_ready(1, timeout=30))
    yield threaded
    threaded.stop()


class TestDispatcher:
    def test_capacity_sums_the_workers(self, dispatcher: ThreadedServer) -> None:
        with SandboxClient(dispatcher.endpoint, timeout=30) as client:
            capacity = client.capacity()
        assert (capacity.capacity, capacity.ready_workers, capacity.in_flight) == (2, 1, 0)

    def test_calls_run_on_the_worker(self, dispatcher: ThreadedServer) -> None:
        with SandboxClient(dispatcher.endpoint, timeout=30) as client:
            result = client.execute(Call(id="via", code="print('through')"))
            assert (result.status, result.stdout, result.id) == (OK, "through\n", "via")
            assert result.executor.startswith("worker/executor-")
            assert result.attempts == 1
            results = client.execute_batch(sleepy_calls(8))
            assert [result.stdout for result in results] == [f"{i}\n" for i in range(8)]
            assert results[5].id == "mine-5"
            timeout = client.execute(Call(code="while True: pass", timeout_seconds=0.3))
            assert timeout.status == TIMEOUT
            assert_still_serving(client)

    async def test_stream_through_the_dispatcher(self, dispatcher: ThreadedServer) -> None:
        client = SandboxClient(dispatcher.endpoint, timeout=30)
        try:
            results = await client.aexecute_stream(sleepy_calls(6))
            assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        finally:
            await client.aclose()
            client.close()

    def test_the_largest_result_passes_through(self, dispatcher: ThreadedServer) -> None:
        """stdout and stderr at the output ceiling, every byte invalid UTF-8 (each becomes a
        3-byte U+FFFD): the largest result a call can have, far over gRPC's default 4 MiB,
        on the dispatcher's stream to the worker with another call beside it."""
        ceiling = LimitPolicy().maximum.output_bytes
        code = (
            "import sys\n"
            f"sys.stdout.buffer.write(b'\\xff' * {ceiling})\n"
            f"sys.stderr.buffer.write(b'\\xff' * {ceiling})\n"
        )
        with SandboxClient(dispatcher.endpoint, timeout=120) as client:
            largest, beside = client.execute_batch(
                [Call(code=code, output_bytes=ceiling), "print('beside it')"]
            )
            assert largest.status == OK, largest.message
            assert largest.stdout == "\ufffd" * ceiling and largest.stderr == largest.stdout
            assert not largest.stdout_truncated and largest.attempts == 1
            assert largest.ByteSize() > 2 * 3 * ceiling
            assert (beside.status, beside.stdout, beside.attempts) == (OK, "beside it\n", 1)
            assert_still_serving(client)

    def test_more_calls_than_capacity_queue(self, dispatcher: ThreadedServer) -> None:
        with SandboxClient(dispatcher.endpoint, timeout=30) as client:
            calls = [f"import time\ntime.sleep(0.2)\nprint({i})" for i in range(6)]
            started = time.monotonic()
            results = client.execute_batch(list(calls))
            elapsed = time.monotonic() - started
        assert [result.stdout for result in results] == [f"{i}\n" for i in range(6)]
        assert elapsed >= 0.55  # three rounds on two executors
