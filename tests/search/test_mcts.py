"""The search drivers over a deterministic fake policy and executor: a small world of steps
in which one path leads to the correct answer (42), searched with an oracle scorer and with
an adversarial one."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from kubestar.search.data import sft_traces
from kubestar.search.mcts import (
    MCTS,
    Execution,
    GroundTruth,
    Proposal,
    SearchResult,
    beam_search,
    expand,
)
from kubestar.search.steps import RStarFormat
from kubestar.search.tree import Node, SearchSettings, Terminal

A = "<code>\n# try a product\nx = 6 * 6\n<end_of_step>"
A1 = "# add one more\nx = x + 1\n<end_of_step>"
B = "<code>\n# try a sum\nx = 40\n<end_of_step>"
B1 = "# add the rest\nx = x + 2\nprint(x)\n<end_of_code>"
C = "<code>\n# try a power\nx = 2 ** 3\n<end_of_step>"


def answer(value: str) -> str:
    return f"<answer>The answer is \\boxed{{{value}}}.<end_of_answer>"


# The steps the policy proposes after each path (the texts of the steps so far).
WORLD: dict[tuple[str, ...], list[str]] = {
    (): [A, B, C],
    (A,): [answer("36"), A1],
    (A, A1): [answer("37"), answer("38")],
    (B,): [B1, answer("40")],
    (B, B1): [answer("42"), answer("41")],
    (C,): [answer("8"), answer("9")],
}
PLANTED = (B, B1, answer("42"))


def steps_of(node: Node) -> tuple[str, ...]:
    return tuple(step.text for step in node.path()[1:])


class WorldPolicy:
    def __init__(self) -> None:
        self.calls = 0

    async def propose(self, node: Node, n: int) -> list[Proposal]:
        self.calls += 1
        texts = WORLD.get(steps_of(node), [])[:n]
        return [Proposal(text, tuple(range(len(text)))) for text in texts]


class ExecPython:
    """Runs the tests' own programs in this process (they are trusted and tiny)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def run(self, programs: Sequence[str]) -> list[Execution]:
        self.batches.append(list(programs))
        results = []
        for program in programs:
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(program, {})
            except Exception as exc:
                results.append(Execution(f"{type(exc).__name__}: {exc}", failed=True))
            else:
                results.append(Execution(printed.getvalue(), failed=False))
        return results


class PathScorer:
    """+1 for a node on the planted path, -1 elsewhere; `sign` -1 makes it adversarial."""

    def __init__(self, sign: float = 1.0) -> None:
        self.sign = sign

    async def score(self, nodes: Sequence[Node]) -> list[float]:
        return [
            self.sign * (1.0 if PLANTED[: node.depth] == steps_of(node) else -1.0) for node in nodes
        ]


def answers_found(result: SearchResult) -> set[str | None]:
    return {node.answer for node in result.answers}


async def test_expand_runs_the_replayed_code_in_one_batch() -> None:
    executor = ExecPython()
    settings = SearchSettings()
    root = Node.root()
    _, b, _ = await expand(root, 3, WorldPolicy(), executor, RStarFormat(), settings)
    children = await expand(b, 3, WorldPolicy(), executor, RStarFormat(), settings)
    b1, answer40 = children
    assert executor.batches == [
        ["# try a product\nx = 6 * 6", "# try a sum\nx = 40", "# try a power\nx = 2 ** 3"],
        ["# try a sum\nx = 40\n# add the rest\nx = x + 2\nprint(x)"],
    ]
    assert (b1.output, b1.observation, b1.terminal) == ("42\n", "\n<output>42<end_of_output>", None)
    assert (answer40.terminal, answer40.answer) == (Terminal.ANSWER, "40")
    assert b1.token_ids == tuple(range(len(B1)))


async def test_a_failed_step_ends_its_branch() -> None:
    class Broken:
        async def propose(self, node: Node, n: int) -> list[Proposal]:
            return [Proposal("<code>\nx = 1 / 0\n<end_of_step>"), Proposal("\n<end_of_step>")]

    children = await expand(Node.root(), 2, Broken(), ExecPython(), RStarFormat(), SearchSettings())
    assert [c.terminal for c in children] == [Terminal.TOO_MANY_CODE_ERRORS, Terminal.UNPARSABLE]
    assert "ZeroDivisionError" in children[0].observation


def mcts(scorer: PathScorer, rollouts: int) -> MCTS:
    settings = SearchSettings(children=4, rollouts=rollouts)
    return MCTS(WorldPolicy(), ExecPython(), RStarFormat(), scorer, scorer, settings)


