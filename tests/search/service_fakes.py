"""Stand-ins for the search's services: a fake engine that writes a small world of rStar-format
steps (behind a real scheduler), and a sandbox that runs the tests' own trusted programs in
this process. The world: "What is 6 * 7?", where one path computes and prints 42."""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubestar.sandbox.client import Call
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.search.steps import RStarFormat
from kubestar.v1 import sandbox_pb2 as spb
from kubestar.v1 import sandbox_pb2_grpc as spb_grpc

from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine

QUESTION = "What is 6 * 7?"
PROMPT = RStarFormat().prompt(QUESTION)
COMPUTE = "<code>\n# multiply\nx = 6 * 7\n<end_of_step>"
SHOW = "print(x)\n<end_of_code>"
CRASH = "print(y)\n<end_of_code>"


def answer(value: str) -> str:
    return f"<answer>The answer is \\boxed{{{value}}}<end_of_answer>"


# The next steps after each path (the steps' text and observations after the prompt);
# sample i of a request writes the i-th, round and round.
WORLD: dict[str, list[str]] = {
    "": [COMPUTE, answer("41"), COMPUTE],
    COMPUTE: [SHOW, CRASH],
    COMPUTE + SHOW + "\n<output>42<end_of_output>": [answer("42"), answer("42"), answer("40")],
}


def encode(text: str) -> list[int]:
    """The fake engine's tokenizer: one token a character, its code."""
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def respond(prompt: list[int], index: int) -> str:
    """What the policy writes after a prompt (a path of the world)."""
    text = decode(prompt)
    assert text.startswith(PROMPT), text
    steps = WORLD.get(text[len(PROMPT) :], ["<answer>lost<end_of_answer>"])
    return steps[index % len(steps)]


@asynccontextmanager
async def scheduler(
    engines: int = 2, **engine_settings: object
) -> AsyncIterator[tuple[SchedulerClient, list[FakeEngine]]]:
    """A scheduler server in front of fake engines that write the world, and its client."""
    # Room for 16 samples of 512-token steps at once.
    settings: dict[str, Any] = {"num_blocks": 2048, "max_model_len": 4096, **engine_settings}
    fakes = [
        await FakeEngine(token_delay=0.0, respond=respond, **settings).start()
        for _ in range(engines)
    ]
    server = SchedulerServer(
        ServerConfig(
            listen="127.0.0.1:0",
            engines=[(f"e{i}", f.url) for i, f in enumerate(fakes)],
            scheduler=fast_config(),
        )
    )
    await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30) as client:
            yield client, fakes
    finally:
        await server.stop(grace_seconds=1.0)
        for fake in fakes:
            await fake.stop()


class FakeSandbox:
    """ExecuteBatch in this process (the programs are the tests' own). The first
    `infra_failures` executions answer INTERNAL, as a sandbox whose worker died would."""

    endpoint = "fake-sandbox"

    def __init__(self, infra_failures: int = 0) -> None:
        self.infra_failures = infra_failures
        self.batches: list[list[str]] = []

    async def aexecute_batch(self, calls: Sequence[Call | str]) -> list[spb.ExecutionResult]:
        codes = [call.code if isinstance(call, Call) else call for call in calls]
        self.batches.append(codes)
        return [self._run(code) for code in codes]

    def _run(self, code: str) -> spb.ExecutionResult:
        if self.infra_failures:
            self.infra_failures -= 1
            return spb.ExecutionResult(
                status=spb.EXECUTION_STATUS_INTERNAL, message="the worker died"
            )
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(code, {})
        except Exception as error:
            return spb.ExecutionResult(
                status=spb.EXECUTION_STATUS_ERROR,
                exit_code=1,
                stdout=printed.getvalue(),
                stderr=f"{type(error).__name__}: {error}\n",
            )
        return spb.ExecutionResult(status=spb.EXECUTION_STATUS_OK, stdout=printed.getvalue())


class _SandboxServicer(spb_grpc.SandboxServiceServicer):  # type: ignore[misc]
    def __init__(self, sandbox: FakeSandbox) -> None:
        self.sandbox = sandbox

    async def ExecuteBatch(
        self, request: spb.ExecuteBatchRequest, context: grpc.aio.ServicerContext
    ) -> spb.ExecuteBatchResponse:
        codes = [execution.code for execution in request.executions]
        results = await self.sandbox.aexecute_batch(codes)
        for execution, result in zip(request.executions, results, strict=True):
            result.id = execution.id
        return spb.ExecuteBatchResponse(results=results)


@asynccontextmanager
async def sandbox_server(sandbox: FakeSandbox) -> AsyncIterator[str]:
    """The fake sandbox behind a gRPC server (ExecuteBatch and health); yields its address."""
    server = grpc.aio.server()
    spb_grpc.add_SandboxServiceServicer_to_server(_SandboxServicer(sandbox), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
