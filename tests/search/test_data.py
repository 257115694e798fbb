"""SFT traces and PPM preference pairs from hand-built trees (reference answer 42)."""

from __future__ import annotations

from kubestar.search.data import PpmPair, SftTrace, edit_distance, ppm_pairs, sft_traces
from kubestar.search.tree import Node, SearchSettings, Terminal, add_children

B_TEXT = "# add the two numbers from the statement\nx = 40 + 2\n<end_of_step>"


def grow(
    parent: Node,
    text: str,
    n: int,
    w: float,
    *,
    answer: str | None = None,
    terminal: Terminal | None = None,
    observation: str = "",
) -> Node:
    (child,) = add_children(parent, [(text, ())])
    child.N, child.W, child.observation = n, w, observation
    if answer is not None:
        child.terminal, child.answer = Terminal.ANSWER, answer
    else:
        child.terminal = terminal
    return child


def answer(parent: Node, value: str, w: float) -> Node:
    return grow(parent, f"So the answer is \\boxed{{{value}}}.<end_of_answer>", 1, w, answer=value)


def hand_built_tree() -> dict[str, Node]:
    """
    root
    ├── a   Q 0.5    ├── a1  \\boxed{42}
    │                └── a2  Q -1  └── a2x \\boxed{41}
    ├── b   Q 1      ├── b1  \\boxed{42}
    │                └── b2  Q 1 (its output mentions an error)  └── b2a \\boxed{42}
    ├── c   Q -1     └── c1  \\boxed{13}
    ├── d   Q 0.25   └── d1  \\boxed{43}     (d's step is b's with one character changed)
    └── e   too many code errors
    """
    root = Node.root("What is 6 * 7?")
    nodes = {"root": root}
    nodes["a"] = a = grow(root, "# multiply the two given factors\nx = 6 * 7\n<end_of_step>", 4, 2)
    nodes["a1"] = answer(a, "42", 1)
    nodes["a2"] = a2 = grow(a, "# subtract one for the offset\ny = x - 1\n<end_of_step>", 2, -2)
    nodes["a2x"] = answer(a2, "41", -1)
    nodes["b"] = b = grow(root, B_TEXT, 3, 3)
    nodes["b1"] = answer(b, "42", 1)
    nodes["b2"] = b2 = grow(
        b, "print(x)\n<end_of_code>", 1, 1, observation="\n<output>42 (no error)<end_of_output>"
    )
    nodes["b2a"] = answer(b2, "42", 1)
    nodes["c"] = c = grow(root, "# divide instead of multiplying\nx = 26 / 2\n<end_of_step>", 2, -2)
    nodes["c1"] = answer(c, "13", -1)
    nodes["d"] = d = grow(root, B_TEXT.replace("2\n", "3\n"), 4, 1)
    nodes["d1"] = answer(d, "43", -1)
    nodes["e"] = grow(
        root, "x = 1 / 0\n<end_of_step>", 1, -1, terminal=Terminal.TOO_MANY_CODE_ERRORS
    )
    return nodes


def test_sft_traces_are_the_top_correct_traces_by_q_without_errors() -> None:
    nodes = hand_built_tree()
    traces = sft_traces(nodes["root"], "42")
    # b->b1 (mean Q 1) before a->a1 (mean 0.75); b->b2->b2a ties b->b1 but mentions an error
    assert [trace.steps for trace in traces] == [
        (nodes["b"], nodes["b1"]),
        (nodes["a"], nodes["a1"]),
    ]
    assert [n.id for n in traces[0].steps] == ["0.2", "0.2.1"]
    assert traces[0].text == B_TEXT + "So the answer is \\boxed{42}.<end_of_answer>"
    assert traces[1].q_values == [0.5, 1.0]
    assert (traces[1].mean_q, traces[1].min_q, traces[1].answer) == (0.75, 0.5, "42")
    assert [
        trace.steps for trace in sft_traces(nodes["root"], "42", SearchSettings(sft_traces=1))
    ] == [(nodes["b"], nodes["b1"])]


