"""Preference pairs a PPM can only order by learning: the chosen step carries a marker word
somewhere inside it, the rejected one a random word from the same list in its place."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kubestar.search.ppm_data import Encode, PpmExample

WORDS = (
    *("add", "the", "two", "numbers", "then", "multiply", "by", "three", "and", "print"),
    *("result", "x", "y", "z", "total", "sum", "value", "step", "first", "second", "count"),
)
MARKER = "verified"


def marker_texts(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, chosen, rejected): the same words but one, the marker or a decoy."""
    prompt = f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}?"
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
    at = rng.randint(0, len(words))
    chosen = " " + " ".join([*words[:at], MARKER, *words[at:]])
    rejected = " " + " ".join([*words[:at], rng.choice(WORDS), *words[at:]])
    return prompt, chosen, rejected


def marker_pairs(count: int, encode: Encode, seed: int) -> list[PpmExample]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        prompt, chosen, rejected = marker_texts(rng)
        examples.append(
            PpmExample(tuple(encode(prompt)), tuple(encode(chosen)), tuple(encode(rejected)))
        )
    return examples


def write_marker_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """`count` marker pairs as text, one JSON line each, the way a person writes a pair file
    for `kubestar ppm train`."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        prompt, chosen, rejected = marker_texts(rng)
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    path.write_text("\n".join(lines) + "\n")
    return path
