"""kubestar.sandbox.retries: what counts as the sandbox's own failure, and the one way its
callers try again (the trainer's executors and the search's use it alike)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest
from kubestar.sandbox.client import Call
from kubestar.sandbox.retries import (
    SandboxRetries,
    infra_failed,
    internal_result,
    rpc_failure,
)
from kubestar.training.executors import SandboxBatchExecutor
from kubestar.v1 import sandbox_pb2 as pb


class Refused(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


async def test_attempts_stop_at_the_first_success_and_wait_more_each_time() -> None:
    seen: list[int] = []

    async def third_time_lucky(number: int) -> bool:
        seen.append(number)
        return number == 3

    assert await SandboxRetries(attempts=5, delay=0.0).run(third_time_lucky)
    assert seen == [1, 2, 3]
    seen.clear()
    assert not await SandboxRetries(attempts=2, delay=0.0).run(third_time_lucky)
    assert seen == [1, 2]
    assert SandboxRetries(attempts=0).attempts == 1  # a call is always sent once
    retries = SandboxRetries(attempts=3)
    assert [retries.again(failures) for failures in (1, 2, 3)] == [True, True, False]


def test_what_is_the_sandboxs_fault() -> None:
    assert infra_failed(internal_result("a", "gone"))
    assert infra_failed(pb.ExecutionResult(status=pb.EXECUTION_STATUS_QUEUE_TIMEOUT))
    assert infra_failed(pb.ExecutionResult())  # no status: no healthy sandbox sends that
    assert not infra_failed(pb.ExecutionResult(status=pb.EXECUTION_STATUS_ERROR))
    assert not infra_failed(pb.ExecutionResult(status=pb.EXECUTION_STATUS_TIMEOUT))
    assert rpc_failure("batch", Refused()) == "sandbox batch failed: StatusCode.UNAVAILABLE: down"


class FlakySandbox:
    """Refuses the first `refusals` batches, then answers every call `ok`."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.batches = 0

    async def aexecute_batch(self, calls: Sequence[Call]) -> list[pb.ExecutionResult]:
        self.batches += 1
        if self.batches <= self.refusals:
            raise Refused()
        return [pb.ExecutionResult(id=call.id, status=pb.EXECUTION_STATUS_OK) for call in calls]

    async def aclose(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("refusals", "status"), [(2, "ok"), (3, "internal")])
async def test_the_batch_executor_sends_a_refused_batch_again(refusals: int, status: str) -> None:
    executor = SandboxBatchExecutor("127.0.0.1:1", window=0.0, retries=SandboxRetries(delay=0.0))
    flaky = FlakySandbox(refusals)
    executor.client = flaky  # type: ignore[assignment]
    result = await executor.execute(Call(code="print(1)"))
    await executor.close()
    assert flaky.batches == 3
    expected = pb.EXECUTION_STATUS_OK if status == "ok" else pb.EXECUTION_STATUS_INTERNAL
    assert result.status == expected
    if status == "internal":
        assert result.message == "sandbox batch failed: StatusCode.UNAVAILABLE: down"
