"""A sweep reads MCTS's rollout budgets off one search per problem: budgets 2,4,8 send as many
generation requests as one search of 8, and each budget's answer, tokens, requests and tree
are those of a search of that many rollouts on the same seeds.

The policy is scripted: a Generate stand-in whose sample i of a request seeded s is drawn from
(prompt, s + i) alone, as a seeded engine samples, so that two searches that send the same
requests grow the same trees."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

from kubestar.search.adapters import SandboxExecutor, StepSampling
from kubestar.search.solve import SolverStack
from kubestar.search.steps import RStarFormat
from kubestar.search.sweep import SweepPoint, SweepSettings, sweep
from kubestar.search.tree import Node, SearchSettings, node_records
from kubestar.training.datasets import Problem
from kubestar.v1 import rollout_pb2 as rpb

from tests.search.service_fakes import FakeSandbox, decode, encode
from tests.search.test_solve import judge

PROMPT_FORMAT = RStarFormat()
# One question that ends at once: its only step is one answer, so the root is exhausted after
# the first rollout (the early stop every budget must read alike).
DEAD_END = "Say 2."
PROBLEMS = [
    Problem("a", "Pick a number.", "1"),
    Problem("b", "Pick another number.", "3"),
    Problem("c", "Pick a third number.", "3"),
    Problem("d", DEAD_END, "2"),
]
SEARCH = SearchSettings(children=3, max_depth=4, top_k=3)
SAMPLING = StepSampling(seed=11)
BUDGETS = (2, 4, 8)


def step(prompt: str, seed: int) -> str:
    """The step the scripted policy writes after `prompt` for one sample's seed: an answer
    (1 to 3), a line of code, or (rarely) code that fails."""
    if DEAD_END in prompt:
        return "<answer>The answer is \\boxed{2}<end_of_answer>"
    draw = random.Random(f"{seed}|{prompt}")
    roll = draw.random()
    depth = prompt.count("<end_of_step>") + prompt.count("<end_of_code>")
    if roll < 0.15 + 0.25 * min(depth, 1):  # answers deeper down, so the trees branch
        return f"<answer>The answer is \\boxed{{{draw.randint(1, 3)}}}<end_of_answer>"
    if roll < 0.3 + 0.2 * min(depth, 1):
        return "<code>\nprint(undefined)\n<end_of_code>"
    return f"<code>\nx = {draw.randint(0, 999)}\n<end_of_step>"


class ScriptedScheduler:
    """Generate without engines (see the module docstring); records every request as
    (tree key, prompt ids, seed, n)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, tuple[int, ...], int, int]] = []

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: rpb.SamplingParams | None = None,
        n: int = 1,
    ) -> rpb.GenerateResponse:
        assert sampling is not None and sampling.seed, "the policy seeds every request"
        self.requests.append((trajectory_id, tuple(prompt_token_ids), sampling.seed, n))
        prompt = decode(prompt_token_ids)
        texts = [step(prompt, sampling.seed + index) for index in range(n)]
        return rpb.GenerateResponse(
            completions=[rpb.Completion(token_ids=encode(text), text=text) for text in texts]
        )

    async def end_trajectory(self, trajectory_id: str) -> None:
        return None

    def by_problem(self) -> dict[str, list[tuple[tuple[int, ...], int, int]]]:
        """Each problem's requests in order (a tree's key ends with its problem's id)."""
        grouped: dict[str, list[tuple[tuple[int, ...], int, int]]] = defaultdict(list)
        for key, prompt, seed, n in self.requests:
            grouped[key.rsplit("-", 1)[-1]].append((prompt, seed, n))
        return dict(grouped)


class PathScorer:
    """A PPM stand-in: a fixed value in [-1, 1] per path, so that the vote's ranking varies
    from node to node but not from run to run."""

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        return [
            random.Random("".join(n.full_text for n in node.path())).uniform(-1.0, 1.0)
            for node in nodes
        ]


