"""What one sandbox server takes on, whoever its clients are (limits.ServiceBounds): requests
over the size bound are refused before they are parsed, RPCs beyond the bound are refused,
one stream's calls wait for free slots, and over-long ids are refused per call. Each refusal
leaves the server serving."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from kubestar.common.bounds import ServiceBounds
from kubestar.sandbox.backend import Backend, make_result
from kubestar.sandbox.client import SandboxClient
from kubestar.sandbox.limits import MAX_ID_BYTES, MAX_REQUEST_BYTES
from kubestar.sandbox.server import ServerConfig
from kubestar.sandbox.service import SandboxServicer
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

from tests.sandbox.support import ThreadedServer, executor_config


def serve(bounds: ServiceBounds, executors: int = 2) -> ThreadedServer:
    config = ServerConfig(
        listen="127.0.0.1:0", executors=executors, executor=executor_config(), bounds=bounds
    )
    return ThreadedServer(config).start()


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    threaded = serve(ServiceBounds())
    yield threaded
    threaded.stop()


def test_an_over_long_id_is_refused_for_that_call_alone(server: ThreadedServer) -> None:
    channel = grpc.insecure_channel(server.endpoint)
    stub = pb_grpc.SandboxServiceStub(channel)
    long_id = "x" * (MAX_ID_BYTES + 1)
    request = pb.ExecuteBatchRequest(
        executions=[
            pb.Execution(id=long_id, code="print(1)"),
            pb.Execution(id="ok", code="print(2)"),
        ]
    )
    refused, ran = stub.ExecuteBatch(request, timeout=60).results
    assert refused.status == pb.EXECUTION_STATUS_INVALID and refused.id == long_id
    assert f"the maximum is {MAX_ID_BYTES}" in refused.message
    assert ran.status == pb.EXECUTION_STATUS_OK and ran.stdout == "2\n"
    channel.close()


def test_a_request_over_the_size_bound_is_refused_before_parsing(server: ThreadedServer) -> None:
    code = "#" * (1024 * 1024 - 16)  # each call's code at its own 1 MiB limit
    calls = MAX_REQUEST_BYTES // len(code) + 2
    with SandboxClient(server.endpoint, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.execute_batch([code] * calls)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.execute("print(3)").stdout == "3\n"  # still serving


def test_rpcs_beyond_the_bound_are_refused_while_one_runs() -> None:
    """The server refuses (seen on a channel without gRPC's retries); kubestar's client
    retries such a refusal and is served once the slot is free."""
    threaded = serve(ServiceBounds(max_concurrent_rpcs=1))
    raw = grpc.insecure_channel(threaded.endpoint, options=[("grpc.enable_retries", 0)])
    stub = pb_grpc.SandboxServiceStub(raw)
    try:
        with SandboxClient(threaded.endpoint, timeout=60) as client:
            slow: list[pb.ExecutionResult] = []

            def run_slow_call() -> None:
                while not slow:  # until admitted: the poller below may hold the one slot
                    try:
                        slow.append(client.execute("import time; time.sleep(3)"))
                    except grpc.RpcError as error:
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            runner = threading.Thread(target=run_slow_call)
            runner.start()
            refusals: list[grpc.StatusCode] = []
            while runner.is_alive() and not refusals:
                try:
                    stub.Execute(pb.ExecuteRequest(execution=pb.Execution(code="pass")))
                except grpc.RpcError as error:
                    refusals.append(error.code())
            assert refusals == [grpc.StatusCode.RESOURCE_EXHAUSTED]
            # The client's own call, refused at first, is retried until the slot is free.
            assert client.execute("print(4)").stdout == "4\n"
            runner.join()
            assert slow[0].status == pb.EXECUTION_STATUS_OK
    finally:
        raw.close()
        threaded.stop()


def test_a_stream_runs_at_most_its_in_flight_bound_of_calls() -> None:
    threaded = serve(ServiceBounds(max_in_flight_per_stream=2), executors=4)
    try:
        with SandboxClient(threaded.endpoint, timeout=120) as client:
            busiest = 0
            done = threading.Event()

            def watch() -> None:
                nonlocal busiest
                with SandboxClient(threaded.endpoint, timeout=30) as watcher:
                    while not done.is_set():
                        busiest = max(busiest, watcher.capacity().in_flight)

            watcher = threading.Thread(target=watch)
            watcher.start()
            calls = ["import time; time.sleep(0.5); print(1)"] * 6
            results = asyncio.run(client.aexecute_stream(calls))
            done.set()
            watcher.join()
            assert [r.stdout for r in results] == ["1\n"] * 6
            assert 1 <= busiest <= 2  # 4 executors free, the stream's bound held
    finally:
        threaded.stop()


class CountingBackend(Backend):
    """Answers every call at once, counting them."""

    def __init__(self) -> None:
        self.executed = 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def drain(self, grace_seconds: float) -> None: ...

    async def execute(self, execution: pb.Execution) -> pb.ExecutionResult:
        self.executed += 1
        return make_result(execution.id, pb.EXECUTION_STATUS_OK, "")

    async def get_capacity(self) -> pb.GetCapacityResponse:
        return pb.GetCapacityResponse()


async def test_a_stream_whose_results_are_not_read_stops_running_calls() -> None:
    """A client sends 20 calls and takes one result without reading further: the stream
    runs the 2 calls its bound allows and no more (a slot is freed when its result has been
    sent, not when it is ready), so an unread stream holds a bounded number of results."""
    backend = CountingBackend()
    servicer = SandboxServicer(backend, max_in_flight_per_stream=2)

    async def requests() -> AsyncIterator[pb.ExecuteStreamRequest]:
        for index in range(20):
            yield pb.ExecuteStreamRequest(execution=pb.Execution(id=f"c{index}", code="1"))

    stream = servicer.ExecuteStream(requests(), None)  # type: ignore[arg-type]
    first = await anext(stream)
    for _ in range(200):  # let the stream's reader and calls run as far as they can
        await asyncio.sleep(0)
    assert first.result.id == "c0"
    assert backend.executed == 2  # the one being sent and one more: the bound
    await stream.aclose()  # type: ignore[attr-defined]
