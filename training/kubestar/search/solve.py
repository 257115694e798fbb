"""Solving a problem set by search or by a baseline, on the fleet and the sandbox: what
`kubestar solve` runs.

Each problem gets its own tree: a root holding the question in the step format's prompt (and
its token ids), a `SchedulerPolicy` whose requests carry the tree's affinity key, and the
mode's driver:

* `mcts`: rStar-Math's MCTS, valued by the PPM (answers and new steps), or by the reference
  answer with `ground_truth` (to make training data; its accuracy is then not a test-time
  figure);
* `beam`: step-level beam search ranked by the PPM;
* `greedy`: one chain at temperature 0;
* `majority`: a vote over `samples` chains;
* `best-of-n`: the PPM's favourite of `samples` chains;
* `ppm-vote`: a vote over `samples` chains, each weighted by its PPM value.

Every mode counts the tokens its policy generated for the problem (samples dropped as
duplicates included): search and baselines are compared at the same generated-token budget,
and `token_budget` makes majority, best-of-n and ppm-vote draw chains until they spent it.

`Solver.solve_rollouts` answers MCTS at several rollout budgets from one search per problem
(MCTS is anytime: `MCTS.grow`): what a sweep over rollout budgets runs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kubestar.search.adapters import Generate, SchedulerPolicy, StepSampling
from kubestar.search.baselines import best_of_n, greedy, majority_vote, ppm_vote
from kubestar.search.mcts import MCTS, Executor, GroundTruth, Scorer, SearchResult, beam_search
from kubestar.search.ppm_data import Encode
from kubestar.search.steps import StepFormat
from kubestar.search.tree import Node, SearchSettings, node_records, tree_from_records
from kubestar.training.datasets import Problem

MCTS_MODE = "mcts"
BEAM = "beam"
GREEDY = "greedy"
MAJORITY = "majority"
BEST_OF_N = "best-of-n"
PPM_VOTE = "ppm-vote"
MODES = (MCTS_MODE, BEAM, GREEDY, MAJORITY, BEST_OF_N, PPM_VOTE)
# The modes that need values: the PPM (MCTS may take the reference answer instead).
SCORED_MODES = frozenset({MCTS_MODE, BEAM, BEST_OF_N, PPM_VOTE})
# The modes that sample whole chains, `samples` at a time, up to `token_budget`.
CHAIN_MODES = frozenset({MAJORITY, BEST_OF_N, PPM_VOTE})

# (answer, reference) -> reward, 1.0 when the answer is right (RewardScorer.score).
Judge = Callable[[str | None, str], Awaitable[float]]


@dataclass(frozen=True)
class SolveSettings:
    mode: str
    search: SearchSettings = field(default_factory=SearchSettings)
    sampling: StepSampling = field(default_factory=StepSampling)
    samples: int = 8  # majority, best-of-n, ppm-vote: chains (per wave with a token budget)
    token_budget: int = 0  # the same: generated tokens per problem (0: one wave)
    ground_truth: bool = False  # mcts: values from the reference answer
    concurrency: int = 4  # problems searched at once
    max_context: int = 0  # the engines' context length (0: unknown)
    affinity: bool = True  # a tree's requests share one affinity key

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.ground_truth and self.mode != MCTS_MODE:
            raise ValueError("ground-truth values are for mcts (to make training data)")
        if self.samples < 1 or self.concurrency < 1:
            raise ValueError("samples and concurrency must be at least 1")


@dataclass
class Solved:
    """One problem's outcome and its tree."""

    problem: Problem
    mode: str
    answer: str | None
    correct: bool
    generated_tokens: int
    requests: int
    seconds: float
    root: Node

    def record(self) -> dict[str, Any]:
        """One line of the trees file."""
        return {
            "problem": self.problem.id,
            "question": self.problem.question,
            "reference": self.problem.answer,
            "mode": self.mode,
            "answer": self.answer,
            "correct": self.correct,
            "generated_tokens": self.generated_tokens,
            "requests": self.requests,
            "seconds": round(self.seconds, 3),
            "nodes": node_records(self.root),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], problem: Problem) -> Solved:
        """`problem`'s outcome read back from its line of a trees file (`record`)."""
        return cls(
            problem=problem,
            mode=record["mode"],
            answer=record["answer"],
            correct=record["correct"],
            generated_tokens=record["generated_tokens"],
            requests=record["requests"],
            seconds=record["seconds"],
            root=tree_from_records(record["nodes"]),
        )