async def run(
    budgets: tuple[int, ...], anytime: bool = True
) -> tuple[list[SweepPoint], ScriptedScheduler]:
    scheduler = ScriptedScheduler()
    stack = SolverStack(
        scheduler, SandboxExecutor(FakeSandbox()), PROMPT_FORMAT, encode, judge, PathScorer()
    )
    settings = SweepSettings(
        modes=("mcts",), budgets=budgets, search=SEARCH, sampling=SAMPLING, anytime=anytime
    )
    done: list[tuple[str, int, str]] = []
    points = await sweep(
        PROBLEMS,
        settings,
        stack,
        on_done=lambda mode, budget, solved: done.append((mode, budget, solved.problem.id)),
    )
    assert sorted(done) == sorted(("mcts", b, p.id) for b in budgets for p in PROBLEMS)
    return points, scheduler


def outcomes(point: SweepPoint) -> list[tuple[object, ...]]:
    """What a point says of each problem, its tree included (as `--output` writes it)."""
    return [
        (s.answer, s.correct, s.generated_tokens, s.requests, node_records(s.root))
        for s in point.solved
    ]


async def test_one_search_per_problem_answers_every_rollout_budget() -> None:
    read, shared = await run(BUDGETS)
    fresh, separate = await run(BUDGETS, anytime=False)
    (largest,), alone = await run((8,))

    # The cost: the sweep of 2, 4 and 8 rollouts sends exactly the requests of one search of
    # 8, each problem the same requests (prompt, seed, n) in the same order; searching each
    # budget afresh sends those of 2 + 4 + 8.
    assert len(shared.requests) == len(alone.requests) == 42
    assert len(separate.requests) == 99
    assert shared.by_problem() == alone.by_problem()

    # Every budget reads what a search of that many rollouts on the same seeds returns: the
    # answer, the tokens and requests spent, and the tree.
    assert [(p.mode, p.budget, p.read_from) for p in read] == [("mcts", b, 8) for b in BUDGETS]
    assert [(p.budget, p.read_from) for p in fresh] == [(b, 0) for b in BUDGETS]
    for shared_point, fresh_point in zip(read, fresh, strict=True):
        assert outcomes(shared_point) == outcomes(fresh_point), shared_point.budget
    assert outcomes(read[-1]) == outcomes(largest)
    # ... and a search of r rollouts sends the first requests of a search of 8.
    separate_by_problem = separate.by_problem()
    for problem in PROBLEMS:
        requests = separate_by_problem[problem.id]
        counts = [s.requests for p in fresh for s in p.solved if s.problem.id == problem.id]
        assert sum(counts) == len(requests)
        offset = 0
        for count in counts:
            assert requests[offset : offset + count] == alone.by_problem()[problem.id][:count]
            offset += count

    # The budgets see different trees (the test would prove little otherwise): b grows at
    # every budget, a and c stop early between 4 and 8 (their roots exhausted), d after one
    # rollout; a's answer changes with the budget.
    sent = {p.budget: [s.requests for s in p.solved] for p in read}
    assert sent == {2: [6, 9, 6, 1], 4: [10, 16, 8, 1], 8: [10, 23, 8, 1]}
    answers = {p.budget: [s.answer for s in p.solved] for p in read}
    assert answers == {2: ["3", "3", "1", "2"], 4: ["1", "3", "1", "2"], 8: ["1", "3", "1", "2"]}
    assert [p.accuracy for p in read] == [0.5, 0.75, 0.75]
    # d's root is exhausted within its first rollout: every budget reads its final tree.
    assert len({str(outcomes(p)[-1]) for p in read}) == 1
    # The largest budget's point is the run's (its counters and wall time); the smaller ones
    # take a share of the time.
    assert 0 < read[0].seconds <= read[1].seconds <= read[2].seconds
    assert read[2].figures()["read_from"] == 8