async def test_mcts_with_an_oracle_scorer_finds_the_planted_answer() -> None:
    result = await mcts(PathScorer(), rollouts=1).search()
    assert result.answer == "42"
    assert result.answers[0].answer == "42" and steps_of(result.answers[0]) == PLANTED
    assert answers_found(result) == {"40", "41", "42"}  # the one rollout stayed on b's side


async def test_mcts_with_an_adversarial_scorer_misses_it() -> None:
    result = await mcts(PathScorer(sign=-1.0), rollouts=1).search()
    assert result.answer != "42"
    assert "42" not in answers_found(result)  # b was never expanded
    assert result.root.children[1].children == []


async def test_mcts_explores_the_whole_world_and_stops_when_nothing_is_left() -> None:
    policy = WorldPolicy()
    search = MCTS(
        policy,
        ExecPython(),
        RStarFormat(),
        PathScorer(sign=-1.0),
        settings=SearchSettings(children=4, rollouts=50),
    )
    result = await search.search()
    assert answers_found(result) == {"36", "37", "38", "40", "41", "42", "8", "9"}
    assert result.root.terminal is Terminal.EXHAUSTED
    assert policy.calls == 6  # one expansion per node of the world with steps after it
    assert result.answer != "42"  # found, but ranked last by the adversarial scorer


async def test_mcts_with_ground_truth_builds_sft_data() -> None:
    settings = SearchSettings(children=4, rollouts=50)
    search = MCTS(WorldPolicy(), ExecPython(), RStarFormat(), GroundTruth("42"), settings=settings)
    result = await search.search()
    root = result.root
    # every answer backpropagated +1 or -1 to the root; the other terminals count on their own
    assert (root.N, root.W) == (8, -6.0)
    (trace,) = sft_traces(root, "42", settings)
    assert tuple(step.text for step in trace.steps) == PLANTED
    assert trace.text == B + B1 + "\n<output>42<end_of_output>" + answer("42")


async def test_beam_search_with_an_oracle_scorer_finds_the_planted_answer() -> None:
    settings = SearchSettings(beam_width=2, beam_samples=3)
    result = await beam_search(WorldPolicy(), ExecPython(), RStarFormat(), PathScorer(), settings)
    assert result.answer == "42"
    assert steps_of(result.answers[0]) == PLANTED


async def test_beam_search_with_an_adversarial_scorer_misses_it() -> None:
    settings = SearchSettings(beam_width=2, beam_samples=3)
    scorer = PathScorer(sign=-1.0)
    result = await beam_search(WorldPolicy(), ExecPython(), RStarFormat(), scorer, settings)
    assert result.answer != "42"
    assert "42" not in answers_found(result)
    assert result.root.children[1].children == []  # b was never a beam


async def test_a_dead_ends_negative_reward_stays_on_its_node_as_in_rstar() -> None:
    """rStar's `eval_final_answer` gives a terminal non-answer the negative reward with
    `node.update`, not `update_recursive`: only answers move their ancestors' Q."""
    fails = "<code>\nx = 1 / 0\n<end_of_step>"
    world = {
        (): [fails, "\n<end_of_step>", A],
        (A,): [answer("42"), "# again\n" + fails.removeprefix("<code>\n")],
    }

    class DeadEnds(WorldPolicy):
        async def propose(self, node: Node, n: int) -> list[Proposal]:
            return [Proposal(text) for text in world.get(steps_of(node), [])[:n]]

    settings = SearchSettings(children=4, rollouts=10)
    search = MCTS(DeadEnds(), ExecPython(), RStarFormat(), GroundTruth("42"), settings=settings)
    root = (await search.search()).root
    failed, unparsable, a = root.children
    assert (failed.terminal, failed.N, failed.W) == (Terminal.TOO_MANY_CODE_ERRORS, 1, -1.0)
    assert (unparsable.terminal, unparsable.N, unparsable.W) == (Terminal.UNPARSABLE, 1, -1.0)
    right, failed_again = a.children
    assert (right.answer, right.N, right.W) == ("42", 1, 1.0)
    assert (failed_again.terminal, failed_again.N, failed_again.W) == (
        Terminal.TOO_MANY_CODE_ERRORS,
        1,
        -1.0,
    )
    # the one answer is all that reached A and the root; A, all of whose children are
    # terminal, is exhausted
    assert (a.N, a.W, a.terminal) == (1, 1.0, Terminal.EXHAUSTED)
    assert (root.N, root.W) == (1, 1.0)
