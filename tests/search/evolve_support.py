"""Stand-ins for a self-evolution round's services: model folders that hold only a config and
a tokenizer (enough to resolve and encode), and services whose "search" returns a planted
tree in the policy's token ids: a step that runs code and leads to the reference answer,
and a step that leads to a wrong one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kubestar.search.evolve import SolveFunction
from kubestar.search.solve import GREEDY, Solved, SolveSettings
from kubestar.search.tree import Node, Terminal, add_children, backpropagate
from kubestar.training.datasets import Problem
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ("<unk>", "<|im_end|>", "output", "end_of_output", "42", "the", "answer")
GOOD_STEP = "I multiply the two factors with python and print the product"
BAD_STEP = "Adding is what I will do here"
OBSERVATION = "\n<output>42<end_of_output>"
# The planted tree's token ids, as a policy's sampled ids (no tokenizer would give them).
ROOT_IDS = (5, 6, 7)
GOOD_IDS = (10, 11, 12)
GOOD_ANSWER_IDS = (20, 21)
BAD_IDS = (30, 31, 32, 33)
BAD_ANSWER_IDS = (40, 41)


def write_model(folder: Path, words: Sequence[str] = WORDS) -> Path:
    """A folder `resolve_model` takes and `ChatTokenizer` reads: a config and a word-level
    tokenizer of `words` (another list makes another tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_problems(path: Path, count: int) -> Path:
    """`count` problems "What is 6 * k?" with their answers, one JSON line each."""
    lines = [
        json.dumps({"question": f"What is 6 * {k}?", "answer": str(6 * k)})
        for k in range(7, 7 + count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def planted_tree(problem: Problem, ids: Callable[[str], tuple[int, ...]] | None = None) -> Node:
    """root -> good (code, observation) -> the reference answer; root -> bad -> a wrong
    answer; values from ground truth backpropagated (Q good 1, Q bad -1). `ids` gives a
    text's token ids (default: the fixed ids above)."""
    wrong = "13" if problem.answer != "13" else "14"
    texts = {
        "root": f"<|im_start|>user\n{problem.question}<|im_end|>\n",
        "good": GOOD_STEP,
        "good_answer": f"the answer is \\boxed{{{problem.answer}}}<|im_end|>",
        "bad": BAD_STEP,
        "bad_answer": f"the answer is \\boxed{{{wrong}}}<|im_end|>",
    }
    fixed = {
        "root": ROOT_IDS,
        "good": GOOD_IDS,
        "good_answer": GOOD_ANSWER_IDS,
        "bad": BAD_IDS,
        "bad_answer": BAD_ANSWER_IDS,
    }
    token_ids = {name: ids(text) if ids else fixed[name] for name, text in texts.items()}
    root = Node.root(texts["root"], token_ids["root"])
    good, bad = add_children(
        root, [(texts["good"], token_ids["good"]), (texts["bad"], token_ids["bad"])]
    )
    good.code, good.observation, good.output = "print(6 * 7)", OBSERVATION, "42\n"
    (good_answer,) = add_children(good, [(texts["good_answer"], token_ids["good_answer"])])
    (bad_answer,) = add_children(bad, [(texts["bad_answer"], token_ids["bad_answer"])])
    good_answer.terminal, good_answer.answer = Terminal.ANSWER, problem.answer
    bad_answer.terminal, bad_answer.answer = Terminal.ANSWER, wrong
    backpropagate(good_answer, 1.0)
    backpropagate(bad_answer, -1.0)
    return root


class FakeServices:
    """`evolve.Services` without engines: the search returns `planted_tree` per problem, a
    greedy or PPM-guided evaluation a one-answer tree (the reference answer for the round's
    own policy folder, a wrong one otherwise). Every start and every call is recorded."""

    def __init__(
        self,
        ids: Callable[[str], tuple[int, ...]] | None = None,
        fail_after: int | None = None,
    ) -> None:
        self.ids = ids
        self.fail_after = fail_after  # outcomes a call reports before it fails, as if killed
        self.started: list[Path] = []
        self.calls: list[tuple[str, str, bool, str]] = []  # (policy, mode, ground truth, ppm)
        self.solved: list[str] = []  # the problems solved, by id, in order

    @contextmanager
    def serving(self, policy: Path) -> Iterator[SolveFunction]:
        self.started.append(policy)

        def solve(
            problems: Sequence[Problem],
            settings: SolveSettings,
            ppm: str,
            on_done: Callable[[Solved], None] | None = None,
        ) -> list[Solved]:
            self.calls.append((policy.name, settings.mode, settings.ground_truth, ppm))
            outcomes: list[Solved] = []
            for problem in problems:
                if len(outcomes) == self.fail_after:
                    raise RuntimeError("the engine went away")
                outcomes.append(self._solve(problem, settings, policy))
                self.solved.append(problem.id)
                if on_done is not None:
                    on_done(outcomes[-1])
            return outcomes

        yield solve

    def _solve(self, problem: Problem, settings: SolveSettings, policy: Path) -> Solved:
        if settings.ground_truth:
            root = planted_tree(problem, self.ids)
            return Solved(problem, settings.mode, problem.answer, True, 9, 2, 0.1, root)
        answer = problem.answer if policy.name == "policy" else "0"
        root = Node.root(problem.question, ROOT_IDS)
        (leaf,) = add_children(root, [(f"\\boxed{{{answer}}}", (1,))])
        leaf.terminal, leaf.answer = Terminal.ANSWER, answer
        tokens = 1 if settings.mode == GREEDY else 4
        correct = answer == problem.answer
        return Solved(problem, settings.mode, answer, correct, tokens, 1, 0.1, root)
