"""The search on kubestar's services: a `Policy` that draws a node's next steps through the
rollout scheduler, and an `Executor` that runs an expansion's programs in the sandbox. (The
values come from `mcts.GroundTruth` and from `kubestar.search.scorer.PpmScorer`.)

* `SchedulerPolicy`: one Generate request per expansion, asking for n samples (one prefill,
  n continuations). The prompt is the token ids along the node's path (`path_token_ids`: the
  root's prompt ids, each step's own ids, each observation encoded), never re-tokenised
  text; generation stops at the step format's stops, which the step keeps. Every request of
  one tree carries the tree's affinity key, so that the scheduler keeps the tree on the
  engine whose prefix cache holds its path. It counts the tokens it generated: the budget
  that search and the baselines are compared at.
* `SandboxExecutor`: one ExecuteBatch per expansion. A result the sandbox itself failed
  (internal, queue-timeout) says nothing about the code: the program is sent again, and the
  search stops with `SandboxUnavailable` when it keeps failing, instead of recording a dead
  end that the policy did not cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from kubestar.api.errors import KubestarError
from kubestar.sandbox.client import Call
from kubestar.sandbox.metrics import status_label
from kubestar.sandbox.retries import DEFAULT_RETRIES, SandboxRetries, infra_failed
from kubestar.scheduler.client import completions
from kubestar.search.mcts import Execution, Proposal
from kubestar.search.ppm_data import Encode, path_token_ids
from kubestar.search.steps import StepFormat
from kubestar.search.tree import Node
from kubestar.training.tools import render_result
from kubestar.v1 import rollout_pb2 as rpb
from kubestar.v1 import sandbox_pb2 as spb

# Seeds of successive requests of one policy lie this far apart: vLLM gives sample i of a
# seeded request the seed + i, so requests of fewer samples never share a seed.
SEED_STRIDE = 7919


class Generate(Protocol):
    """The rollout scheduler's Generate (`kubestar.scheduler.client.SchedulerClient`)."""

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: rpb.SamplingParams | None = None,
        n: int = 1,
    ) -> rpb.GenerateResponse: ...

    async def end_trajectory(self, trajectory_id: str) -> None: ...


class ExecuteBatch(Protocol):
    """The sandbox's ExecuteBatch (`kubestar.sandbox.client.SandboxClient`)."""

    endpoint: str

    async def aexecute_batch(self, calls: Sequence[Call | str]) -> list[spb.ExecutionResult]: ...


@dataclass(frozen=True)
class StepSampling:
    """How steps are sampled. rStar-Math samples at temperature 0.7 and top-p 0.95; 0 is
    greedy decoding (the greedy baseline)."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_step_tokens: int = 512  # new tokens of one step at the most
    seed: int = 0  # 0: unseeded


class SchedulerPolicy:
    """The search's `Policy` on the rollout scheduler, for one tree (see the module
    docstring). `tree_id` is the tree's affinity key; `affinity` False sends each request
    under a key of its own (to measure what affinity saves). `max_context` (0: unknown) caps
    a step's new tokens so that the path and the step fit the engines' context, and a path
    with no room left gets no proposals (its node is exhausted)."""

    def __init__(
        self,
        scheduler: Generate,
        step_format: StepFormat,
        encode: Encode,
        tree_id: str,
        sampling: StepSampling | None = None,
        max_context: int = 0,
        affinity: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.affinity = affinity
        self.step_format = step_format
        self.encode = encode
        self.tree_id = tree_id
        self.sampling = sampling or StepSampling()
        self.max_context = max_context
        self.generated_tokens = 0  # every sampled token, duplicates dropped later included
        self.requests = 0

    def _params(self) -> rpb.SamplingParams:
        seed = self.sampling.seed + SEED_STRIDE * self.requests if self.sampling.seed else 0
        return rpb.SamplingParams(
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            stop=list(self.step_format.stops),
            seed=seed,
        )

    async def propose(self, node: Node, n: int) -> list[Proposal]:
        prompt = path_token_ids(node, self.encode)
        new_tokens = self.sampling.max_step_tokens
        if self.max_context:
            new_tokens = min(new_tokens, self.max_context - len(prompt))
        if new_tokens <= 0 or n <= 0:
            return []
        key = self.tree_id if self.affinity else f"{self.tree_id}/{self.requests}"
        response = await self.scheduler.generate(key, prompt, new_tokens, self._params(), n=n)
        self.requests += 1
        samples = completions(response)
        self.generated_tokens += sum(len(sample.token_ids) for sample in samples)
        return [Proposal(sample.text, tuple(sample.token_ids)) for sample in samples]

    async def end(self) -> None:
        """The tree is done: the scheduler may forget its engine. (Affinity is a hint: a
        lost call costs a stale entry, nothing else.)"""
        if not self.affinity:
            return
        with contextlib.suppress(grpc.RpcError):
            await self.scheduler.end_trajectory(self.tree_id)


class SandboxUnavailable(KubestarError, RuntimeError):
    """The sandbox kept failing to run programs (its own fault, not the code's)."""


def execution(result: spb.ExecutionResult) -> Execution:
    """A sandbox result as the search reads it. A program that ran prints its stdout (the
    replayed program's output grows by what each step adds); one that failed (an error, a
    time, memory or output limit, code refused) shows what the agent loop would show the
    model: its output and the error."""
    if status_label(result.status) == "ok":
        return Execution(result.stdout, failed=False)
    return Execution(render_result(result, max_chars=0), failed=True)


class SandboxExecutor:
    """The search's `Executor` on the sandbox (see the module docstring). `timeout_seconds`
    and `memory_bytes` bound each program (0: the sandbox's defaults); a program the sandbox
    failed is sent again as `retries` says."""

    def __init__(
        self,
        sandbox: ExecuteBatch,
        timeout_seconds: float = 10.0,
        memory_bytes: int = 0,
        retries: SandboxRetries = DEFAULT_RETRIES,
    ) -> None:
        self.sandbox = sandbox
        self.timeout_seconds = timeout_seconds
        self.memory_bytes = memory_bytes
        self.retries = retries
        self.batches = 0
        self.retried = 0

    async def run(self, programs: Sequence[str]) -> list[Execution]:
        calls = [
            Call(code=program, timeout_seconds=self.timeout_seconds, memory_bytes=self.memory_bytes)
            for program in programs
        ]
        results: list[spb.ExecutionResult | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        failure: spb.ExecutionResult | None = None

        async def attempt(number: int) -> bool:
            nonlocal pending, failure
            if not pending:
                return True
            if number > 1:
                self.retried += len(pending)
            self.batches += 1
            answers = await self.sandbox.aexecute_batch([calls[i] for i in pending])
            failed = []
            for index, answer in zip(pending, answers, strict=True):
                if infra_failed(answer):
                    failed.append(index)
                    failure = answer
                else:
                    results[index] = answer
            pending = failed
            return not pending

        if not await self.retries.run(attempt):
            assert failure is not None
            raise SandboxUnavailable(
                f"sandbox {self.sandbox.endpoint}: {len(pending)} of {len(calls)} programs got "
                f"no answer in {self.retries.attempts} attempts ({status_label(failure.status)}: "
                f"{failure.message or 'no message'}): is the sandbox overloaded or failing?"
            )
        return [execution(result) for result in results if result is not None]