def test_sft_trace_segments_mask_the_observations() -> None:
    nodes = hand_built_tree()
    b, b1, b2, b2a = (nodes[name] for name in ("b", "b1", "b2", "b2a"))
    assert sft_traces(nodes["root"], "42")[0].segments() == [(b.text, True), (b1.text, True)]
    assert SftTrace((b, b2, b2a)).segments() == [
        (b.text, True),
        (b2.text, True),
        (b2.observation, False),
        (b2a.text, True),
    ]


def test_ppm_pairs_with_their_filters() -> None:
    nodes = hand_built_tree()
    pairs = ppm_pairs(nodes["root"], "42")
    # At the root: chosen b (Q 1), a (0.5); rejected c (-1), d (0.25).
    #   (b, d): margin 0.75 but one character apart: dropped by the edit distance filter.
    #   (a, d): margin 0.25 < 0.5: dropped by the margin filter.
    # At a (both outcomes below it): a1 against a2, one candidate each.
    assert [(p.parent, p.chosen, p.rejected) for p in pairs] == [
        (nodes["root"], nodes["b"], nodes["c"]),
        (nodes["root"], nodes["a"], nodes["c"]),
        (nodes["a"], nodes["a1"], nodes["a2"]),
    ]
    assert [p.margin for p in pairs] == [2.0, 1.5, 2.0]
    assert pairs[0].chosen_path == (nodes["b"], nodes["b1"])  # b1 and b2 tie at Q 1: the first
    assert pairs[1].chosen_path == (nodes["a"], nodes["a1"])
    assert pairs[2].rejected_path == (nodes["a2"], nodes["a2x"])
    assert pairs[2].prefix == (nodes["a"],)
    assert edit_distance(nodes["b"].text, nodes["d"].text) == 1


def test_ppm_pairs_without_filters() -> None:
    nodes = hand_built_tree()
    loose = SearchSettings(pair_margin=0.0, pair_min_edit_distance=0)
    pairs = ppm_pairs(nodes["root"], "42", loose)
    assert [(p.chosen.id, p.rejected.id) for p in pairs] == [
        ("0.2", "0.3"),
        ("0.2", "0.4"),
        ("0.1", "0.3"),
        ("0.1", "0.4"),
        ("0.1.1", "0.1.2"),
    ]


def test_one_chosen_candidate_pairs_with_twice_as_many_rejected() -> None:
    root = Node.root()
    good = grow(root, "# the right idea, written out at length\nx = 42", 1, 1)
    answer(good, "42", 1)
    bad = [
        grow(root, f"# wrong idea number {i}, also written at length\nx = {i}", 1, -1 + i / 10)
        for i in range(5)
    ]
    for i, node in enumerate(bad):
        answer(node, str(i), -1)
    pairs = ppm_pairs(root, "42", SearchSettings(pair_min_edit_distance=0))
    assert [p.rejected for p in pairs] == bad[:4]  # the four lowest Q, lowest first
    assert all(isinstance(p, PpmPair) and p.chosen is good for p in pairs)


def test_a_pair_whose_chosen_continuation_scores_lower_is_dropped() -> None:
    root = Node.root()
    g = grow(root, "# chosen: a promising start that goes astray later", 2, 1)  # Q 0.5
    g1 = grow(g, "# then a shaky step that mostly fails", 10, -8)  # Q -0.8
    answer(g1, "42", 1)
    r = grow(root, "# rejected: a modest start with strong later steps", 2, 0)  # Q 0
    node = r
    for i in range(3):
        node = grow(node, f"# a strong step {i} that usually works out", 10, 9)  # Q 0.9
    answer(node, "41", -1)
    # margin 0.5 passes, but the chosen continuation's mean Q (0.5 - 0.8 + 1) / 3 = 0.23 is
    # below the rejected one's (0 + 0.9 * 3 - 1) / 5 = 0.34
    assert ppm_pairs(root, "42") == []
    answer(r, "40", -1)  # a short wrong continuation: mean (0 - 1) / 2 = -0.5
    assert [(p.chosen, p.rejected_path[-1].answer) for p in ppm_pairs(root, "42")] == [(g, "40")]


def test_edit_distance() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert edit_distance("same", "same") == 0
