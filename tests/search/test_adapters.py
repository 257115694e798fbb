"""The search's Policy on the rollout scheduler (fake engines behind a real scheduler) and its
Executor on the sandbox (in-process stand-in): prompts from token ids, one request of n
samples per expansion at the step stops, the tree's affinity key, one batch per expansion,
and sandbox failures that are not the code's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kubestar.sandbox.retries import SandboxRetries
from kubestar.search.adapters import (
    SandboxExecutor,
    SandboxUnavailable,
    SchedulerPolicy,
    StepSampling,
    execution,
)
from kubestar.search.mcts import expand
from kubestar.search.steps import RStarFormat
from kubestar.search.tree import Node, SearchSettings, Terminal
from kubestar.v1 import rollout_pb2 as rpb
from kubestar.v1 import sandbox_pb2 as spb

from tests.search.service_fakes import (
    COMPUTE,
    CRASH,
    PROMPT,
    SHOW,
    FakeSandbox,
    answer,
    decode,
    encode,
    scheduler,
)


def root() -> Node:
    return Node.root(PROMPT, encode(PROMPT))


class Recorder:
    """A scheduler that records what it is asked and answers one sample "a"."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.keys: list[str] = []
        self.ended: list[str] = []

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: rpb.SamplingParams | None = None,
        n: int = 1,
    ) -> rpb.GenerateResponse:
        self.prompts.append(list(prompt_token_ids))
        self.keys.append(trajectory_id)
        return rpb.GenerateResponse(completions=[rpb.Completion(text="a", token_ids=[97])])

    async def end_trajectory(self, trajectory_id: str) -> None:
        self.ended.append(trajectory_id)


async def test_one_request_of_n_samples_at_the_step_stops_with_the_stop_kept() -> None:
    async with scheduler() as (client, fakes):
        policy = SchedulerPolicy(client, RStarFormat(), encode, "tree-1", StepSampling(seed=5))
        proposals = await policy.propose(root(), 3)
        body = next(b for f in fakes for b in f.bodies)
    assert [p.text for p in proposals] == [COMPUTE, answer("41"), COMPUTE]
    assert all(list(p.token_ids) == encode(p.text) for p in proposals)
    assert body["n"] == 3 and body["stop"] == list(RStarFormat.stops)
    assert (body["temperature"], body["top_p"], body["seed"]) == pytest.approx((0.7, 0.95, 5))
    assert body["max_tokens"] == 512
    assert policy.requests == 1
    assert policy.generated_tokens == sum(len(p.text) for p in proposals)


async def test_the_prompt_is_the_token_ids_along_the_path() -> None:
    """A step's own ids go back as the engine wrote them (here they differ from what
    encoding its text would give); the observation, which no engine wrote, is encoded."""
    node = root()
    step = Node(id="0.1", parent=node, depth=1, text="<code>\nx = 1\n<end_of_code>")
    step.token_ids = (7, 8, 9)
    step.observation = "\n<output>1<end_of_output>"
    node.children.append(step)
    recorder = Recorder()
    policy = SchedulerPolicy(recorder, RStarFormat(), encode, "tree", max_context=10_000)
    await policy.propose(step, 2)
    assert recorder.prompts == [[*encode(PROMPT), 7, 8, 9, *encode(step.observation)]]
    # No room left in the context: no request, no proposals (the node is exhausted).
    room = len(recorder.prompts[0])
    tight = SchedulerPolicy(Recorder(), RStarFormat(), encode, "tree", max_context=room)
    assert await tight.propose(step, 2) == [] and tight.requests == 0


async def test_without_affinity_each_request_has_a_key_of_its_own() -> None:
    recorder = Recorder()
    shared = SchedulerPolicy(recorder, RStarFormat(), encode, "tree")
    apart = SchedulerPolicy(recorder, RStarFormat(), encode, "tree", affinity=False)
    for policy in (shared, shared, apart, apart):
        await policy.propose(root(), 2)
    assert recorder.keys == ["tree", "tree", "tree/0", "tree/1"]
    await shared.end()
    await apart.end()
    assert recorder.ended == ["tree"]


async def test_a_trees_expansions_share_its_affinity_key_and_engine() -> None:
    async with scheduler() as (client, fakes):
        policy = SchedulerPolicy(client, RStarFormat(), encode, "tree-7")
        sandbox = FakeSandbox()
        executor = SandboxExecutor(sandbox)
        settings = SearchSettings()
        node = root()
        children = await expand(node, 3, policy, executor, RStarFormat(), settings)
        compute = children[0]
        grandchildren = await expand(compute, 2, policy, executor, RStarFormat(), settings)
        answers = await expand(grandchildren[0], 3, policy, executor, RStarFormat(), settings)
        used = [len(f.bodies) for f in fakes]
        await policy.end()
    assert sorted(used) == [0, 3]  # every request of the tree on one engine
    assert [c.text for c in children] == [COMPUTE, answer("41")]  # the duplicate dropped
    assert [c.text for c in grandchildren] == [SHOW, CRASH]
    assert grandchildren[0].observation == "\n<output>42<end_of_output>"
    assert grandchildren[1].terminal is Terminal.TOO_MANY_CODE_ERRORS
    assert [a.answer for a in answers] == ["42", "40"]
    # One batch per expansion that had code to run; each program the replayed path.
    assert sandbox.batches == [
        ["# multiply\nx = 6 * 7"],
        ["# multiply\nx = 6 * 7\nprint(x)", "# multiply\nx = 6 * 7\nprint(y)"],
    ]
    assert policy.requests == 3
    assert decode(answers[0].token_ids) == answer("42")


async def test_a_sandbox_failure_is_retried_not_a_failed_step() -> None:
    sandbox = FakeSandbox(infra_failures=1)
    executor = SandboxExecutor(sandbox, retries=SandboxRetries(delay=0.0))
    results = await executor.run(["print(1)", "print(2)"])
    assert [(r.output, r.failed) for r in results] == [("1\n", False), ("2\n", False)]
    assert sandbox.batches == [["print(1)", "print(2)"], ["print(1)"]]
    assert executor.retried == 1


async def test_a_sandbox_that_keeps_failing_stops_the_search() -> None:
    executor = SandboxExecutor(
        FakeSandbox(infra_failures=10), retries=SandboxRetries(attempts=3, delay=0.0)
    )
    with pytest.raises(SandboxUnavailable, match=r"fake-sandbox: 1 of 1 programs .* 3 attempts"):
        await executor.run(["print(1)"])


def test_what_a_failed_program_shows() -> None:
    error = spb.ExecutionResult(
        status=spb.EXECUTION_STATUS_ERROR, stdout="3\n", stderr="ZeroDivisionError: x\n"
    )
    assert execution(error).failed
    assert execution(error).output == "3\nZeroDivisionError: x"
    timeout = spb.ExecutionResult(status=spb.EXECUTION_STATUS_TIMEOUT, message="10 s")
    assert execution(timeout).failed and "TimeoutError" in execution(timeout).output
    ok = spb.ExecutionResult(status=spb.EXECUTION_STATUS_OK, stdout="4\n", stderr="warning\n")
    assert (execution(ok).output, execution(ok).failed) == ("4\n", False)
