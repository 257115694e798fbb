"""Rollouts and rewards off the training process: a Ray actor around the agent loop.

The actor holds one connection to the rollout scheduler, one stream to the sandbox and a pool
of reward processes; each `rollout` call runs a whole step's trajectories as coroutines, and
`search` solves held-out problems by test-time search through the same scheduler connection
and reward processes (and a batch channel to the sandbox, opened per evaluation).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kubestar.api.v1alpha1 import CallLimitsSpec, ResilienceSpec, SearchEvaluationSpec
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem
from kubestar.training.executors import SandboxStreamExecutor
from kubestar.training.generators import Sampling, SchedulerGenerator
from kubestar.training.resilience import Retries, ensure_weights, push_weights
from kubestar.training.rewards import RewardScorer
from kubestar.training.rollout import AgentLoop, RolloutConfig, RolloutStats, rollout
from kubestar.training.trajectory import Trajectory

if TYPE_CHECKING:
    from kubestar.sandbox.client import SandboxClient
    from kubestar.scheduler.client import SchedulerClient


def call_limits_config(limits: CallLimitsSpec) -> dict[str, Any]:
    """The RolloutConfig fields that carry a SandboxPool's per-call limits into every call."""
    return {
        "tool_timeout_seconds": limits.timeout_seconds,
        "tool_memory_bytes": limits.memory_mib * 1024 * 1024,
        "tool_output_bytes": limits.output_bytes,
    }


class SearchEvaluator(Protocol):
    """Test-time search at a run's evaluation points (spec.evaluation.search). The search
    builds on the trainer, so the trainer does not import it: whoever starts a run gives
    `TrainingSession` one (`kubestar.search.evaluation.SearchEvaluation`)."""

    def check(self, spec: SearchEvaluationSpec, model_dir: Path) -> None:
        """Refuse, before any training, what the first evaluation could not use."""
        ...

    async def solve(
        self,
        *,
        scheduler: SchedulerClient,
        sandbox: SandboxClient,
        model_dir: Path,
        encode: Callable[[str], list[int]],
        problems: Sequence[Problem],
        spec: SearchEvaluationSpec,
        max_response_tokens: int,
        judge: Callable[[str | None, str], Awaitable[float]],
        call_limits: CallLimitsSpec | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Solve held-out problems as the spec asks: the figures and every problem's tree."""
        ...


class RolloutWorker:
    def __init__(
        self,
        scheduler: str,
        sandbox: str,
        model_dir: str,
        reward_workers: int = 2,
        call_limits: CallLimitsSpec | None = None,
        search: SearchEvaluator | None = None,
    ) -> None:
        self.call_limits = call_limits or CallLimitsSpec()
        self.search_evaluator = search
        self.model_dir = Path(model_dir)
        self.sandbox = sandbox
        self.tokenizer = ChatTokenizer.from_model(model_dir)
        self.generator = SchedulerGenerator(scheduler)
        self.tools = SandboxStreamExecutor(sandbox)
        self.scorer = RewardScorer(workers=reward_workers)

    async def rollout(
        self,
        problems: Sequence[Problem],
        samples: int,
        max_turns: int,
        max_response_tokens: int,
        sampling: Sampling,
    ) -> tuple[list[Trajectory], RolloutStats]:
        config = RolloutConfig(
            max_turns=max_turns,
            max_response_tokens=max_response_tokens,
            sampling=sampling,
            **call_limits_config(self.call_limits),
        )
        loop = AgentLoop(self.generator, self.tools, self.tokenizer, config)
        return await rollout(loop, problems, samples, self.scorer)

    async def search(
        self,
        problems: Sequence[Problem],
        spec: SearchEvaluationSpec,
        max_response_tokens: int,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Solve held-out problems by test-time search on the same scheduler and sandbox
        (the `SearchEvaluator` this worker was given): the figures and every problem's tree."""
        from kubestar.sandbox.client import SandboxClient

        if self.search_evaluator is None:
            raise ValueError("spec.evaluation.search: this trainer was given no SearchEvaluator")
        # ExecuteBatch for the search's expansions (the agent loop streams single calls).
        sandbox = SandboxClient(
            self.sandbox, timeout=max(60.0, 10 * self.call_limits.timeout_seconds)
        )
        try:
            return await self.search_evaluator.solve(
                scheduler=self.generator.client,
                sandbox=sandbox,
                model_dir=self.model_dir,
                encode=self.tokenizer.encode,
                problems=problems,
                spec=spec,
                max_response_tokens=max_response_tokens,
                judge=self.scorer.score,
                call_limits=self.call_limits,
            )
        finally:
            await sandbox.aclose()
            sandbox.close()

    async def update_weights(
        self, weights_path: str, version: int, resilience: ResilienceSpec | None = None
    ) -> dict[str, Any]:
        """Every engine loads the new weights before the next rollout starts; `attempts`:
        the tries it took (more than one when the scheduler was away or past the deadline)."""
        spec = resilience or ResilienceSpec()
        retries = Retries()
        response = await push_weights(
            self.generator.client, weights_path, version, spec, sleep=retries.sleep
        )
        self.generator.expected_weights_version = version
        return {
            "version": response.version,
            "engines": list(response.engines),
            "seconds": response.seconds,
            "attempts": retries.count + 1,
        }

    async def ensure_weights(
        self, weights_path: str, version: int, resilience: ResilienceSpec | None = None
    ) -> bool:
        """Before a rollout: the scheduler serves these weights (pushed again if not)."""
        spec = resilience or ResilienceSpec()
        pushed = await ensure_weights(self.generator.client, weights_path, version, spec)
        self.generator.expected_weights_version = version
        return pushed

    async def close(self) -> None:
        await self.generator.close()
        await self.tools.close()
        self.scorer.close()
