"""The baselines search is measured against, on the same steps, sandbox and token count:
greedy decoding, a majority vote over N sampled solutions, best-of-N by the PPM, and a vote
weighted by the PPM.

A solution is a chain of steps sampled one after another, each step read and its code
replayed exactly as in a search tree (`mcts.settle`), so that the only difference from MCTS
and beam search is how the steps are chosen. The N chains of a vote start with one request
of N samples (their prompt is the same), then grow side by side, one step each per round,
each round's programs run in one batch. Unlike a tree's expansion, equal chains are kept:
each is one sample and counts once in the vote. The chains hang under the problem's root
like a tree, so that they are written and read like one.

With a token budget the chains are drawn in waves until the policy generated that many
tokens for the problem: the first wave has `samples` chains; each later one only as many as
the rest of the budget needs at the chains' mean length so far (at most `samples`), so that
a baseline ends close to the budget rather than up to a whole wave past it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

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


async def ppm_vote(
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    scorer: Scorer,
    samples: int,
    settings: SearchSettings | None = None,
    equivalent: Equivalence = same_answer,
    root: Node | None = None,
    token_budget: int = 0,
    spent: Callable[[], int] | None = None,
) -> SearchResult:
    """The answer with the most PPM weight over `samples` chains (or waves of them up to a
    `token_budget`, as `majority_vote`): see `weighted_vote`."""
    settings = settings or SearchSettings()
    root = await _waves(root, samples, policy, executor, step_format, settings, token_budget, spent)
    answers = answer_terminals(root)
    for node, value in zip(answers, await scorer.score(answers), strict=True):
        node.update(value)
    best = ranked(answers)
    return SearchResult(root, weighted_vote(best, equivalent), best)


def vote_weight(value: float | None) -> float:
    """A chain's weight in the PPM-weighted vote: its value mapped from [-1, 1] to [0, 1].

    The PPM is trained with the Bradley-Terry loss, which fixes only differences of rewards:
    its values may all lie below 0. Summed as they are, negative values would make an
    answer that more chains reach weigh less, and the vote would favour rare answers; as
    weights in [0, 1] every chain adds to its answer, more where the PPM values it more.
    """
    if value is None:
        return 0.0
    return (max(-1.0, min(1.0, value)) + 1.0) / 2.0


def weighted_vote(terminals: Sequence[Node], equivalent: Equivalence = same_answer) -> str | None:
    """The answer whose chains' weights (`vote_weight` of each chain's PPM value) sum highest.

    Between a majority vote (every chain weighs 1) and best-of-N (only the top chain
    counts): many chains that agree outweigh one that the PPM likes a little more, and a few
    that the PPM likes outweigh many that it does not. Equal weights go to the answer of the
    best-valued chain; `terminals` best-valued first (as `ranked` gives them).
    """
    groups: list[tuple[str, list[Node]]] = []
    for node in terminals:
        if node.answer is None:
            continue
        for answer, members in groups:
            if equivalent(node.answer, answer):
                members.append(node)
                break
        else:
            groups.append((node.answer, [node]))
    if not groups:
        return None
    weights = [math.fsum(vote_weight(node.value) for node in members) for _, members in groups]
    # max keeps the first of equal weights: the group of the best-valued chain.
    best = max(range(len(groups)), key=lambda index: weights[index])
    return groups[best][0]


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
    wave = samples
    while True:
        firsts = await sample_chains(root, wave, policy, executor, step_format, settings)
        if not token_budget or spent is None or not firsts:
            return root
        used = spent()
        if used >= token_budget:
            return root
        # The rest of the budget at the chains' mean length so far, one chain at the least.
        per_chain = used / len(root.children)
        wave = max(1, min(samples, math.ceil((token_budget - used) / max(per_chain, 1.0))))
