"""The agent loop with a scripted model and a REAL sandbox server (gRPC, executor processes).

The scripted generator writes prepared turns (tool calls, answers, garbage) so that masks,
tool responses, sandbox timeouts, truncation by turns and by length, and concurrency can be
checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from kubestar.api.v1alpha1 import CallLimitsSpec
from kubestar.common.net import free_port
from kubestar.sandbox.client import Call
from kubestar.sandbox.retries import SandboxRetries
from kubestar.sandbox.server import ServerConfig
from kubestar.training.datasets import Problem
from kubestar.training.executors import (
    SandboxBatchExecutor,
    SandboxStreamExecutor,
    ToolExecutor,
)
from kubestar.training.generators import (
    Generation,
    GenerationError,
    Sampling,
    ScriptedGenerator,
)
from kubestar.training.rewards import RewardScorer
from kubestar.training.rollout import AgentLoop, RolloutConfig, rollout
from kubestar.training.tools import render_tool_turn
from kubestar.training.trajectory import (
    ANSWERED,
    ERROR,
    MAX_LENGTH,
    MAX_TURNS,
    MODEL,
    NO_ANSWER,
    TOOL,
    Trajectory,
)
from kubestar.training.workers import call_limits_config
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ThreadedServer, executor_config
from tests.training.rollout_support import (
    ROLLOUT_PRELOAD,
    chat_tokenizer,
    start_sandbox,
    tool_call,
)

PROBLEM = Problem("p0", "What is 5 factorial?", "120")


@pytest.fixture(scope="module")
def sandbox() -> Iterator[ThreadedServer]:
    server = start_sandbox(executors=4)
    yield server
    server.stop()


@dataclass
class Recorded:
    code: str
    start: float
    end: float
    status: str


class RecordingExecutor:
    """Wraps an executor and remembers every call it was given, with times."""

    def __init__(self, inner: ToolExecutor) -> None:
        self.inner = inner
        self.calls: list[Recorded] = []

    async def execute(self, call: Call) -> pb.ExecutionResult:
        start = time.monotonic()
        result = await self.inner.execute(call)
        status = pb.ExecutionStatus.Name(result.status)
        self.calls.append(Recorded(call.code, start, time.monotonic(), status))
        return result

    async def close(self) -> None:
        await self.inner.close()


def make_loop(
    script: ScriptedGenerator,
    tools: ToolExecutor,
    **config: object,
) -> AgentLoop:
    return AgentLoop(script, tools, chat_tokenizer(), RolloutConfig(**config))  # type: ignore[arg-type]


def scripted(turns: Sequence[str], delay: float = 0.0) -> ScriptedGenerator:
    """The same turns for every trajectory (the last one repeats)."""
    return ScriptedGenerator(
        chat_tokenizer(), lambda _id, turn, _ctx: turns[min(turn, len(turns) - 1)], delay=delay
    )


async def test_tool_call_then_answer_masks_and_logprobs(sandbox: ThreadedServer) -> None:
    contexts: list[str] = []

    def script(_id: str, turn: int, context: str) -> str:
        contexts.append(context)
        if turn == 0:
            return tool_call("import math\nprint(math.factorial(5))") + " ignored after the stop"
        return "The tool says 120, so the answer is \\boxed{120}."

    tokenizer = chat_tokenizer()
    generator = ScriptedGenerator(tokenizer, script)
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(generator, tools)
    scorer = RewardScorer(workers=1)
    try:
        (trajectory,), stats = await rollout(loop, [PROBLEM], 1, scorer)
    finally:
        scorer.close()
        await tools.close()
    trajectory.check()
    assert trajectory.finish_reason == ANSWERED
    assert trajectory.answer == "120" and trajectory.reward == 1.0
    assert trajectory.num_turns == 2
    assert [s.owner for s in trajectory.segments] == [MODEL, TOOL, MODEL]
    (call,) = trajectory.tool_calls
    assert (call.status, call.name, call.response) == ("ok", "python", "120")
    assert call.code == "import math\nprint(math.factorial(5))"
    model0, tool0, model1 = trajectory.segments
    # The model's first turn ends at the stop string; the loop closes the turn (tool-owned).
    assert model0.text.endswith("</tool_call>") and model0.stop_reason == "</tool_call>"
    assert tool0.text == render_tool_turn(["120"], model_closed_turn=False)
    assert tool0.text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n120\n")
    # The final turn ends with the model's own end-of-turn token, which it is trained on.
    assert model1.text.endswith("\\boxed{120}.<|im_end|>")
    assert trajectory.response_ids[-1] == tokenizer.eos_id
    assert trajectory.response_mask[-1] == 1
    mask, logprobs = trajectory.response_mask, trajectory.response_logprobs
    assert mask == [1] * model0.end + [0] * (tool0.end - tool0.start) + [1] * (
        model1.end - model1.start
    )
    assert all(lp == -0.5 for lp, m in zip(logprobs, mask, strict=True) if m == 1)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
    # The context of the second turn is exactly prompt + response so far, tool response last.
    assert contexts[1] == tokenizer.decode(
        trajectory.prompt_ids + trajectory.response_ids[: tool0.end]
    )
    assert contexts[1].endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert (
        tokenizer.decode(trajectory.input_ids) == trajectory.prompt_text + trajectory.response_text
    )
    assert generator.ended == {trajectory.id}
    assert stats.accuracy == 1.0 and stats.tool_calls == 1 and stats.tool_error_rate == 0.0
    # The record survives JSON.
    again = Trajectory.from_dict(json.loads(json.dumps(trajectory.to_dict())))
    assert (
        again.response_ids == trajectory.response_ids and again.tool_calls == trajectory.tool_calls
    )


async def test_malformed_calls_become_explanations(sandbox: ThreadedServer) -> None:
    turns = [
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
        '<tool_call>{"name": "python", "arguments": {}}</tool_call>',
        '{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>',
        tool_call("print(6 * 7)"),
        "\\boxed{42}",
    ]
    recorder = RecordingExecutor(SandboxStreamExecutor(sandbox.endpoint))
    loop = make_loop(scripted(turns), recorder)
    try:
        trajectory = await loop.run_trajectory(Problem("p", "6*7?", "42"))
    finally:
        await recorder.close()
    trajectory.check()
    statuses = [c.status for c in trajectory.tool_calls]
    assert statuses == ["malformed", "unknown-tool", "bad-arguments", "malformed", "ok"]
    assert [r.code for r in recorder.calls] == ["print(6 * 7)"]  # only the valid call ran
    tool_texts = [s.text for s in trajectory.segments if s.owner == TOOL]
    assert "not valid JSON" in tool_texts[0]
    assert "unknown tool 'calculator'" in tool_texts[1]
    assert '"code"' in tool_texts[2]
    assert "without <tool_call>" in tool_texts[3]
    assert "<tool_response>\n42\n</tool_response>" in tool_texts[4]
    assert trajectory.finish_reason == ANSWERED and trajectory.answer == "42"
    assert trajectory.num_tool_calls == 5 and trajectory.num_tool_errors == 4
    assert trajectory.tool_error_ratio == pytest.approx(0.8)


async def test_code_errors_and_sandbox_timeout_inside_a_trajectory(
    sandbox: ThreadedServer,
) -> None:
    turns = [
        tool_call("print('before')\n1 / 0"),
        tool_call("print('spinning', flush=True)\nwhile True:\n    pass"),
        tool_call("print(sum(range(10)))"),
        "Done: \\boxed{45}",
    ]
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(scripted(turns), tools, tool_timeout_seconds=1.0)
    started = time.monotonic()
    try:
        trajectory = await loop.run_trajectory(Problem("p", "sum?", "45"))
    finally:
        await tools.close()
    assert time.monotonic() - started < 30  # the 1 s tool timeout held (no hang)
    trajectory.check()
    error, timeout, ok = trajectory.tool_calls
    assert error.status == "error" and "ZeroDivisionError" in error.response
    assert error.response.startswith("before\nTraceback") and "zygote" not in error.response
    assert timeout.status == "timeout"
    assert "TimeoutError" in timeout.response and "1s" in timeout.response
    assert timeout.latency_s >= 1.0
    assert ok.status == "ok" and ok.response == "45"
    assert trajectory.finish_reason == ANSWERED and trajectory.num_tool_errors == 2


async def test_max_turns(sandbox: ThreadedServer) -> None:
    recorder = RecordingExecutor(SandboxStreamExecutor(sandbox.endpoint))
    loop = make_loop(scripted([tool_call("print(1)")]), recorder, max_turns=3)
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await recorder.close()
    trajectory.check()
    assert trajectory.finish_reason == MAX_TURNS
    assert trajectory.num_turns == 3
    assert [c.status for c in trajectory.tool_calls] == ["ok", "ok", "skipped"]
    assert len(recorder.calls) == 2  # the last turn's call is not run
    assert trajectory.segments[-1].owner == MODEL  # nothing appended after the last turn
    assert trajectory.num_tool_calls == 2 and trajectory.answer is None


async def test_max_length_cuts_a_long_turn(sandbox: ThreadedServer) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(scripted(["blah " * 400 + "\\boxed{1}"]), tools, max_response_tokens=50)
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    trajectory.check()
    assert trajectory.finish_reason == MAX_LENGTH
    assert trajectory.response_length == 50 and trajectory.model_tokens == 50
    assert trajectory.segments[0].finish_reason == "length"
    assert trajectory.answer is None and trajectory.boxed_answers == []


async def test_truncated_tool_call_is_recorded_not_run(sandbox: ThreadedServer) -> None:
    code = "print(" + " + ".join(str(i) for i in range(300)) + ")"
    recorder = RecordingExecutor(SandboxStreamExecutor(sandbox.endpoint))
    loop = make_loop(scripted([tool_call(code)]), recorder, max_response_tokens=60)
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await recorder.close()
    trajectory.check()
    assert trajectory.finish_reason == MAX_LENGTH
    (call,) = trajectory.tool_calls
    assert call.status == "truncated" and not call.answered
    assert call.raw.lstrip().startswith('{"name": "python"')
    assert recorder.calls == []
    assert trajectory.num_tool_calls == 0 and trajectory.response_length == 60


async def test_a_long_tool_response_is_cut_at_the_length_limit(sandbox: ThreadedServer) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(
        scripted([tool_call("print('x' * 5000)"), "\\boxed{1}"]),
        tools,
        max_response_tokens=300,
        max_tool_response_chars=2000,
    )
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    trajectory.check()
    assert trajectory.finish_reason == MAX_LENGTH
    assert trajectory.response_length == 300
    assert [s.owner for s in trajectory.segments] == [MODEL, TOOL]
    (call,) = trajectory.tool_calls
    assert call.status == "ok" and "characters omitted" in call.response
    assert len(call.stdout) == 5001  # the record keeps the whole output


async def test_an_answer_that_ends_exactly_at_the_limit_counts(sandbox: ThreadedServer) -> None:
    tokenizer = chat_tokenizer()
    answer = "It is \\boxed{120}"
    budget = len(tokenizer.encode(answer)) + 1  # and the end-of-turn token
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(scripted([answer]), tools, max_response_tokens=budget)
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    assert trajectory.finish_reason == ANSWERED and trajectory.response_length == budget
    short = make_loop(scripted([answer]), tools, max_response_tokens=budget - 1)
    assert (await short.run_trajectory(PROBLEM)).finish_reason == MAX_LENGTH


async def test_context_limit_is_respected(sandbox: ThreadedServer) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(scripted(["word " * 500]), tools, max_context_tokens=0)
    prompt_tokens = len(chat_tokenizer().encode(loop.prompt(PROBLEM.question)))
    limited = make_loop(scripted(["word " * 500]), tools, max_context_tokens=prompt_tokens + 20)
    try:
        trajectory = await limited.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    assert trajectory.finish_reason == MAX_LENGTH and trajectory.response_length == 20


async def test_no_answer_and_several_answers(sandbox: ThreadedServer) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint)
    try:
        silent = await make_loop(scripted(["I do not know."]), tools).run_trajectory(PROBLEM)
        turns = [
            "Maybe \\boxed{100}? " + tool_call("print(120)"),
            "No: \\boxed{120}, not \\boxed{100}",
        ]
        several = await make_loop(scripted(turns), tools).run_trajectory(PROBLEM)
    finally:
        await tools.close()
    assert silent.finish_reason == NO_ANSWER and silent.answer is None
    assert silent.num_turns == 1 and silent.tool_calls == []
    assert several.finish_reason == ANSWERED
    assert several.boxed_answers == ["100", "120", "100"] and several.num_answers == 3
    assert several.answer == "100"  # the last \boxed{} wins


async def test_several_calls_in_one_turn_when_the_model_ignores_the_stop(
    sandbox: ThreadedServer,
) -> None:
    turn = tool_call("print(1)") + "\n" + tool_call("print(2)") + "\n" + tool_call("print(3)")
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(
        scripted([turn, "\\boxed{6}"]), tools, sampling=Sampling(stop=()), max_calls_per_turn=2
    )
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    trajectory.check()
    assert [c.status for c in trajectory.tool_calls] == ["ok", "ok", "rejected"]
    tool = trajectory.segments[1]
    # The model closed its own turn (<|im_end|> is its token); the responses follow in order.
    assert trajectory.segments[0].text.endswith("</tool_call><|im_end|>")
    assert tool.text.startswith("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n")
    assert "<tool_response>\n2\n</tool_response>" in tool.text
    assert "at most 2 tool call(s)" in tool.text


class FailingGenerator(ScriptedGenerator):
    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation:
        if self.turns.get(trajectory_id, 0) == 1:
            raise GenerationError("engine went away")
        return await super().generate(trajectory_id, prompt_token_ids, max_new_tokens, sampling)


async def test_generation_failure_ends_only_that_trajectory(sandbox: ThreadedServer) -> None:
    generator = FailingGenerator(chat_tokenizer(), lambda *_: tool_call("print(1)"))
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = AgentLoop(generator, tools, chat_tokenizer(), RolloutConfig())
    try:
        trajectory = await loop.run_trajectory(PROBLEM)
    finally:
        await tools.close()
    trajectory.check()
    assert trajectory.finish_reason == ERROR and "engine went away" in trajectory.error
    assert trajectory.num_tool_calls == 1 and generator.ended == {trajectory.id}


async def test_turn_seeds_are_distinct_and_reproducible(sandbox: ThreadedServer) -> None:
    seeds: list[tuple[str, int, int]] = []

    class SeedRecorder(ScriptedGenerator):
        async def generate(
            self,
            trajectory_id: str,
            prompt_token_ids: Sequence[int],
            max_new_tokens: int,
            sampling: Sampling,
        ) -> Generation:
            seeds.append((trajectory_id, self.turns.get(trajectory_id, 0), sampling.seed))
            return await super().generate(trajectory_id, prompt_token_ids, max_new_tokens, sampling)

    turns = [tool_call("print(1)"), "\\boxed{1}"]
    tools = SandboxStreamExecutor(sandbox.endpoint)
    generator = SeedRecorder(chat_tokenizer(), lambda _i, t, _c: turns[min(t, 1)])
    loop = AgentLoop(generator, tools, chat_tokenizer(), RolloutConfig(sampling=Sampling(seed=7)))
    try:
        await loop.run_many([PROBLEM, PROBLEM], samples=2, run_id="r")
        first = sorted(seeds)
        seeds.clear()
        generator.turns.clear()
        await loop.run_many([PROBLEM, PROBLEM], samples=2, run_id="r")
    finally:
        await tools.close()
    assert sorted(seeds) == first
    assert len({seed for *_, seed in first}) == len(first) == 8
    assert all(seed > 0 for *_, seed in first)


class GatedExecutor(RecordingExecutor):
    """Holds the calls whose code says `slow` until `release()` (or `timeout`), then runs them:
    a tool call as slow as the test wants, whatever the machine's load."""

    def __init__(self, inner: ToolExecutor, timeout: float = 120.0) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.timeout = timeout
        self.held_until_released = True

    def release(self) -> None:
        self.gate.set()

    async def execute(self, call: Call) -> pb.ExecutionResult:
        if "slow" in call.code:
            try:
                await asyncio.wait_for(self.gate.wait(), self.timeout)
            except TimeoutError:
                self.held_until_released = False
        return await super().execute(call)


