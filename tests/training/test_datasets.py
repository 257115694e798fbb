"""Problems: reasoning-gym generators and local jsonl files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubestar.training.datasets import jsonl_problems, load_problems, reasoning_gym_problems


def test_reasoning_gym_is_seeded() -> None:
    first = reasoning_gym_problems("basic_arithmetic", 5, seed=3)
    again = load_problems("basic_arithmetic", limit=5, seed=3)
    other = load_problems("basic_arithmetic", limit=5, seed=4)
    assert first == again and first != other
    assert len(first) == 5
    problem = first[0]
    assert problem.id == "basic_arithmetic-3-0"
    assert problem.source == "basic_arithmetic"
    assert problem.question and problem.answer
    json.dumps(problem.metadata)  # JSON-ready


def test_reasoning_gym_config_in_the_name() -> None:
    problems = load_problems("basic_arithmetic:min_terms=2,max_terms=2,max_digits=1", limit=4)
    for problem in problems:
        assert problem.metadata["num_terms"] == 2 and problem.metadata["num_digits"] == 1


def test_gsm_symbolic() -> None:
    (problem,) = load_problems("gsm_symbolic", limit=1)
    assert int(problem.answer) == float(problem.answer)


def test_jsonl_with_aliases(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    records = [
        {"question": "1+1?", "answer": 2},
        {"problem": "2+2?", "solution": "4", "level": 1, "id": "x"},
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "3+3?"}],
            "reward_model": {"ground_truth": "6"},
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    problems = jsonl_problems(path)
    assert [(p.question, p.answer) for p in problems] == [
        ("1+1?", "2"),
        ("2+2?", "4"),
        ("3+3?", "6"),
    ]
    assert problems[1].id == "x" and problems[1].metadata == {"level": 1, "id": "x"}
    assert problems[0].id == "p-0"
    assert load_problems(str(path), limit=2) == problems[:2]


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a file nor a reasoning-gym dataset"):
        load_problems("no_such_dataset")
    with pytest.raises(FileNotFoundError):
        load_problems(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="record 0 needs"):
        jsonl_problems(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:1"):
        jsonl_problems(broken)