@dataclass(frozen=True)
class SolverStack:
    """What every Solver of one set of services shares: the scheduler, the executor, the step
    format and the policy's tokenizer, the judge and the PPM (None without one). Several
    modes and budgets are solved on one stack (`kubestar.search.sweep`)."""

    scheduler: Generate
    executor: Executor
    step_format: StepFormat
    encode: Encode
    judge: Judge
    scorer: Scorer | None = None

    def solver(self, settings: SolveSettings) -> Solver:
        return Solver(
            self.scheduler,
            self.executor,
            self.step_format,
            self.encode,
            settings,
            self.judge,
            self.scorer,
        )


class Solver:
    """Solves problems with one mode against one scheduler and one executor (see the module
    docstring). `scorer`: the PPM, for the modes that need values; `judge` says whether an
    answer is right."""

    def __init__(
        self,
        scheduler: Generate,
        executor: Executor,
        step_format: StepFormat,
        encode: Encode,
        settings: SolveSettings,
        judge: Judge,
        scorer: Scorer | None = None,
    ) -> None:
        if settings.mode in SCORED_MODES and scorer is None and not settings.ground_truth:
            raise ValueError(f"{settings.mode} needs a scorer (a PPM)")
        self.scheduler = scheduler
        self.executor = executor
        self.step_format = step_format
        self.encode = encode
        self.settings = settings
        self.judge = judge
        self.scorer = scorer
        self.run_id = uuid.uuid4().hex[:8]

    def _sampling(self) -> StepSampling:
        sampling = self.settings.sampling
        return replace(sampling, temperature=0.0) if self.settings.mode == GREEDY else sampling

    async def solve(self, problem: Problem) -> Solved:
        started = time.monotonic()
        root, policy = self._tree(problem)
        try:
            result = await self._search(root, policy, problem)
        finally:
            await policy.end()
        reward = await self.judge(result.answer, problem.answer)
        seconds = time.monotonic() - started
        return self._solved(
            problem, result, reward, policy.generated_tokens, policy.requests, seconds
        )

    async def solve_rollouts(self, problem: Problem, budgets: Sequence[int]) -> list[Solved]:
        """MCTS at each rollout budget of `budgets` from one search of the largest: one
        Solved per budget, ascending, each what `solve` with `rollouts` set to that budget
        returns on the same random stream, at the cost of the largest alone.

        At each smaller budget r the tree is read after r rollouts (`MCTS.grow`): the answer
        by `MCTS.result` (the search's own vote), the tokens and requests the policy spent
        so far, and a copy of the tree. A search of r rollouts sends the same requests, with
        the same seeds (a policy seeds its k-th request by the seed and k alone: `SEED_STRIDE`),
        since nothing before its end depends on `rollouts`; one that stops early (the root
        exhausted) stops at the same rollout, and every budget past it reads the final tree.
        Unseeded, the answer at r is that of a search of r rollouts that drew those samples.
        `seconds` is the time from the problem's start to the read."""
        if self.settings.mode != MCTS_MODE:
            raise ValueError(f"only mcts answers several budgets at once, not {self.settings.mode}")
        marks = sorted(set(budgets))
        if not marks or marks[0] < 1:
            raise ValueError("give at least one rollout budget, each at least 1")
        started = time.monotonic()
        root, policy = self._tree(problem)
        mcts = self._mcts(policy, problem, replace(self.settings.search, rollouts=marks[-1]))
        # (result, generated tokens, requests, seconds) at each budget read so far.
        reads: list[tuple[SearchResult, int, int, float]] = []

        def read(tree: Node) -> None:
            reads.append(
                (
                    mcts.result(tree),
                    policy.generated_tokens,
                    policy.requests,
                    time.monotonic() - started,
                )
            )

        try:
            async for done in mcts.grow(root):
                if done in marks[:-1]:
                    # A copy: the rollouts to come grow this tree (and a sweep writes each
                    # budget's tree as it was).
                    read(copy.deepcopy(root))
        finally:
            await policy.end()
        # The largest budget, and any past an early stop: the final tree itself.
        final = len(reads)
        read(root)
        reads += reads[final:] * (len(marks) - len(reads))
        solved: list[Solved] = []
        for result, tokens, requests, seconds in reads:
            reward = await self.judge(result.answer, problem.answer)
            solved.append(self._solved(problem, result, reward, tokens, requests, seconds))
        return solved

    def _tree(self, problem: Problem) -> tuple[Node, SchedulerPolicy]:
        """A problem's root and the policy that grows its tree (under the tree's key)."""
        prompt = self.step_format.prompt(problem.question)
        root = Node.root(prompt, self.encode(prompt))
        policy = SchedulerPolicy(
            self.scheduler,
            self.step_format,
            self.encode,
            tree_id=f"solve-{self.run_id}-{problem.id}",
            sampling=self._sampling(),
            max_context=self.settings.max_context,
            affinity=self.settings.affinity,
        )
        return root, policy

    def _solved(
        self,
        problem: Problem,
        result: SearchResult,
        reward: float,
        generated_tokens: int,
        requests: int,
        seconds: float,
    ) -> Solved:
        return Solved(
            problem=problem,
            mode=self.settings.mode,
            answer=result.answer,
            correct=reward > 0,
            generated_tokens=generated_tokens,
            requests=requests,
            seconds=seconds,
            root=result.root,
        )

    def _mcts(self, policy: SchedulerPolicy, problem: Problem, search: SearchSettings) -> MCTS:
        """MCTS valued by the PPM, or by the reference answer with `ground_truth`."""
        fmt, executor, scorer = self.step_format, self.executor, self.scorer
        if self.settings.ground_truth:
            return MCTS(policy, executor, fmt, GroundTruth(problem.answer, search), None, search)
        assert scorer is not None
        return MCTS(policy, executor, fmt, scorer, scorer, search)

    async def _search(self, root: Node, policy: SchedulerPolicy, problem: Problem) -> SearchResult:
        s = self.settings
        fmt, executor, scorer = self.step_format, self.executor, self.scorer
        if s.mode == MCTS_MODE:
            return await self._mcts(policy, problem, s.search).search(root)
        if s.mode == BEAM:
            assert scorer is not None
            return await beam_search(policy, executor, fmt, scorer, s.search, root=root)
        if s.mode == GREEDY:
            return await greedy(policy, executor, fmt, s.search, root=root)

        def spent() -> int:
            return policy.generated_tokens

        if s.mode == MAJORITY:
            return await majority_vote(
                policy,
                executor,
                fmt,
                s.samples,
                s.search,
                root=root,
                token_budget=s.token_budget,
                spent=spent,
            )
        assert scorer is not None
        if s.mode == PPM_VOTE:
            return await ppm_vote(
                policy,
                executor,
                fmt,
                scorer,
                s.samples,
                s.search,
                root=root,
                token_budget=s.token_budget,
                spent=spent,
            )
        return await best_of_n(
            policy,
            executor,
            fmt,
            scorer,
            s.samples,
            s.search,
            root=root,
            token_budget=s.token_budget,
            spent=spent,
        )

    async def solve_all(
        self, problems: Sequence[Problem], on_done: Callable[[Solved], None] | None = None
    ) -> list[Solved]:
        """Every problem, `concurrency` at once; results in the problems' order."""
        gate = asyncio.Semaphore(self.settings.concurrency)

        async def one(problem: Problem) -> Solved:
            async with gate:
                solved = await self.solve(problem)
            if on_done is not None:
                on_done(solved)
            return solved

        return list(await asyncio.gather(*(one(problem) for problem in problems)))