async def test_slow_tool_calls_do_not_hold_up_other_trajectories(
    sandbox: ThreadedServer,
) -> None:
    """200 trajectories through the real sandbox; 2 of them make a call that does not return
    until the other 198 have finished. If the loop waited on the slow calls anywhere, the
    others could not finish and the gate would time out."""
    slow_ids = {"c-0-0", "c-1-0"}
    finished: list[str] = []

    def script(trajectory_id: str, turn: int, _context: str) -> str:
        if turn == 0 and trajectory_id in slow_ids:
            return tool_call("print('slow')")
        if turn == 0:
            return tool_call(f"print({len(trajectory_id)} * 2)")
        finished.append(trajectory_id)
        if len(finished) == 200 - len(slow_ids):
            gated.release()
        return "\\boxed{3}"

    generator = ScriptedGenerator(chat_tokenizer(), script, delay=0.02)
    gated = GatedExecutor(SandboxStreamExecutor(sandbox.endpoint))
    loop = AgentLoop(generator, gated, chat_tokenizer(), RolloutConfig())
    problems = [Problem(f"q{i}", "1+2?", "3") for i in range(100)]
    try:
        trajectories = await loop.run_many(problems, samples=2, run_id="c")
    finally:
        await gated.close()
    assert gated.held_until_released, "the other trajectories did not finish while 2 calls hung"
    assert len(trajectories) == 200
    assert all(t.finish_reason == ANSWERED for t in trajectories)
    assert [t.id for t in trajectories[:2]] == ["c-0-0", "c-0-1"]  # problem order kept
    assert set(finished[-2:]) == slow_ids  # the slow two answered last
    assert generator.max_active >= 150  # trajectories really were in flight together
    fast = [t for t in trajectories if t.id not in slow_ids]
    assert all(t.tool_calls[0].response == str(len(t.id) * 2) for t in fast)
    slow = [t for t in trajectories if t.id in slow_ids]
    assert all(t.tool_calls[0].response == "slow" for t in slow)


