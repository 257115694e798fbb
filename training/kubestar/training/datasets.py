"""Problems for rollouts and training: reasoning-gym's procedural generators, or local files.

A problem is a question, a reference answer and an id. Sources:

* a reasoning-gym dataset name (`basic_arithmetic`, `gsm_symbolic`, ...; seeded, so the same
  name, size and seed give the same problems) — optionally `name:key=value,...` to set the
  generator's config, e.g. `basic_arithmetic:min_terms=3,max_terms=5`; or several of them
  mixed by weight (`mixed_problems`);
* a file, read in one of FORMATS:
  - `jsonl`: JSON lines, the question in `question` (or `problem`, `prompt`, `query`; a list
    of chat messages counts as its last user message), the answer in `answer` (or
    `final_answer`, `ground_truth`, `solution`, `target`, `reward_model.ground_truth`), the
    id in `id` (default: the file's stem and the problem's position);
  - `dapo`: DAPO-Math-17k as published (parquet, or the same records as JSON lines or a JSON
    array): `prompt` (chat messages; the user message is the problem inside DAPO's
    instruction, which is removed), `reward_model.ground_truth`, `extra_info.index` (the
    id); `data_source`, `ability` and `reward_model.style` go to the metadata;
  - `aime`: AIME problem sets as published (parquet, JSON lines, a JSON array or CSV), keys
    in any case: the question in `problem` or `question`, the answer in `answer`, the id in
    `id` or `problem_idx` (default: the file's stem and the problem's position).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kubestar.api.errors import KubestarError

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


def mixed_problems(mix: Sequence[tuple[str, float]], size: int, seed: int = 0) -> list[Problem]:
    """`size` problems from several `name[:config]` generators, shared out by weight (the
    largest remainders get the leftover ones), each seeded with `seed`, shuffled together."""
    total = sum(weight for _, weight in mix)
    shares = [size * weight / total for _, weight in mix]
    counts = [math.floor(share) for share in shares]
    leftover = sorted(range(len(mix)), key=lambda i: counts[i] - shares[i])
    for index in leftover[: size - sum(counts)]:
        counts[index] += 1
    problems: list[Problem] = []
    for entry, ((spec, _), count) in enumerate(zip(mix, counts, strict=True)):
        if count:
            # The entry (config included) is the problem's source, and part of its id: two
            # entries of one generator would otherwise make the same ids.
            problems += [
                replace(problem, id=f"{problem.id}-mix{entry}", source=spec)
                for problem in load_problems(spec, count, seed)
            ]
    random.Random(f"kubestar-mix/{seed}").shuffle(problems)
    return problems


def _last_user_message(messages: list[Any]) -> str | None:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return str(message.get("content", ""))
    return None


def _question(record: Mapping[str, Any]) -> str | None:
    for key in QUESTION_KEYS:
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list):  # chat messages: the last user turn
            return _last_user_message(value)
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


class DatasetFormatError(KubestarError, ValueError):
    """A problem file that does not match its declared format. The message names the file,
    the record (counted from 1; a line number in JSON lines) and what is missing."""


FORMATS = ("jsonl", "dapo", "aime")

# DAPO-Math-17k wraps every problem in this instruction (its user message is
# INSTRUCTION + problem + REMINDER); dapo strips it so the agent loop's own template applies.
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_FIELDS = "prompt, reward_model.ground_truth and extra_info.index"

AIME_QUESTION_KEYS = ("problem", "question")
AIME_ANSWER_KEYS = ("answer",)
AIME_ID_KEYS = ("id", "problem_idx")
AIME_FIELDS = "problem or question, and answer (any case)"


def json_lines(
    file: Path, error: Callable[[str], Exception], hint: str = ""
) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON-lines file; a line that is not
    JSON, or a file that is not text, raises `error` naming the file and line (`hint`: what
    to do, after the reason)."""
    try:
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise error(f"{file}:{number}: not JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        reason = f"{file}: not a text file of JSON lines ({exc.reason} at byte {exc.start})"
        raise error(reason + (f"; {hint}" if hint else "")) from exc


def _json_lines(file: Path) -> Iterator[tuple[int, Any]]:
    return json_lines(file, DatasetFormatError, "a parquet file needs format dapo or aime")


def _json_file(file: Path) -> Iterator[tuple[int, Any]]:
    """A JSON array of records, or JSON lines (what `datasets`' to_json writes to .json)."""
    with file.open(encoding="utf-8") as handle:
        head = handle.read(4096).lstrip()
    if not head.startswith("["):
        yield from _json_lines(file)
        return
    try:
        records = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetFormatError(f"{file}: not JSON: {exc}") from exc
    yield from enumerate(records, 1)


def _parquet(file: Path) -> Iterator[tuple[int, Any]]:
    """Rows as dicts (structs are dicts, lists are lists), read a batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetFormatError(
            f"{file}: reading parquet needs pyarrow ({TRAINING_EXTRA})"
        ) from exc
    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetFormatError(f"{file}: not a parquet file: {exc}") from exc
    number = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _csv(file: Path) -> Iterator[tuple[int, Any]]:
    with file.open(newline="", encoding="utf-8") as handle:
        yield from enumerate(csv.DictReader(handle), 1)


def _records(file: Path, format: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(record number, record) of `file`: jsonl reads JSON lines only; dapo and aime read
    parquet, JSON lines, a JSON array (.json) and, for aime, CSV."""
    suffix = file.suffix.lower()
    if format == "jsonl":
        rows = _json_lines(file)
    elif suffix == ".parquet":
        rows = _parquet(file)
    elif suffix == ".csv" and format == "aime":
        rows = _csv(file)
    elif suffix == ".json":
        rows = _json_file(file)
    else:
        rows = _json_lines(file)
    for number, row in rows:
        if not isinstance(row, Mapping):
            raise DatasetFormatError(f"{file}: record {number}: not an object but {row!r:.60}")
        yield number, row


def _missing(file: Path, number: int, field: str, format: str, fields: str) -> DatasetFormatError:
    return DatasetFormatError(
        f"{file}: record {number}: no {field} (format {format} needs {fields})"
    )


def _text(value: Any) -> str | None:
    """A non-empty answer or id as text; integral floats (a parquet column with nulls) lose
    their '.0'."""
    if value is None or isinstance(value, dict | list):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    return text or None


def _jsonl_problem(record: Mapping[str, Any], number: int, ordinal: int, file: Path) -> Problem:
    question, answer = _question(record), _answer(record)
    if question is None:
        raise _missing(file, number, "question", "jsonl", "/".join(QUESTION_KEYS))
    if answer is None:
        raise _missing(file, number, "answer", "jsonl", "/".join(ANSWER_KEYS))
    extra = {k: v for k, v in record.items() if k not in QUESTION_KEYS + ANSWER_KEYS}
    return Problem(
        id=str(record.get("id", f"{file.stem}-{ordinal}")),
        question=question,
        answer=answer,
        source=str(file),
        metadata=_jsonable(extra),
    )


def dapo_question(content: str) -> str:
    """The bare problem of a DAPO-Math-17k user message (other text is kept as it is)."""
    return content.removeprefix(DAPO_INSTRUCTION).removesuffix(DAPO_REMINDER).strip()


def _dapo_problem(
    record: Mapping[str, Any], number: int, file: Path, seen: set[str]
) -> Problem | None:
    """The record's problem, or None when its question is in `seen` (which it joins)."""

    def missing(field: str) -> DatasetFormatError:
        return _missing(file, number, field, "dapo", DAPO_FIELDS)

    prompt = record.get("prompt")
    if isinstance(prompt, list):  # the published layout: chat messages
        content = _last_user_message(prompt)
    elif isinstance(prompt, str):  # open-r1's DAPO-Math-17k-Processed: the user message itself
        content = prompt
    else:
        raise missing("prompt")
    question = dapo_question(content) if content is not None else ""
    if not question:
        raise missing("prompt user message")
    reward_model = record.get("reward_model")
    answer = _text(reward_model.get("ground_truth")) if isinstance(reward_model, dict) else None
    if answer is None:
        raise missing("reward_model.ground_truth")
    extra_info = record.get("extra_info")
    index = _text(extra_info.get("index")) if isinstance(extra_info, dict) else None
    if index is None:
        raise missing("extra_info.index")
    if question in seen:
        return None
    seen.add(question)
    return Problem(
        id=index,
        question=question,
        answer=answer,
        source=str(file),
        metadata=_jsonable({k: v for k, v in record.items() if k != "prompt"}),
    )


def _aime_problem(record: Mapping[str, Any], number: int, ordinal: int, file: Path) -> Problem:
    fields = {str(key).lower(): value for key, value in record.items()}
    question = next((fields[k] for k in AIME_QUESTION_KEYS if _text(fields.get(k))), None)
    if question is None:
        raise _missing(file, number, "problem", "aime", AIME_FIELDS)
    answer = next((a for k in AIME_ANSWER_KEYS if (a := _text(fields.get(k)))), None)
    if answer is None:
        raise _missing(file, number, "answer", "aime", AIME_FIELDS)
    problem_id = next((i for k in AIME_ID_KEYS if (i := _text(fields.get(k)))), None)
    used = AIME_QUESTION_KEYS + AIME_ANSWER_KEYS
    return Problem(
        id=problem_id or f"{file.stem}-{ordinal}",
        question=str(question).strip(),
        answer=answer,
        source=str(file),
        metadata=_jsonable({k: v for k, v in record.items() if str(k).lower() not in used}),
    )


def file_problems(
    path: str | Path, format: str = "jsonl", limit: int | None = None
) -> list[Problem]:
    """The first `limit` problems of a file in `format` (see the module docstring).

    dapo reads each problem once: the published DAPO-Math-17k repeats every problem about a
    hundred times under different ids; the first id is kept.
    """
    file = Path(path)
    if format not in FORMATS:
        raise DatasetFormatError(f"{file}: unknown format {format!r} (one of {', '.join(FORMATS)})")
    if not file.exists():
        raise FileNotFoundError(f"problem file {file} does not exist")
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, record in _records(file, format):
        if limit is not None and len(problems) >= limit:
            break
        problem: Problem | None
        if format == "dapo":
            problem = _dapo_problem(record, number, file, seen)
            if problem is None:
                continue
        elif format == "aime":
            problem = _aime_problem(record, number, len(problems), file)
        else:
            problem = _jsonl_problem(record, number, len(problems), file)
        problems.append(problem)
    return problems


def jsonl_problems(path: str | Path) -> list[Problem]:
    return file_problems(path, "jsonl")


def load_problems(
    spec: str, limit: int | None = None, seed: int = 0, format: str = "jsonl"
) -> list[Problem]:
    """Problems from a file path (in `format`) or a reasoning-gym name (see the module
    docstring).

    A generator makes `limit` problems (default 100); a file gives its first `limit` ones.
    """
    path = Path(spec)
    if path.suffix in (".jsonl", ".json", ".parquet", ".csv") or path.exists():
        return file_problems(path, format, limit)
    name, _, config_text = spec.partition(":")
    if name not in reasoning_gym_names():
        raise ValueError(
            f"{spec!r} is neither a file nor a reasoning-gym dataset (e.g. basic_arithmetic, "
            "gsm_symbolic)"
        )
    return reasoning_gym_problems(name, limit or 100, seed, **_parse_config(config_text))
