"""The baselines over a fake policy whose chains answer at once: the PPM-weighted vote against
the majority vote and best-of-N on the same chains, the weights it gives, and the waves of
chains drawn up to a token budget."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kubestar.search.baselines import (
    best_of_n,
    majority_vote,
    ppm_vote,
    vote_weight,
    weighted_vote,
)
from kubestar.search.mcts import Execution, Proposal
from kubestar.search.steps import RStarFormat
from kubestar.search.tree import Node, Terminal


def answer(value: str) -> str:
    return f"<answer>The answer is \\boxed{{{value}}}<end_of_answer>"


# Six chains: three reach 7, two reach 8, one reaches 9.
CHAINS = [answer("7")] * 3 + [answer("8")] * 2 + [answer("9")]


class AnsweringPolicy:
    """Sample i of the root answers CHAINS[i] (round and round); counts the tokens it wrote,
    one per character."""

    def __init__(self) -> None:
        self.generated_tokens = 0
        self.drawn = 0

    async def propose(self, node: Node, n: int) -> list[Proposal]:
        texts = [CHAINS[(self.drawn + i) % len(CHAINS)] for i in range(n)]
        self.drawn += n
        self.generated_tokens += sum(len(text) for text in texts)
        return [Proposal(text, tuple(range(len(text)))) for text in texts]


class NoCode:
    async def run(self, programs: Sequence[str]) -> list[Execution]:
        raise AssertionError("answer steps run no code")


class ValueByAnswer:
    """A PPM that values a chain by the answer it reached."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        return [self.values[str(node.answer)] for node in nodes]


# Many chains the PPM dislikes (7), fewer it likes (8), one it likes most (9).
VALUES = {"7": -0.9, "8": 0.5, "9": 0.9}


async def test_ppm_vote_picks_another_answer_than_majority_and_best_of_n() -> None:
    fmt = RStarFormat()
    majority = await majority_vote(AnsweringPolicy(), NoCode(), fmt, samples=6)
    best = await best_of_n(AnsweringPolicy(), NoCode(), fmt, ValueByAnswer(VALUES), samples=6)
    weighted = await ppm_vote(AnsweringPolicy(), NoCode(), fmt, ValueByAnswer(VALUES), samples=6)
    # majority: 3 chains; best-of-N: the top value; weighted: 2 x 0.75 = 1.5 beats
    # 3 x 0.05 = 0.15 and 1 x 0.95.
    assert (majority.answer, best.answer, weighted.answer) == ("7", "9", "8")
    assert len(weighted.answers) == 6
    assert all(node.terminal is Terminal.ANSWER for node in weighted.answers)
    assert [node.value for node in weighted.answers] == [0.9, 0.5, 0.5, -0.9, -0.9, -0.9]


async def test_ppm_vote_follows_the_majority_when_the_ppm_values_chains_alike() -> None:
    alike = ValueByAnswer({"7": 0.2, "8": 0.2, "9": 0.2})
    weighted = await ppm_vote(AnsweringPolicy(), NoCode(), RStarFormat(), alike, samples=6)
    assert weighted.answer == "7"


def test_every_chain_adds_weight_even_when_all_values_are_below_zero() -> None:
    """Bradley-Terry training fixes only differences: a PPM may value every chain below 0.
    Three chains at -0.5 still outweigh two at -0.4."""
    chains = [("7", -0.5)] * 3 + [("8", -0.4)] * 2
    nodes = [Node(id=str(i), answer=a, value=v) for i, (a, v) in enumerate(chains)]
    assert weighted_vote(sorted(nodes, key=lambda node: -(node.value or 0.0))) == "7"
    assert vote_weight(-1.0) == 0.0 and vote_weight(1.0) == 1.0 and vote_weight(0.0) == 0.5
    assert vote_weight(None) == 0.0 and vote_weight(3.0) == 1.0


def test_equal_weights_go_to_the_best_valued_chain() -> None:
    nodes = [Node(id="1", answer="5", value=0.6), Node(id="2", answer="6", value=0.6)]
    assert weighted_vote(nodes) == "5"
    assert weighted_vote(nodes[::-1]) == "6"
    assert weighted_vote([Node(id="1", answer=None, value=1.0)]) is None


@pytest.mark.parametrize("mode", ["majority", "ppm-vote"])
async def test_a_token_budget_tops_up_with_only_the_chains_it_needs(mode: str) -> None:
    """Every chain costs one answer's tokens. A budget of 5.5 chains: a first wave of 4, then
    2 more (the rest of the budget at 1.5 chains, rounded up), not another wave of 4."""
    policy = AnsweringPolicy()
    budget = int(5.5 * len(CHAINS[0]))
    if mode == "majority":
        result = await majority_vote(
            policy,
            NoCode(),
            RStarFormat(),
            samples=4,
            token_budget=budget,
            spent=lambda: policy.generated_tokens,
        )
    else:
        result = await ppm_vote(
            policy,
            NoCode(),
            RStarFormat(),
            ValueByAnswer(VALUES),
            samples=4,
            token_budget=budget,
            spent=lambda: policy.generated_tokens,
        )
    assert len(result.root.children) == 6
    assert budget <= policy.generated_tokens < budget + len(CHAINS[0])