class FakeTools:
    """A stand-in sandbox: each call sleeps (0.5 s when its code says so) then answers ok."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0

    async def execute(self, call: Call) -> pb.ExecutionResult:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.5 if "slow" in call.code else 0.01)
        finally:
            self.in_flight -= 1
        return pb.ExecutionResult(status=pb.EXECUTION_STATUS_OK, stdout="ok\n")

    async def close(self) -> None:
        return None


async def test_thousands_of_trajectories_as_coroutines() -> None:
    def script(trajectory_id: str, turn: int, _context: str) -> str:
        if turn < 2:
            slow = int(trajectory_id.rsplit("-", 1)[1]) % 4 == 0
            return tool_call("slow()" if slow else "fast()")
        return "\\boxed{1}"

    generator = ScriptedGenerator(chat_tokenizer(), script, delay=0.05)
    tools = FakeTools()
    loop = AgentLoop(generator, tools, chat_tokenizer(), RolloutConfig(max_concurrency=4096))
    problems = [Problem(f"q{i}", "?", "1") for i in range(500)]
    trajectories = await loop.run_many(problems, samples=4)
    assert len(trajectories) == 2000
    assert all(t.finish_reason == ANSWERED and t.num_tool_calls == 2 for t in trajectories)
    assert generator.max_active >= 1000
    assert tools.max_in_flight >= 400  # the slow calls of 500 trajectories overlapped


async def test_batch_executor_batches_calls(sandbox: ThreadedServer) -> None:
    turns = [tool_call("print(7)"), "\\boxed{7}"]
    tools = SandboxBatchExecutor(sandbox.endpoint, window=0.01)
    loop = make_loop(scripted(turns), tools)
    try:
        trajectories = await loop.run_many([Problem(f"b{i}", "?", "7") for i in range(40)])
    finally:
        await tools.close()
    assert all(t.finish_reason == ANSWERED for t in trajectories)
    assert all(t.tool_calls[0].response == "7" for t in trajectories)
    assert sum(tools.batch_sizes) == 40
    assert tools.batches < 40  # calls of different trajectories went out together


async def test_stream_executor_reconnects_and_never_loses_a_call() -> None:
    port = free_port()

    def server() -> ThreadedServer:
        return ThreadedServer(
            ServerConfig(
                listen=f"127.0.0.1:{port}",
                executors=1,
                executor=executor_config(preload=ROLLOUT_PRELOAD),
            )
        ).start()

    tools = SandboxStreamExecutor(
        f"127.0.0.1:{port}", retries=SandboxRetries(delay=0.05), deadline=60
    )
    a = server()
    try:
        ok = await tools.execute(Call(code="print('a')"))
        assert ok.status == pb.EXECUTION_STATUS_OK and ok.stdout == "a\n"
        # The server goes away while a call runs; a new one comes up on the same address.
        # The call is sent again on a new stream and answered there.
        pending = asyncio.create_task(
            tools.execute(Call(code="import time\ntime.sleep(4)\nprint('survived')"))
        )
        await asyncio.sleep(0.5)
    finally:
        a.stop(grace_seconds=0.1)
    b = server()
    try:
        survived = await asyncio.wait_for(pending, 30)
        assert survived.status == pb.EXECUTION_STATUS_OK and survived.stdout == "survived\n"
        again = await tools.execute(Call(code="print('b')"))
        assert again.status == pb.EXECUTION_STATUS_OK and again.stdout == "b\n"
        assert tools.streams_opened >= 2 and tools.resent >= 1
    finally:
        await tools.close()
        b.stop()


async def test_nothing_listening_gives_internal_results() -> None:
    tools = SandboxStreamExecutor(f"127.0.0.1:{free_port()}", deadline=1.0)
    try:
        result = await asyncio.wait_for(tools.execute(Call(code="print(1)")), 30)
    finally:
        await tools.close()
    assert result.status == pb.EXECUTION_STATUS_INTERNAL
    assert "no result from the sandbox in 1s" in result.message


async def test_stream_executor_rotates_streams(sandbox: ThreadedServer) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint, max_calls_per_stream=5)
    try:
        results = await asyncio.gather(
            *(tools.execute(Call(code=f"print({i})")) for i in range(23))
        )
        more = [await tools.execute(Call(code=f"print({i})")) for i in range(7)]
    finally:
        await tools.close()
    assert [r.stdout for r in results + more] == [f"{i}\n" for i in range(23)] + [
        f"{i}\n" for i in range(7)
    ]
    assert tools.streams_opened == 6


def test_user_template_may_hold_braces() -> None:
    config = RolloutConfig(user_template="{question}\nPut the answer in \\boxed{}.")
    loop = AgentLoop(scripted(["x"]), FakeTools(), chat_tokenizer(), config)
    prompt = loop.prompt("What is {x}?")
    assert "<|im_start|>user\nWhat is {x}?\nPut the answer in \\boxed{}.<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


class BrokenTools(FakeTools):
    async def execute(self, call: Call) -> pb.ExecutionResult:
        raise RuntimeError("executor closed")


async def test_a_broken_executor_or_generator_fails_softly() -> None:
    loop = AgentLoop(
        scripted([tool_call("print(1)"), "\\boxed{1}"]), BrokenTools(), chat_tokenizer()
    )
    trajectory = await loop.run_trajectory(PROBLEM)
    trajectory.check()
    (call,) = trajectory.tool_calls
    assert call.status == "internal" and "executor closed" in call.response
    assert trajectory.finish_reason == ANSWERED

    def boom(_id: str, _turn: int, _context: str) -> str:
        raise ValueError("script bug")

    generator = ScriptedGenerator(chat_tokenizer(), boom)
    failing = AgentLoop(generator, FakeTools(), chat_tokenizer())
    trajectories = await failing.run_many([PROBLEM], samples=3)
    assert [t.finish_reason for t in trajectories] == [ERROR] * 3
    assert trajectories[0].error == "ValueError: script bug"


async def test_a_sandbox_pools_limits_reach_every_call(sandbox: ThreadedServer) -> None:
    """SandboxPool.spec.limits, as the trainer's rollout worker applies them."""
    turns = [
        tool_call("while True:\n    pass"),
        tool_call("print('x' * 5000)"),
        "Done: \\boxed{1}",
    ]
    limits = CallLimitsSpec(timeout_seconds=1, output_bytes=1024)
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = make_loop(scripted(turns), tools, **call_limits_config(limits))
    try:
        trajectory = await loop.run_trajectory(Problem("p", "q?", "1"))
    finally:
        await tools.close()
    spin, loud = trajectory.tool_calls
    assert spin.status == "timeout" and "1s" in spin.response
    assert loud.status == "output-limit", loud.status
    assert call_limits_config(CallLimitsSpec())["tool_memory_bytes"] == 512 * 1024 * 1024
