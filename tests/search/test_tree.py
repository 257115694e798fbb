"""The tree mechanics of rStar-Math's MCTS: selection, backpropagation, expansion, terminal
rules and the final vote."""

from __future__ import annotations

import math

import pytest
from kubestar.search.tree import (
    Node,
    SearchSettings,
    Terminal,
    add_children,
    backpropagate,
    check_depth,
    record_execution,
    select,
    selection_score,
    vote,
)


def grow(parent: Node, *texts: str) -> list[Node]:
    return add_children(parent, [(text, ()) for text in texts])


def visited(node: Node, n: int, w: float) -> Node:
    node.N, node.W = n, w
    return node


def test_selection_value_for_q_half_n_4_parent_10_c_2() -> None:
    # 0.5 + 2 * sqrt(ln 10 / 4) = 0.5 + 2 * 0.75871356... = 2.01742712...
    assert selection_score(0.5, 4, 10, 2.0) == pytest.approx(2.0174271293851467, rel=1e-12)
    assert selection_score(0.5, 4, 10, 2.0) == pytest.approx(0.5 + 2 * math.sqrt(math.log(10) / 4))


def test_an_unvisited_child_scores_zero() -> None:
    assert selection_score(0.9, 0, 10, 2.0) == 0.0
    # a visited child under an unvisited parent scores its Q alone (no exploration term)
    assert selection_score(-0.5, 2, 0, 2.0) == -0.5


def test_q_is_w_over_n_and_zero_while_unvisited() -> None:
    node = Node()
    assert node.Q == 0.0
    assert visited(node, 4, 3.0).Q == 0.75


def test_ties_go_to_the_first_child() -> None:
    root = visited(Node.root(), 3, 0.0)
    first, second, third = grow(root, "a", "b", "c")
    assert select(root, 2.0) is first  # all unvisited: all score 0
    visited(second, 1, 1.0)
    visited(third, 1, 1.0)
    assert select(root, 2.0) is second  # second and third tie above first: the first of them


def test_selection_prefers_a_child_that_led_to_correct_answers_over_an_untried_one() -> None:
    root = visited(Node.root(), 2, 0.0)
    good, fresh, bad = grow(root, "good", "fresh", "bad")
    visited(good, 1, 1.0)
    visited(bad, 1, -1.0)
    c = 0.1
    assert selection_score(bad.Q, 1, 2, c) < 0.0 < selection_score(good.Q, 1, 2, c)
    assert select(root, c) is good
    visited(good, 1, -1.0)
    assert select(root, c) is fresh  # after a wrong answer, the untried step (0) beats it


def test_selection_descends_to_a_leaf() -> None:
    root = visited(Node.root(), 4, 2.0)
    a, b = grow(root, "a", "b")
    visited(a, 3, 3.0)
    visited(b, 1, -1.0)
    a1, _ = grow(a, "a1", "a2")
    assert select(root, 2.0) is a1


def test_a_parent_whose_children_are_all_terminal_becomes_terminal() -> None:
    root = visited(Node.root(), 2, 1.0)
    a, b = grow(root, "a", "b")
    visited(a, 1, 1.0)  # the better score: selection goes there first
    (a1,) = grow(a, "a1")
    a1.terminal = Terminal.ANSWER
    assert select(root, 2.0) is b
    assert a.terminal is Terminal.EXHAUSTED
    b.terminal = Terminal.UNPARSABLE
    assert select(root, 2.0) is None
    assert root.terminal is Terminal.EXHAUSTED


def test_backpropagation_of_plus_plus_minus_plus() -> None:
    root = Node.root()
    (step,) = grow(root, "step")
    (leaf,) = grow(step, "leaf")
    for value in (1.0, 1.0, -1.0, 1.0):
        backpropagate(leaf, value)
    for node in (leaf, step, root):
        assert (node.N, node.W, node.Q) == (4, 2.0, 0.5)
    assert leaf.value == 1.0  # the first value the node received


