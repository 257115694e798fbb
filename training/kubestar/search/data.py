"""Training data from finished search trees (ground-truth values): SFT traces for the policy
and step-level preference pairs for the process preference model (PPM).

* SFT traces: the root-to-answer paths that end in a correct answer, best first by the mean Q
  of their steps (then the least Q), without any trace whose text mentions an error; the top
  `sft_traces` per problem. Q from many rollouts says how reliably a step leads to a correct
  answer, so the top traces are the ones whose every step is sound, not merely the lucky ones.
* PPM pairs: at every node with both a correct and a wrong answer below it, the children that
  lead to a correct answer, highest Q first, are paired with the children that lead to a wrong
  one, lowest Q first (`pair_children` of each; twice as many on one side when the other has a
  single candidate). A pair is kept when the chosen step's Q exceeds the rejected one's, by at
  least `pair_margin`, the chosen continuation (following the best child down to a correct
  answer) has the higher mean Q, and the two steps differ by at least
  `pair_min_edit_distance` characters (near-identical steps teach the PPM nothing). The
  search descends into every child that has both outcomes below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubestar.search.tree import (
    Equivalence,
    Node,
    SearchSettings,
    Terminal,
    answer_terminals,
    same_answer,
)


def _mean_q(nodes: Sequence[Node]) -> float:
    return sum(node.Q for node in nodes) / len(nodes) if nodes else 0.0


@dataclass(frozen=True)
class SftTrace:
    """A root-to-answer path (the root, which holds the question, is left out)."""

    steps: tuple[Node, ...]

    @property
    def text(self) -> str:
        return "".join(step.full_text for step in self.steps)

    @property
    def q_values(self) -> list[float]:
        return [step.Q for step in self.steps]

    @property
    def mean_q(self) -> float:
        return _mean_q(self.steps)

    @property
    def min_q(self) -> float:
        return min(self.q_values, default=0.0)

    @property
    def answer(self) -> str | None:
        return self.steps[-1].answer if self.steps else None

    def segments(self) -> list[tuple[str, bool]]:
        """(text, written by the policy) in order: the policy's steps are trained on, the
        tool's observations are masked out of the loss."""
        parts: list[tuple[str, bool]] = []
        for step in self.steps:
            parts.append((step.text, True))
            if step.observation:
                parts.append((step.observation, False))
        return parts


@dataclass(frozen=True)
class PpmPair:
    """Two sibling steps after the same prefix: one leads to a correct answer, one to a
    wrong one. `chosen_path` / `rejected_path` continue each step down the best (or worst)
    children to an answer."""

    parent: Node
    chosen: Node
    rejected: Node
    chosen_path: tuple[Node, ...]
    rejected_path: tuple[Node, ...]

    @property
    def prefix(self) -> tuple[Node, ...]:
        """The steps before the pair (the root excluded)."""
        return tuple(self.parent.path()[1:])

    @property
    def margin(self) -> float:
        return self.chosen.Q - self.rejected.Q


def is_correct(node: Node, reference: str, equivalent: Equivalence = same_answer) -> bool:
    return (
        node.terminal is Terminal.ANSWER
        and node.answer is not None
        and equivalent(node.answer, reference)
    )


def sft_traces(
    root: Node,
    reference: str,
    settings: SearchSettings | None = None,
    equivalent: Equivalence = same_answer,
) -> list[SftTrace]:
    """The top correct traces of a tree by Q (see the module docstring)."""
    settings = settings or SearchSettings()
    traces = [
        SftTrace(tuple(leaf.path()[1:]))
        for leaf in answer_terminals(root)
        if is_correct(leaf, reference, equivalent)
    ]
    clean = [trace for trace in traces if "error" not in trace.text.lower()]
    clean.sort(key=lambda trace: (trace.mean_q, trace.min_q), reverse=True)
    return clean[: settings.sft_traces]


def _outcomes(
    root: Node, reference: str, equivalent: Equivalence
) -> tuple[dict[Node, int], dict[Node, int]]:
    """How many correct and how many wrong answers lie at or below each node. Terminals that
    gave no answer (code errors, too deep, unparsable) count as neither."""
    correct: dict[Node, int] = {}
    wrong: dict[Node, int] = {}
    for node in reversed(list(root.walk())):  # children before parents
        answered = node.terminal is Terminal.ANSWER and node.answer is not None
        good = is_correct(node, reference, equivalent)
        correct[node] = int(good) + sum(correct[child] for child in node.children)
        wrong[node] = int(answered and not good) + sum(wrong[child] for child in node.children)
    return correct, wrong


def _continuation(node: Node, leads: dict[Node, int], best: bool) -> tuple[Node, ...]:
    """From `node` down the children that lead to the same outcome: the highest Q when
    `best`, else the lowest."""
    path = [node]
    while True:
        candidates = [child for child in path[-1].children if leads[child] > 0]
        if not candidates:
            return tuple(path)
        pick = max if best else min
        path.append(pick(candidates, key=lambda child: child.Q))


def ppm_pairs(
    root: Node,
    reference: str,
    settings: SearchSettings | None = None,
    equivalent: Equivalence = same_answer,
) -> list[PpmPair]:
    """Step-level preference pairs from a tree (see the module docstring)."""
    settings = settings or SearchSettings()
    correct, wrong = _outcomes(root, reference, equivalent)
    k = settings.pair_children
    pairs: list[PpmPair] = []
    queue = [root]
    while queue:
        node = queue.pop(0)
        to_correct = sorted(
            (c for c in node.children if correct[c]), key=lambda c: c.Q, reverse=True
        )
        to_wrong = sorted((c for c in node.children if wrong[c]), key=lambda c: c.Q)
        chosen, rejected = to_correct[:k], to_wrong[:k]
        if len(chosen) == 1:
            rejected = to_wrong[: 2 * k]
        if len(rejected) == 1:
            chosen = to_correct[: 2 * k]
        for good in chosen:
            good_path = _continuation(good, correct, best=True)
            for bad in rejected:
                bad_path = _continuation(bad, wrong, best=False)
                pair = PpmPair(node, good, bad, good_path, bad_path)
                if (
                    pair.margin > 0
                    and pair.margin >= settings.pair_margin
                    and _mean_q(good_path) > _mean_q(bad_path)
                    and edit_distance(good.full_text, bad.full_text)
                    >= settings.pair_min_edit_distance
                ):
                    pairs.append(pair)
        queue.extend(c for c in node.children if correct[c] and wrong[c])
    return pairs


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance in characters (insertions, deletions, substitutions)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]
