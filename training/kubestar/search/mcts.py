"""The search drivers: rStar-Math's MCTS and step-level beam search, over three small
interfaces so that the real services plug in: a `Policy` that proposes next steps, an
`Executor` that runs programs, and `Scorer`s that value nodes (ground truth when generating
training data, the process preference model at test time).

MCTS, one rollout: from the root, select down to a leaf (`tree.select`), expand it into
`children` steps, run their code in one batch, value the new children, then continue from
the expanded node until nothing below it is left to search. Values:

* an answer: `answer_value` (the ground-truth reward, or the PPM's score), backpropagated to
  the root: this is what moves Q;
* any other terminal (code errors, too deep, unparsable): `negative_reward`, on the node
  alone;
* an open step, when a `step_value` scorer is given: its score, on the node alone. It seeds
  the step's Q so that selection prefers steps the PPM likes before they are visited.

Beam search: expand each of `beam_width` (B1) beams into `beam_samples` (B2) steps, score the
candidates with the scorer and keep the best B1 of them: the open ones are the next beams, an
answer among them is a finished beam and narrows the beam by one. Every answer found is kept
for the final vote.

The final answer of either: a vote over the `top_k` top-scored answers (`tree.vote`).

MCTS is anytime: its rollouts run one after another, and what it answers after r of them
depends on the tree after r of them alone. `MCTS.grow` runs them one at a time so that a
caller can read the answer (`MCTS.result`) at each r of one search: with the same policy and
random stream, what a search of r rollouts would have ended with (`kubestar.search.sweep`
reads several rollout budgets off one search per problem this way). Beam search is not:
its width decides which candidates survive at every depth, so a narrower search is not a
prefix of a wider one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kubestar.search.steps import StepFormat, StepKind, replay
from kubestar.search.tree import (
    Equivalence,
    Node,
    SearchSettings,
    Terminal,
    add_children,
    answer_terminals,
    backpropagate,
    check_depth,
    ranked,
    record_execution,
    same_answer,
    select,
    vote,
)


@dataclass(frozen=True)
class Proposal:
    """One step the policy wrote: its text (stop string included) and its token ids."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Execution:
    """What one program printed (stdout and stderr) and whether it failed."""

    output: str
    failed: bool


class Policy(Protocol):
    async def propose(self, node: Node, n: int) -> list[Proposal]:
        """Up to n next steps after `node`, sampled from one prompt: the token ids along the
        node's path (the root's prompt ids, then each step's ids followed by its tokenised
        observation), never re-tokenised text. Stops at the step format's `stops`, which the
        proposal's text and ids include."""
        ...


class Executor(Protocol):
    async def run(self, programs: Sequence[str]) -> list[Execution]:
        """Run a batch of programs; one result per program, in order."""
        ...


class Scorer(Protocol):
    async def score(self, nodes: Sequence[Node]) -> list[float]:
        """One value per node, in order, higher is better; a PPM's raw score squashed into
        [-1, 1] as rStar does, so that it is on the scale of the ground-truth rewards."""
        ...


class GroundTruth:
    """The value of an answer when the reference is known: `positive_reward` when the
    answer is equivalent to it, else `negative_reward` (used to build training data)."""

    def __init__(
        self,
        reference: str,
        settings: SearchSettings | None = None,
        equivalent: Equivalence = same_answer,
    ) -> None:
        self.reference = reference
        self.settings = settings or SearchSettings()
        self.equivalent = equivalent

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        return [
            self.settings.positive_reward
            if node.answer is not None and self.equivalent(node.answer, self.reference)
            else self.settings.negative_reward
            for node in nodes
        ]


@dataclass
class SearchResult:
    root: Node
    answer: str | None  # the voted answer
    answers: list[Node]  # every answer node, best-scored first


async def expand(
    node: Node,
    n: int,
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    settings: SearchSettings,
) -> list[Node]:
    """Grow `node` by up to n steps: propose, drop duplicates, read each step, run the code
    of the open ones in one batch, and apply the terminal rules. Returns the new children."""
    proposals = await policy.propose(node, n)
    children = add_children(node, [(p.text, p.token_ids) for p in proposals])
    await settle(children, executor, step_format, settings)
    return children


