"""What the process preference model (PPM) reads: token ids of a node's path, preference
pairs as token-id examples, and the JSONL file of pairs that `kubestar ppm train` takes.

Training and scoring build their sequences the same way, so that the PPM is asked at search
time about exactly the kind of sequence it was trained on: the root's prompt ids, then for
each step its own token ids (the policy's, never re-tokenised) followed by the tokenised
observation the tool appended. A node without ids (a hand-built tree, a pair read from text)
has its text encoded instead.

Needs no torch: the search imports it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubestar.api.errors import KubestarError
from kubestar.search.data import PpmPair
from kubestar.search.tree import Node

Encode = Callable[[str], list[int]]
T = TypeVar("T")
# The parts of a pair, in PpmExample's order; a pair file names them so.
PAIR_FIELDS = ("prompt", "chosen", "rejected")


class PairFileError(KubestarError, ValueError):
    """A pair file that cannot be read; the message names the file and the line."""


def step_token_ids(node: Node, encode: Encode) -> list[int]:
    """One node's part of a sequence: its ids (or its encoded text), then its observation."""
    ids = list(node.token_ids) if node.token_ids else encode(node.text)
    if node.observation:
        ids.extend(encode(node.observation))
    return ids


def path_token_ids(node: Node, encode: Encode) -> list[int]:
    """The sequence the PPM scores for `node`: every step from the root down to it."""
    ids: list[int] = []
    for step in node.path():
        ids.extend(step_token_ids(step, encode))
    return ids


@dataclass(frozen=True)
class PpmExample:
    """One preference pair as token ids: the shared prompt (question and earlier steps), and
    the chosen and the rejected step that follow it."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]

    @property
    def chosen(self) -> tuple[int, ...]:
        return self.prompt_ids + self.chosen_ids

    @property
    def rejected(self) -> tuple[int, ...]:
        return self.prompt_ids + self.rejected_ids


def pair_example(pair: PpmPair, encode: Encode) -> PpmExample:
    """A pair from a search tree: the path to the parent, then each sibling step."""
    return PpmExample(
        tuple(path_token_ids(pair.parent, encode)),
        tuple(step_token_ids(pair.chosen, encode)),
        tuple(step_token_ids(pair.rejected, encode)),
    )


def _text(nodes: Iterable[Node]) -> str:
    return "".join(node.full_text for node in nodes)


def pair_record(pair: PpmPair, encode: Encode) -> dict[str, Any]:
    """A pair as one line of a pair file: the text (to read) and the token ids (what is
    trained on), plus the Q margin that selected it."""
    example = pair_example(pair, encode)
    return {
        "prompt": _text(pair.parent.path()),
        "chosen": pair.chosen.full_text,
        "rejected": pair.rejected.full_text,
        "prompt_ids": list(example.prompt_ids),
        "chosen_ids": list(example.chosen_ids),
        "rejected_ids": list(example.rejected_ids),
        "margin": pair.margin,
    }


def write_pairs(path: str | Path, pairs: Sequence[PpmPair], encode: Encode) -> Path:
    """Write pairs as JSONL (`pair_record` per line)."""
    target = Path(path)
    with target.open("w") as out:
        for pair in pairs:
            out.write(json.dumps(pair_record(pair, encode)) + "\n")
    return target


def _ids(record: dict[str, Any], field: str, encode: Encode, where: str) -> tuple[int, ...]:
    """`FIELD_ids` when the record has it, else the encoded `FIELD` text."""
    ids = record.get(f"{field}_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise PairFileError(f"{where}: {field}_ids must be a list of token ids (ints >= 0)")
        return tuple(ids)
    text = record.get(field)
    if not isinstance(text, str):
        raise PairFileError(f"{where}: needs {field!r} (text) or {field + '_ids'!r} (token ids)")
    return tuple(encode(text))


def read_pairs(path: str | Path, encode: Encode) -> list[PpmExample]:
    """Examples from a JSONL pair file. Each line has `prompt`, `chosen` and `rejected`, as
    text or as token ids (`prompt_ids`, ...; ids win when both are given). Blank lines are
    skipped; anything else that is not such a record is an error naming the line."""
    source = Path(path)
    try:
        lines = source.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise PairFileError(f"{source}: cannot read the pair file: {reason}") from None
    examples: list[PpmExample] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PairFileError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise PairFileError(f"{where}: expected an object with prompt, chosen and rejected")
        example = PpmExample(*(_ids(record, f, encode, where) for f in PAIR_FIELDS))
        if not example.chosen_ids or not example.rejected_ids:
            raise PairFileError(f"{where}: chosen and rejected must not be empty")
        examples.append(example)
    if not examples:
        raise PairFileError(f"{source}: no pairs in the file")
    return examples


def split_pairs(pairs: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(training, held out): the pairs in a seeded order, the first `fraction` of them held
    out to measure pair accuracy on (none when there is a single pair)."""
    shuffled = list(pairs)
    random.Random(f"kubestar-ppm-split/{seed}").shuffle(shuffled)
    kept = round(len(shuffled) * fraction) if len(shuffled) > 1 else 0
    return shuffled[kept:], shuffled[:kept]