def summary(solved: Sequence[Solved]) -> dict[str, Any]:
    """Accuracy and what it cost: generated tokens and requests per problem, tree sizes."""
    count = len(solved)
    tokens = [s.generated_tokens for s in solved]
    return {
        "problems": count,
        "correct": sum(s.correct for s in solved),
        "accuracy": sum(s.correct for s in solved) / count if count else 0.0,
        "answered": sum(s.answer is not None for s in solved) / count if count else 0.0,
        "generated_tokens": sum(tokens),
        "generated_tokens_per_problem": statistics.fmean(tokens) if tokens else 0.0,
        "requests_per_problem": statistics.fmean(s.requests for s in solved) if count else 0.0,
        "nodes_per_problem": (
            statistics.fmean(sum(1 for _ in s.root.walk()) - 1 for s in solved) if count else 0.0
        ),
        "seconds_per_problem": statistics.fmean(s.seconds for s in solved) if count else 0.0,
    }


def format_summary(mode: str, figures: dict[str, Any]) -> str:
    """What `kubestar solve` prints, one figure a line."""
    return "\n".join(
        [
            f"mode                  {mode}",
            f"accuracy              {figures['accuracy']:.3f} "
            f"({figures['correct']}/{figures['problems']} problems)",
            f"answered              {figures['answered']:.3f}",
            f"generated tokens      {figures['generated_tokens_per_problem']:.1f} per problem "
            f"({figures['generated_tokens']} in all)",
            f"requests              {figures['requests_per_problem']:.1f} per problem",
            f"tree nodes            {figures['nodes_per_problem']:.1f} per problem",
            f"time                  {figures['seconds_per_problem']:.1f} s per problem",
        ]
    )


def write_trees(path: str | Path, solved: Sequence[Solved]) -> Path:
    """One JSON line per problem: the problem, the answer, the budget spent and the tree's
    nodes (`tree.node_records`; `tree.tree_from_records` reads them back)."""
    target = Path(path)
    with target.open("w") as out:
        for outcome in solved:
            out.write(json.dumps(outcome.record()) + "\n")
    return target
