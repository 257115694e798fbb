"""What the PPM reads: the token ids of a node's path (the policy's ids, encoded
observations), pairs from a tree as token-id examples, and the JSONL pair file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kubestar.search.data import ppm_pairs
from kubestar.search.ppm_data import (
    PairFileError,
    PpmExample,
    pair_example,
    path_token_ids,
    read_pairs,
    step_token_ids,
    write_pairs,
)
from kubestar.search.tree import Node, add_children

from tests.search.test_data import hand_built_tree


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character."""
    return [ord(c) for c in text]


def test_a_path_is_the_prompt_ids_then_each_steps_ids_and_its_encoded_observation() -> None:
    root = Node.root("Q?", [7, 8])
    (step,) = add_children(root, [("x = 1<end_of_step>", [11, 12, 13])])
    step.observation = "<o>"
    (answer,) = add_children(step, [("\\boxed{1}", ())])
    assert step_token_ids(step, encode) == [11, 12, 13, *encode("<o>")]
    assert path_token_ids(step, encode) == [7, 8, 11, 12, 13, *encode("<o>")]
    # No ids (a hand-built node): its text is encoded.
    assert path_token_ids(answer, encode) == [7, 8, 11, 12, 13, *encode("<o>\\boxed{1}")]


def test_a_pair_from_a_tree_is_the_parents_path_then_each_sibling_as_search_scores_them() -> None:
    nodes = hand_built_tree()
    pairs = ppm_pairs(nodes["root"], "42")
    assert pairs
    for pair in pairs:
        example = pair_example(pair, encode)
        assert list(example.chosen) == path_token_ids(pair.chosen, encode)
        assert list(example.rejected) == path_token_ids(pair.rejected, encode)


def test_pair_file_round_trip_keeps_the_ids(tmp_path: Path) -> None:
    nodes = hand_built_tree()
    pairs = ppm_pairs(nodes["root"], "42")
    path = write_pairs(tmp_path / "pairs.jsonl", pairs, encode)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["chosen"] == pairs[0].chosen.full_text
    assert first["margin"] == pairs[0].margin
    # Read back with a tokenizer that would encode differently: the ids are what counts.
    assert read_pairs(path, lambda text: []) == [pair_example(p, encode) for p in pairs]


def test_pair_file_text_is_encoded(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    record = {"prompt": "Q", "chosen": "good", "rejected": "bad", "rejected_ids": [1, 2]}
    path.write_text("\n" + json.dumps(record) + "\n\n")
    assert read_pairs(path, encode) == [PpmExample((81,), tuple(encode("good")), (1, 2))]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "pairs.jsonl:2: not JSON"),
        ("[1, 2]", "pairs.jsonl:2: expected an object"),
        ('{"prompt": "Q", "chosen": "a"}', "pairs.jsonl:2: needs 'rejected'"),
        ('{"prompt": "Q", "chosen": "a", "rejected_ids": [1, -2]}', "rejected_ids must be"),
        ('{"prompt": "Q", "chosen": "", "rejected": "b"}', "must not be empty"),
    ],
)
def test_a_bad_pair_file_names_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "chosen": "a", "rejected": "b"}) + "\n" + line)
    with pytest.raises(PairFileError, match=re.escape(message)):
        read_pairs(path, encode)


def test_an_empty_or_missing_pair_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PairFileError, match=re.escape(f"{empty}: no pairs")):
        read_pairs(empty, encode)
    with pytest.raises(PairFileError, match=re.escape("missing.jsonl: cannot read")):
        read_pairs(tmp_path / "missing.jsonl", encode)
