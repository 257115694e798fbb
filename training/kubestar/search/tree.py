"""The search tree of rStar-Math's test-time search: nodes with visit counts and values,
selection by Q + c*sqrt(ln N_parent / N), expansion, terminal rules, backpropagation, and the
vote that picks the final answer.

A node is one reasoning step: the text the policy wrote (with its token ids, so prompts are
rebuilt from ids and never re-tokenised), the Python code in it, and the observation the tool
appended after running it. The root is the question and holds no step.

Statistics follow the paper: N is the visit count, W the sum of the values backpropagated
through the node, Q = W / N (0 while unvisited). `value` is the first value the node received
(the score it was given when it was created, or its ground-truth reward): the score the final
vote ranks answers by.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubestar.training.rewards import quick_match

Equivalence = Callable[[str, str], bool]


def same_answer(answer: str, other: str) -> bool:
    """The default answer equivalence: equal strings or numbers after light normalisation
    (`16` and `16.0`, `$\\frac12$` and `\\frac12`). Pass math verification where it matters."""
    return quick_match(answer, other) is True


class Terminal(enum.StrEnum):
    """Why a node ends its branch. Every terminal node is skipped by selection."""

    ANSWER = "answer"  # the step gave a final answer (in `\boxed{}`)
    TOO_MANY_CODE_ERRORS = "too-many-code-errors"  # max_code_errors failed code steps in a row
    TOO_DEEP = "too-deep"  # a step below max_depth that is not an answer
    UNPARSABLE = "unparsable"  # neither code nor an answer could be read from the step
    # Not a step outcome: every child of the node is terminal (or the policy proposed none), so
    # nothing below it is left to search.
    EXHAUSTED = "exhausted"


@dataclass(frozen=True)
class SearchSettings:
    """Defaults of the search and of the data built from its trees (rStar-Math's values)."""

    c: float = 2.0  # exploration weight in the selection score
    children: int = 16  # steps proposed per MCTS expansion (n)
    rollouts: int = 8  # MCTS rollouts per problem
    max_depth: int = 16  # a non-answer step deeper than this is TOO_DEEP
    max_code_errors: int = 1  # this many failed code steps in a row end the branch
    positive_reward: float = 1.0  # ground-truth value of a correct answer
    negative_reward: float = -1.0  # value of a wrong answer and of any other terminal
    top_k: int = 4  # the final answer is voted over this many top-scored answers
    beam_width: int = 8  # B1: beams kept per step of beam search
    beam_samples: int = 8  # B2: steps sampled per beam
    sft_traces: int = 2  # SFT traces kept per problem (the top correct ones by Q)
    pair_children: int = 2  # PPM pairs: top/bottom children per side (twice that when the
    # other side has only one)
    pair_margin: float = 0.5  # PPM pairs: least Q(chosen) - Q(rejected)
    pair_min_edit_distance: int = 20  # PPM pairs: least edit distance between the two steps


@dataclass(eq=False)
class Node:
    """One step of the tree. Identity, not content, makes two nodes equal."""

    id: str = "0"  # the root is "0", its children "0.1", "0.2", ... (rStar's tags)
    parent: Node | None = field(default=None, repr=False)
    children: list[Node] = field(default_factory=list, repr=False)
    depth: int = 0
    text: str = ""  # what the policy wrote, stop string included
    token_ids: tuple[int, ...] = ()  # the policy's token ids of `text`
    code: str = ""  # the step's own Python code ("" for an answer)
    observation: str = ""  # the tool's text appended after the step (not the policy's)
    output: str = ""  # what the replayed program (ancestors' code + this step's) printed
    code_failed: bool = False
    code_errors: int = 0  # failed code steps in a row, ending with this one
    N: int = 0
    W: float = 0.0
    value: float | None = None
    terminal: Terminal | None = None
    answer: str | None = None

    @classmethod
    def root(cls, prompt: str = "", token_ids: Sequence[int] = ()) -> Node:
        """The root holds the prompt (the question in the step format's template) and its
        token ids: a node's prompt is then the ids along its path."""
        return cls(text=prompt, token_ids=tuple(token_ids))

    @property
    def Q(self) -> float:
        return self.W / self.N if self.N else 0.0

    @property
    def full_text(self) -> str:
        """The step as the next prompt shows it: the policy's text, then the observation."""
        return self.text + self.observation

    def path(self) -> list[Node]:
        """The nodes from the root down to this one, both included."""
        nodes: list[Node] = []
        node: Node | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def walk(self) -> Iterator[Node]:
        """This node and every node below it, parents before children, in tree order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def update(self, value: float) -> None:
        """Count one visit worth `value` at this node alone."""
        if self.value is None:
            self.value = value
        self.N += 1
        self.W += value


def selection_score(q: float, visits: int, parent_visits: int, c: float) -> float:
    """Q + c * sqrt(ln N_parent / N), as rStar computes it.

    An unvisited child scores 0, not infinity: a fresh step competes with its visited
    siblings on their Q, so a sibling that led to correct answers is preferred to an untried
    one, and an untried one to a sibling that led to wrong answers. While the parent is
    unvisited the exploration term is 0 and a child scores its Q alone.
    """
    if visits == 0:
        return 0.0
    if parent_visits == 0:
        return q
    return q + c * math.sqrt(math.log(parent_visits) / visits)


def best_child(node: Node, c: float) -> Node | None:
    """The non-terminal child with the highest selection score; ties go to the first child.
    None when every child is terminal."""
    best: Node | None = None
    best_score = -math.inf
    for child in node.children:
        if child.terminal is not None:
            continue
        score = selection_score(child.Q, child.N, node.N, c)
        if score > best_score:
            best, best_score = child, score
    return best


def select(start: Node, c: float) -> Node | None:
    """Descend from `start` by best child to a leaf that is not terminal (the node to expand).

    A node whose children are all terminal becomes terminal (EXHAUSTED) on the way, and the
    descent chooses again at its parent. None when nothing below `start` is left to search.
    """
    node = start
    while node.children:
        child = best_child(node, c)
        if child is not None:
            node = child
            continue
        node.terminal = Terminal.EXHAUSTED
        if node is start or node.parent is None:
            return None
        node = node.parent
    return None if node.terminal is not None else node


def add_children(
    node: Node, steps: Sequence[tuple[str, Sequence[int]]], distinct: bool = True
) -> list[Node]:
    """Add one child per proposed step (text, token ids) and return the new children.

    A step whose text repeats a sibling's (or an earlier step of the same batch) is dropped:
    sampling n continuations of one prompt often returns the same step twice, and two equal
    siblings would split one step's statistics. `distinct` False keeps every step: the
    independent samples of a vote, where each counts once. A node that receives no child at
    all is EXHAUSTED (there is nothing to search below it).
    """
    seen = {child.text for child in node.children}
    added: list[Node] = []
    for text, token_ids in steps:
        if distinct and text in seen:
            continue
        seen.add(text)
        child = Node(
            id=f"{node.id}.{len(node.children) + 1}",
            parent=node,
            depth=node.depth + 1,
            text=text,
            token_ids=tuple(token_ids),
        )
        node.children.append(child)
        added.append(child)
    if not node.children:
        node.terminal = Terminal.EXHAUSTED
    return added


def check_depth(node: Node, settings: SearchSettings) -> None:
    """A step deeper than max_depth that does not answer ends its branch (TOO_DEEP)."""
    if node.terminal is None and node.depth > settings.max_depth:
        node.terminal = Terminal.TOO_DEEP


def record_execution(node: Node, output: str, failed: bool, settings: SearchSettings) -> None:
    """Store what the node's replayed program printed; count failed code steps in a row.

    The count restarts at 0 after a step whose code ran, so only consecutive failures end a
    branch (TOO_MANY_CODE_ERRORS once they reach max_code_errors).
    """
    node.output = output
    node.code_failed = failed
    parent_errors = node.parent.code_errors if node.parent is not None else 0
    node.code_errors = parent_errors + 1 if failed else 0
    if failed and node.code_errors >= settings.max_code_errors and node.terminal is None:
        node.terminal = Terminal.TOO_MANY_CODE_ERRORS


def backpropagate(node: Node, value: float) -> None:
    """Add one visit worth `value` to the node and to every ancestor up to the root."""
    current: Node | None = node
    while current is not None:
        current.update(value)
        current = current.parent


def answer_terminals(root: Node) -> list[Node]:
    """Every node below `root` that gave an answer, in tree order."""
    return [node for node in root.walk() if node.terminal is Terminal.ANSWER]


def ranked(terminals: Sequence[Node]) -> list[Node]:
    """Answer nodes by score, highest first (unscored last; ties keep their order)."""
    return sorted(
        terminals,
        key=lambda node: node.value if node.value is not None else -math.inf,
        reverse=True,
    )


def vote(
    terminals: Sequence[Node], top_k: int, equivalent: Equivalence = same_answer
) -> str | None:
    """The final answer: a majority vote over the `top_k` top-scored answers.

    The scorer ranks, the vote settles: one high but wrong score is outvoted by several
    slightly lower answers that agree. A tie in votes goes to the answer ranked highest.
    """
    groups: list[list[Node]] = []
    for node in ranked(terminals)[: max(top_k, 1)]:
        if node.answer is None:
            continue
        for group in groups:
            if group[0].answer is not None and equivalent(node.answer, group[0].answer):
                group.append(node)
                break
        else:
            groups.append([node])
    if not groups:
        return None
    winner = max(groups, key=len)  # max keeps the first of equal lengths: the best-ranked
    return winner[0].answer


def node_records(root: Node) -> list[dict[str, Any]]:
    """The tree as a list of records, parents before children (what `kubestar solve` writes):
    each node's id and its parent's, the step's text and token ids, its code, the tool's
    observation, whether the code failed, N, W, Q, its first value, its terminal kind and
    its answer. `tree_from_records` reads them back."""
    return [
        {
            "id": node.id,
            "parent": node.parent.id if node.parent is not None else None,
            "depth": node.depth,
            "text": node.text,
            "token_ids": list(node.token_ids),
            "code": node.code,
            "observation": node.observation,
            "code_failed": node.code_failed,
            "N": node.N,
            "W": node.W,
            "Q": node.Q,
            "value": node.value,
            "terminal": node.terminal.value if node.terminal is not None else None,
            "answer": node.answer,
        }
        for node in root.walk()
    ]


def tree_from_records(records: Sequence[Mapping[str, Any]]) -> Node:
    """The root of a tree written by `node_records` (parents before children); Q follows
    from N and W. Raises ValueError for records that do not make one tree."""
    nodes: dict[str, Node] = {}
    root: Node | None = None
    for record in records:
        parent_id = record.get("parent")
        parent = nodes.get(parent_id) if parent_id is not None else None
        if parent_id is not None and parent is None:
            raise ValueError(
                f"node {record.get('id')!r}: parent {parent_id!r} comes later or not at all"
            )
        terminal = record.get("terminal")
        node = Node(
            id=str(record["id"]),
            parent=parent,
            depth=int(record.get("depth", parent.depth + 1 if parent is not None else 0)),
            text=str(record.get("text", "")),
            token_ids=tuple(record.get("token_ids") or ()),
            code=str(record.get("code", "")),
            observation=str(record.get("observation", "")),
            code_failed=bool(record.get("code_failed", False)),
            N=int(record.get("N", 0)),
            W=float(record.get("W", 0.0)),
            value=record.get("value"),
            terminal=Terminal(terminal) if terminal is not None else None,
            answer=record.get("answer"),
        )
        if parent is None:
            if root is not None:
                raise ValueError(f"node {node.id!r}: a second root")
            root = node
        else:
            parent.children.append(node)
        nodes[node.id] = node
    if root is None:
        raise ValueError("no nodes")
    return root
