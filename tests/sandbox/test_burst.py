"""A step's burst of tool calls loses nothing: many concurrent ExecuteBatch RPCs (the paper
sends about 45,000 calls a step, some 1,400 RPCs of 32) on one client channel, to a worker
and through a dispatcher to two workers, each call answered exactly once with its own
output. Scaled to what a test's time allows: 400 RPCs of 32 calls, and the measured failure's
1,400 RPCs at once of 4 calls, with the server's memory bounded. 1,400 is past the 1,024
streams one connection may have open: the server refuses the streams beyond before running
them (UNAVAILABLE, "Received RST_STREAM with error code 7", on a client that does not ask
again), and kubestar's client asks again. It is also past the 1,000 RPCs that gRPC's server
lets wait to be taken up before it drops some, answered CANCELLED (ServiceBounds.
max_pending_rpcs raises that). Real servers in their own processes, but for the one past a
lowered bound on RPCs at once."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kubestar.common.bounds import ServiceBounds
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ServerProcess, ThreadedServer, executor_config

pytestmark = pytest.mark.slow

RPCS = 400
CALLS_PER_RPC = 32
# The measured failure (issue 21): a step's burst as about 1,400 ExecuteBatch RPCs at once on
# one channel, more than the streams one connection may have open. Tiny calls keep it short.
WIDE_RPCS = 1400
WIDE_CALLS_PER_RPC = 4
# A server process's peak resident memory (VmHWM) through the wide burst may exceed what it
# held before by at most this (measured: +37 MiB for a worker, +42 MiB for a dispatcher, from
# 62 MiB): 5,600 queued calls and 1,400 RPCs are a few KiB each, and nothing is kept after.
BURST_MEMORY_BYTES = 96 << 20
# The servers' --queue-timeout: long enough for a whole burst on a slow, shared machine (12,800
# calls at 100 a second take two minutes). A call that waits longer is answered QUEUE_TIMEOUT,
# not lost, but this test counts every call answered OK.
QUEUE = ("--queue-timeout", "600")


async def burst(
    endpoint: str, rpcs: int = RPCS, calls_per_rpc: int = CALLS_PER_RPC, retries: bool = True
) -> tuple[dict[str, int], list[pb.ExecutionResult]]:
    """`rpcs` batches at once; the status of each RPC, and every result in call order.
    `retries`: the client asks again an RPC the server refused before running it."""
    client = SandboxClient(endpoint, timeout=600, token="", retries=retries)
    statuses: collections.Counter[str] = collections.Counter()
    results: list[pb.ExecutionResult] = []

    async def one(batch: int) -> list[pb.ExecutionResult]:
        calls = [Call(code=f"print({batch * calls_per_rpc + i})") for i in range(calls_per_rpc)]
        try:
            answered = await client.aexecute_batch(calls)
        except grpc.aio.AioRpcError as error:
            statuses[f"{error.code().name}: {error.details()}"] += 1
            return []
        statuses["OK"] += 1
        return answered

    try:
        for answered in await asyncio.gather(*(one(b) for b in range(rpcs))):
            results.extend(answered)
    finally:
        await client.aclose()
    return dict(statuses), results


def assert_each_call_answered_once(
    statuses: dict[str, int],
    results: list[pb.ExecutionResult],
    rpcs: int = RPCS,
    calls_per_rpc: int = CALLS_PER_RPC,
) -> None:
    assert statuses == {"OK": rpcs}, statuses
    lost = collections.Counter(
        f"{pb.ExecutionStatus.Name(r.status)}: {r.message}"
        for r in results
        if r.status != pb.EXECUTION_STATUS_OK
    )
    assert not lost, lost
    outputs = [result.stdout for result in results]
    assert outputs == [f"{i}\n" for i in range(rpcs * calls_per_rpc)]


def memory_bytes(pid: int) -> dict[str, int]:
    """A process's resident memory now (VmRSS) and its peak so far (VmHWM), from /proc."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024  # kB
    return fields


async def assert_wide_burst_answered_within_memory(server: ServerProcess) -> None:
    """The wide burst through `server`: every call answered once, its memory bounded."""
    assert ServiceBounds().max_concurrent_streams < WIDE_RPCS
    before = memory_bytes(server.pid)["VmRSS"]
    statuses, results = await burst(server.endpoint, WIDE_RPCS, WIDE_CALLS_PER_RPC)
    assert_each_call_answered_once(statuses, results, WIDE_RPCS, WIDE_CALLS_PER_RPC)
    peak = memory_bytes(server.pid)["VmHWM"]
    assert peak - before < BURST_MEMORY_BYTES, (before, peak)


@pytest.fixture(scope="module")
def workers(log_dir: Path) -> Iterator[list[ServerProcess]]:
    started = [
        ServerProcess(log_dir, "--no-isolation", *QUEUE, executors=2).wait_ready() for _ in range(2)
    ]
    yield started
    for server in started:
        server.stop()


async def test_a_burst_to_one_worker_loses_nothing(workers: list[ServerProcess]) -> None:
    assert_each_call_answered_once(*await burst(workers[0].endpoint))


async def test_a_burst_through_a_dispatcher_loses_nothing(
    workers: list[ServerProcess], log_dir: Path
) -> None:
    args = [arg for worker in workers for arg in ("--worker", worker.endpoint)]
    dispatcher = ServerProcess(log_dir, *args, *QUEUE, worker=False).wait_ready()
    try:
        assert_each_call_answered_once(*await burst(dispatcher.endpoint))
    finally:
        dispatcher.stop()


async def test_1400_rpcs_at_once_to_one_worker_lose_nothing(log_dir: Path) -> None:
    worker = ServerProcess(log_dir, "--no-isolation", *QUEUE, executors=2).wait_ready()
    try:
        await assert_wide_burst_answered_within_memory(worker)
    finally:
        worker.stop()


async def test_1400_rpcs_at_once_through_a_dispatcher_lose_nothing(
    workers: list[ServerProcess], log_dir: Path
) -> None:
    args = [arg for worker in workers for arg in ("--worker", worker.endpoint)]
    dispatcher = ServerProcess(log_dir, *args, *QUEUE, worker=False).wait_ready()
    try:
        await assert_wide_burst_answered_within_memory(dispatcher)
    finally:
        dispatcher.stop()


async def test_1400_rpcs_at_once_past_the_rpc_bound_lose_nothing() -> None:
    """A worker that takes fewer RPCs at once than one connection's streams refuses part of
    the burst before running it (RESOURCE_EXHAUSTED, seen on a client that does not ask
    again); the client library asks again until every RPC is served."""
    bounds = ServiceBounds(max_concurrent_rpcs=512)
    assert bounds.max_concurrent_rpcs < bounds.max_concurrent_streams < WIDE_RPCS
    config = ServerConfig(
        listen="127.0.0.1:0", executors=2, executor=executor_config(), bounds=bounds
    )
    server = ThreadedServer(config).start()
    try:
        refused, _ = await burst(server.endpoint, WIDE_RPCS, WIDE_CALLS_PER_RPC, retries=False)
        assert any(status.startswith("RESOURCE_EXHAUSTED") for status in refused), refused
        statuses, results = await burst(server.endpoint, WIDE_RPCS, WIDE_CALLS_PER_RPC)
        assert_each_call_answered_once(statuses, results, WIDE_RPCS, WIDE_CALLS_PER_RPC)
    finally:
        server.stop()