def test_duplicate_steps_are_dropped() -> None:
    root = Node.root()
    children = add_children(root, [("x = 1", (1,)), ("x = 2", (2,)), ("x = 1", (1,))])
    assert [c.text for c in children] == ["x = 1", "x = 2"]
    assert [c.id for c in root.children] == ["0.1", "0.2"]
    assert [c.depth for c in children] == [1, 1]
    assert children[0].token_ids == (1,)
    assert add_children(root, [("x = 2", (2,)), ("x = 3", (3,))])[0].text == "x = 3"
    assert [c.id for c in root.children] == ["0.1", "0.2", "0.3"]


def test_a_node_that_gets_no_child_is_exhausted() -> None:
    root = Node.root()
    assert add_children(root, []) == []
    assert root.terminal is Terminal.EXHAUSTED


def test_a_step_below_max_depth_is_too_deep() -> None:
    settings = SearchSettings(max_depth=2)
    root = Node.root()
    (a,) = grow(root, "a")
    (b,) = grow(a, "b")
    (c,) = grow(b, "c")
    for node in (a, b, c):
        check_depth(node, settings)
    assert (a.terminal, b.terminal, c.terminal) == (None, None, Terminal.TOO_DEEP)
    (answer,) = grow(b, "answer")
    answer.terminal = Terminal.ANSWER
    (deep_answer,) = grow(c, "deep answer")
    deep_answer.terminal = Terminal.ANSWER
    check_depth(deep_answer, settings)
    assert deep_answer.terminal is Terminal.ANSWER  # an answer is kept at any depth


def test_too_many_code_errors_in_a_row() -> None:
    settings = SearchSettings(max_code_errors=2)
    root = Node.root()
    (first,) = grow(root, "fails")
    record_execution(first, "NameError", failed=True, settings=settings)
    assert (first.code_errors, first.terminal) == (1, None)
    (repaired,) = grow(first, "runs")
    record_execution(repaired, "3", failed=False, settings=settings)
    assert (repaired.code_errors, repaired.terminal) == (0, None)
    (again,) = grow(repaired, "fails again")
    record_execution(again, "ZeroDivisionError", failed=True, settings=settings)
    assert (again.code_errors, again.terminal) == (1, None)
    (twice,) = grow(again, "fails twice")
    record_execution(twice, "ZeroDivisionError", failed=True, settings=settings)
    assert (twice.code_errors, twice.terminal) == (2, Terminal.TOO_MANY_CODE_ERRORS)


def test_by_default_a_failed_step_is_a_dead_end() -> None:
    (step,) = grow(Node.root(), "x = 1/0")
    record_execution(step, "ZeroDivisionError", failed=True, settings=SearchSettings())
    assert step.terminal is Terminal.TOO_MANY_CODE_ERRORS
    assert step.code_failed and step.output == "ZeroDivisionError"


def answers(*scored: tuple[str, float]) -> list[Node]:
    nodes = []
    for answer, value in scored:
        node = Node(terminal=Terminal.ANSWER, answer=answer)
        node.update(value)
        nodes.append(node)
    return nodes


def test_vote_over_the_top_scored_answers() -> None:
    nodes = answers(("7", 0.9), ("12", 0.8), ("12.0", 0.7), ("5", 0.6), ("7", -0.9), ("7", -1))
    assert vote(nodes, top_k=4) == "12"  # 12 and 12.0 agree; the low 7s are out of the top 4
    assert vote(nodes, top_k=6) == "7"
    assert vote(nodes, top_k=1) == "7"


def test_a_tie_in_votes_goes_to_the_best_scored_answer() -> None:
    nodes = answers(("3", 0.1), ("4", 0.5), ("3", 0.2), ("4", 0.3))
    assert vote(nodes, top_k=4) == "4"
    assert vote([], top_k=4) is None
