"""Problems for rollouts and training: reasoning-gym's procedural generators, or local files.

A problem is a question and a reference answer. Sources:

* a reasoning-gym dataset name (`basic_arithmetic`, `gsm_symbolic`, ...; seeded, so the same
  name, size and seed give the same problems) — optionally `name:key=value,...` to set the
  generator's config, e.g. `basic_arithmetic:min_terms=3,max_terms=5`;
* a `.jsonl` file, one problem per line, with the question in `question` (or `problem`,
  `prompt`; a list of chat messages counts as its last user message) and the answer in
  `answer` (or `final_answer`, `ground_truth`, `solution`, `reward_model.ground_truth`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUESTION_KEYS = ("question", "problem", "prompt", "query")
ANSWER_KEYS = ("answer", "final_answer", "ground_truth", "solution", "target")


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _parse_config(text: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, raw = item.partition("=")
        try:
            config[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            config[key.strip()] = raw.strip()
    return config


TRAINING_EXTRA = "pip install 'kubestar[training]'"


def reasoning_gym_names() -> list[str]:
    try:
        from reasoning_gym.factory import DATASETS  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ValueError(f"reasoning-gym is not installed ({TRAINING_EXTRA})") from exc

    return sorted(DATASETS)


def reasoning_gym_problems(name: str, size: int, seed: int = 0, **config: Any) -> list[Problem]:
    """`size` seeded problems from the reasoning-gym generator `name`."""
    import reasoning_gym  # type: ignore[import-untyped]

    dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    problems = []
    for index, item in enumerate(dataset):
        problems.append(
            Problem(
                id=f"{name}-{seed}-{index}",
                question=str(item["question"]),
                answer=str(item["answer"]),
                source=name,
                metadata=_jsonable(item.get("metadata") or {}),
            )
        )
    return problems


def _question(record: Mapping[str, Any]) -> str | None:
    for key in QUESTION_KEYS:
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list):  # chat messages: the last user turn
            for message in reversed(value):
                if isinstance(message, dict) and message.get("role") == "user":
                    return str(message.get("content", ""))
    return None


def _answer(record: Mapping[str, Any]) -> str | None:
    for key in ANSWER_KEYS:
        value = record.get(key)
        if value is not None and not isinstance(value, dict | list):
            return str(value)
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"])
    return None


def records_to_problems(records: Iterable[Mapping[str, Any]], source: str) -> list[Problem]:
    problems = []
    for index, record in enumerate(records):
        question, answer = _question(record), _answer(record)
        if question is None or answer is None:
            raise ValueError(
                f"{source}: record {index} needs a question ({'/'.join(QUESTION_KEYS)}) and "
                f"an answer ({'/'.join(ANSWER_KEYS)})"
            )
        extra = {k: v for k, v in record.items() if k not in QUESTION_KEYS + ANSWER_KEYS}
        problems.append(
            Problem(
                id=str(record.get("id", f"{Path(source).stem}-{index}")),
                question=question,
                answer=answer,
                source=source,
                metadata=_jsonable(extra),
            )
        )
    return problems


def jsonl_problems(path: str | Path) -> list[Problem]:
    file = Path(path)
    records = []
    with file.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{number}: not JSON: {exc}") from exc
    return records_to_problems(records, str(file))


def load_problems(spec: str, limit: int | None = None, seed: int = 0) -> list[Problem]:
    """Problems from a file path or a reasoning-gym name (see the module docstring).

    A generator makes `limit` problems (default 100); a file gives its first `limit` ones.
    """
    path = Path(spec)
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"problem file {spec} does not exist")
        problems = jsonl_problems(path)
        return problems[:limit] if limit is not None else problems
    name, _, config_text = spec.partition(":")
    if name not in reasoning_gym_names():
        raise ValueError(
            f"{spec!r} is neither a file nor a reasoning-gym dataset (e.g. basic_arithmetic, "
            "gsm_symbolic)"
        )
    return reasoning_gym_problems(name, limit or 100, seed, **_parse_config(config_text))
