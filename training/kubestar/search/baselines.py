"""The baselines search is measured against, on the same steps, sandbox and token count:
greedy decoding, a majority vote over N sampled solutions, and best-of-N by the PPM.

A solution is a chain of steps sampled one after another, each step read and its code
replayed exactly as in a search tree (`mcts.settle`), so that the only difference from MCTS
and beam search is how the steps are chosen. The N chains of a vote start with one request
of N samples (their prompt is the same), then grow side by side, one step each per round,
each round's programs run in one batch. Unlike a tree's expansion, equal chains are kept:
each is one sample and counts once in the vote. The chains hang under the problem's root
like a tree, so that they are written and read like one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kubestar.search.mcts import Executor, Policy, Scorer, SearchResult, settle
from kubestar.search.steps import StepFormat
from kubestar.search.tree import (
    Equivalence,
    Node,
    SearchSettings,
    add_children,
    answer_terminals,
    ranked,
    same_answer,
    vote,
)


async def sample_chains(
    root: Node,
    samples: int,
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    settings: SearchSettings,
) -> list[Node]:
    """Grow `samples` chains under `root` until each ends (an answer or another terminal);
    returns their first steps."""
    proposals = await policy.propose(root, samples)
    firsts = add_children(root, [(p.text, p.token_ids) for p in proposals], distinct=False)
    await settle(firsts, executor, step_format, settings)
    tips = [node for node in firsts if node.terminal is None]
    while tips:
        grown = await asyncio.gather(*(policy.propose(tip, 1) for tip in tips))
        steps = [
            child
            for tip, proposed in zip(tips, grown, strict=True)
            for child in add_children(tip, [(p.text, p.token_ids) for p in proposed[:1]])
        ]
        await settle(steps, executor, step_format, settings)
        tips = [node for node in steps if node.terminal is None]
    return firsts


async def greedy(
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    settings: SearchSettings | None = None,
    root: Node | None = None,
) -> SearchResult:
    """One chain (give the policy temperature 0): its answer, if it reached one."""
    settings = settings or SearchSettings()
    root = root if root is not None else Node.root()
    await sample_chains(root, 1, policy, executor, step_format, settings)
    answers = answer_terminals(root)
    return SearchResult(root, answers[0].answer if answers else None, answers)


async def majority_vote(
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    samples: int,
    settings: SearchSettings | None = None,
    equivalent: Equivalence = same_answer,
    root: Node | None = None,
    token_budget: int = 0,
    spent: Callable[[], int] | None = None,
) -> SearchResult:
    """The most frequent answer of `samples` chains (ties: the answer found first). With a
    `token_budget`, waves of `samples` chains are drawn until the policy generated that many
    tokens for the problem (`spent()` says how many it has)."""
    settings = settings or SearchSettings()
    root = await _waves(root, samples, policy, executor, step_format, settings, token_budget, spent)
    answers = answer_terminals(root)
    return SearchResult(root, vote(answers, len(answers), equivalent), answers)


async def best_of_n(
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    scorer: Scorer,
    samples: int,
    settings: SearchSettings | None = None,
    root: Node | None = None,
    token_budget: int = 0,
    spent: Callable[[], int] | None = None,
) -> SearchResult:
    """The answer of the chain the scorer (the PPM) values highest, of `samples` chains (or
    of waves of them up to a `token_budget`, as `majority_vote`)."""
    settings = settings or SearchSettings()
    root = await _waves(root, samples, policy, executor, step_format, settings, token_budget, spent)
    answers = answer_terminals(root)
    for node, value in zip(answers, await scorer.score(answers), strict=True):
        node.update(value)
    best = ranked(answers)
    return SearchResult(root, best[0].answer if best else None, best)


async def _waves(
    root: Node | None,
    samples: int,
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    settings: SearchSettings,
    token_budget: int,
    spent: Callable[[], int] | None,
) -> Node:
    root = root if root is not None else Node.root()
    while True:
        firsts = await sample_chains(root, samples, policy, executor, step_format, settings)
        if not token_budget or spent is None or not firsts or spent() >= token_budget:
            return root