async def settle(
    children: Sequence[Node], executor: Executor, step_format: StepFormat, settings: SearchSettings
) -> None:
    """Read each new step, run the code of the open ones in one batch (whatever nodes they
    hang under), and apply the terminal rules."""
    to_run: list[Node] = []
    for child in children:
        step = step_format.parse(child.text)
        if step.kind is StepKind.ANSWER:
            child.terminal, child.answer = Terminal.ANSWER, step.answer
        elif step.kind is StepKind.UNPARSABLE:
            child.terminal = Terminal.UNPARSABLE
        else:
            child.code = step.code
            check_depth(child, settings)
            if child.terminal is None:
                to_run.append(child)
    if to_run:
        results = await executor.run([replay(child) for child in to_run])
        for child, result in zip(to_run, results, strict=True):
            record_execution(child, result.output, result.failed, settings)
            child.observation = step_format.observation(child, result.failed)


class MCTS:
    """rStar-Math's Monte Carlo tree search for one problem (see the module docstring)."""

    def __init__(
        self,
        policy: Policy,
        executor: Executor,
        step_format: StepFormat,
        answer_value: Scorer,
        step_value: Scorer | None = None,
        settings: SearchSettings | None = None,
        equivalent: Equivalence = same_answer,
    ) -> None:
        self.policy = policy
        self.executor = executor
        self.step_format = step_format
        self.answer_value = answer_value
        self.step_value = step_value
        self.settings = settings or SearchSettings()
        self.equivalent = equivalent

    async def search(self, root: Node | None = None) -> SearchResult:
        root = root if root is not None else Node.root()
        async for _ in self.grow(root):
            pass
        return self.result(root)

    async def grow(self, root: Node) -> AsyncIterator[int]:
        """The rollouts of `search`, one at a time: yields the number done after each, up to
        `settings.rollouts`, and stops early, as `search` does, once nothing below the root
        is left to search. Between two yields nothing touches the tree (the next rollout
        starts only when the caller asks for it), so `result` read at a yield of r is what a
        search of r rollouts returns; the policy's requests so far are its requests too."""
        for done in range(1, self.settings.rollouts + 1):
            if root.terminal is not None:
                return
            await self.rollout(root)
            yield done

    def result(self, root: Node) -> SearchResult:
        """The answer of the tree as it stands: what `search` returns at its end."""
        return _result(root, self.settings, self.equivalent)

    async def rollout(self, root: Node) -> None:
        start = root
        while (leaf := select(start, self.settings.c)) is not None:
            children = await expand(
                leaf,
                self.settings.children,
                self.policy,
                self.executor,
                self.step_format,
                self.settings,
            )
            await self.evaluate(children)
            start = leaf

    async def evaluate(self, children: Sequence[Node]) -> None:
        answers = [c for c in children if c.terminal is Terminal.ANSWER]
        dead = [c for c in children if c.terminal not in (None, Terminal.ANSWER)]
        open_steps = [c for c in children if c.terminal is None]
        for node in dead:
            node.update(self.settings.negative_reward)
        if answers:
            values = await self.answer_value.score(answers)
            for node, value in zip(answers, values, strict=True):
                backpropagate(node, value)
        if open_steps and self.step_value is not None:
            values = await self.step_value.score(open_steps)
            for node, value in zip(open_steps, values, strict=True):
                node.update(value)


async def beam_search(
    policy: Policy,
    executor: Executor,
    step_format: StepFormat,
    scorer: Scorer,
    settings: SearchSettings | None = None,
    equivalent: Equivalence = same_answer,
    root: Node | None = None,
) -> SearchResult:
    """Step-level beam search with B1 = `beam_width` beams of B2 = `beam_samples` samples,
    ranked by `scorer` (see the module docstring)."""
    settings = settings or SearchSettings()
    root = root if root is not None else Node.root()
    beams, width = [root], settings.beam_width
    while beams and width > 0:
        grown = await asyncio.gather(
            *(
                expand(beam, settings.beam_samples, policy, executor, step_format, settings)
                for beam in beams
            )
        )
        candidates = [
            child
            for children in grown
            for child in children
            if child.terminal in (None, Terminal.ANSWER)
        ]
        if not candidates:
            break
        for node, value in zip(candidates, await scorer.score(candidates), strict=True):
            node.update(value)
        top = ranked(candidates)[:width]
        width -= sum(1 for node in top if node.terminal is Terminal.ANSWER)
        beams = [node for node in top if node.terminal is None]
    return _result(root, settings, equivalent)


def _result(root: Node, settings: SearchSettings, equivalent: Equivalence) -> SearchResult:
    answers = ranked(answer_terminals(root))
    return SearchResult(root, vote(answers, settings.top_k, equivalent), answers)
