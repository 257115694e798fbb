"""A step's burst of tool calls loses nothing: many concurrent ExecuteBatch RPCs (the paper
sends about 45,000 calls a step, some 1,400 RPCs of 32) on one client channel, to a worker
and through a dispatcher to two workers, each call answered exactly once with its own
output. Scaled to what a test's time allows; real servers in their own processes."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ServerProcess

pytestmark = pytest.mark.slow

RPCS = 400
CALLS_PER_RPC = 32


async def burst(endpoint: str) -> tuple[dict[str, int], list[pb.ExecutionResult]]:
    """RPCS batches at once; the status of each RPC, and every result in call order."""
    client = SandboxClient(endpoint, timeout=600, token="")
    statuses: collections.Counter[str] = collections.Counter()
    results: list[pb.ExecutionResult] = []

    async def one(batch: int) -> list[pb.ExecutionResult]:
        calls = [Call(code=f"print({batch * CALLS_PER_RPC + i})") for i in range(CALLS_PER_RPC)]
        try:
            answered = await client.aexecute_batch(calls)
        except grpc.aio.AioRpcError as error:
            statuses[f"{error.code().name}: {error.details()}"] += 1
            return []
        statuses["OK"] += 1
        return answered

    try:
        for answered in await asyncio.gather(*(one(b) for b in range(RPCS))):
            results.extend(answered)
    finally:
        await client.aclose()
    return dict(statuses), results


def assert_each_call_answered_once(
    statuses: dict[str, int], results: list[pb.ExecutionResult]
) -> None:
    assert statuses == {"OK": RPCS}, statuses
    outputs = [result.stdout for result in results]
    assert outputs == [f"{i}\n" for i in range(RPCS * CALLS_PER_RPC)]
    assert {result.status for result in results} == {pb.EXECUTION_STATUS_OK}


@pytest.fixture(scope="module")
def workers(log_dir: Path) -> Iterator[list[ServerProcess]]:
    started = [ServerProcess(log_dir, "--no-isolation", executors=2).wait_ready() for _ in range(2)]
    yield started
    for server in started:
        server.stop()


async def test_a_burst_to_one_worker_loses_nothing(workers: list[ServerProcess]) -> None:
    assert_each_call_answered_once(*await burst(workers[0].endpoint))


async def test_a_burst_through_a_dispatcher_loses_nothing(
    workers: list[ServerProcess], log_dir: Path
) -> None:
    args = [arg for worker in workers for arg in ("--worker", worker.endpoint)]
    dispatcher = ServerProcess(log_dir, *args, worker=False).wait_ready()
    try:
        assert_each_call_answered_once(*await burst(dispatcher.endpoint))
    finally:
        dispatcher.stop()
