"""Problems: reasoning-gym generators and local files in their published formats (jsonl,
DAPO-Math-17k, AIME sets); the fixture files are written here in each published layout."""

from __future__ import annotations

import csv
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kubestar.api.errors import KubestarError
from kubestar.api.v1alpha1 import DatasetSpec
from kubestar.training.datasets import (
    DatasetFormatError,
    file_problems,
    jsonl_problems,
    load_problems,
    mixed_problems,
    reasoning_gym_problems,
)
from kubestar.training.session import load_dataset

from tests.real_parts import require_modules


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


def test_a_mix_shares_the_size_by_weight_with_unique_ids() -> None:
    mix = [("gcd", 1.0), ("basic_arithmetic:max_terms=2", 2.0), ("basic_arithmetic", 1.0)]
    problems = mixed_problems(mix, 10, seed=5)
    sources = [problem.source for problem in problems]
    # 2.5 / 5 / 2.5: the leftover one goes to the first of the largest remainders.
    assert sorted(Counter(sources).values()) == [2, 3, 5]
    assert Counter(sources)["basic_arithmetic:max_terms=2"] == 5
    assert len({problem.id for problem in problems}) == 10  # one generator twice, no clash
    assert sources != sorted(sources)  # shuffled together
    assert mixed_problems(mix, 10, seed=5) == problems
    assert mixed_problems(mix, 10, seed=6) != problems
    spec = DatasetSpec.model_validate(
        {"mix": [{"generator": g, "weight": w} for g, w in mix], "size": 10, "seed": 5}
    )
    assert load_dataset(spec) == problems


def test_a_dataset_has_exactly_one_source() -> None:
    from pydantic import ValidationError

    sources: tuple[dict[str, Any], ...] = (
        {"generator": "gcd", "mix": [{"generator": "lcm"}]},
        {"mix": [{"generator": "lcm"}], "path": "x.jsonl"},
        {},
        {"mix": []},
    )
    for fields in sources:
        with pytest.raises(
            ValidationError, match=r"exactly one of generator, mix or path|at least 1"
        ):
            DatasetSpec.model_validate(fields)
    with pytest.raises(ValidationError, match="greater than 0"):
        DatasetSpec.model_validate({"mix": [{"generator": "gcd", "weight": 0}]})


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
    with pytest.raises(ValueError, match=r"bad\.jsonl: record 1: no answer \(format jsonl"):
        jsonl_problems(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:1"):
        jsonl_problems(broken)


# The same three problems in every layout below.
PROBLEMS = [
    ("Find $x$ if $2x + 1 = 7$.", "3"),
    ("How many primes are less than $20$?", "8"),
    ("Compute $\\binom{6}{2}$.", "15"),
]
DAPO_IDS = [
    "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079",
    "5f49f482-8631-4779-93a9-b0c5b75e9b04",
    "7c8d4e31-d666-4f18-8b34-f2e552f76394",
]
# DAPO-Math-17k's user message, as published (BytedTsinghua-SIA/DAPO-Math-17k).
DAPO_USER = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    '\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)


def dapo_record(index: int) -> dict[str, Any]:
    problem, answer = PROBLEMS[index]
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_USER.format(problem=problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": DAPO_IDS[index]},
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    require_modules("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def triples(problems: list[Any]) -> list[tuple[str, str, str]]:
    return [(p.id, p.question, p.answer) for p in problems]


def test_dapo_published_layouts(tmp_path: Path) -> None:
    records = [dapo_record(i) for i in range(3)]
    expected = [(DAPO_IDS[i], *PROBLEMS[i]) for i in range(3)]
    # open-r1/DAPO-Math-17k-Processed (what rStar2-Agent trains on): the user message as a
    # string in `prompt`, the original messages in `source_prompt`, the answer in `solution`.
    processed = [
        {
            "prompt": record["prompt"][0]["content"],
            "solution": record["reward_model"]["ground_truth"],
            "data_source": record["data_source"],
            "source_prompt": record["prompt"],
            "ability": record["ability"],
            "reward_model": record["reward_model"],
            "extra_info": record["extra_info"],
        }
        for record in records
    ]
    files = [
        write_parquet(tmp_path / "dapo-math-17k.parquet", records),
        write_jsonl(tmp_path / "dapo-math-17k.jsonl", records),
        tmp_path / "dapo-math-17k.json",
        write_parquet(tmp_path / "processed.parquet", processed),
    ]
    files[2].write_text(json.dumps(records, indent=1))
    for file in files:
        problems = file_problems(file, "dapo")
        assert triples(problems) == expected, file
        assert problems[0].metadata["reward_model"]["style"] == "rule-lighteval/MATH_v2"
        assert problems[0].metadata["data_source"] == "math_dapo"
    assert triples(file_problems(files[0], "dapo", limit=2)) == expected[:2]


def test_dapo_reads_each_problem_once(tmp_path: Path) -> None:
    # The published file repeats every problem under new ids; dapo keeps the first.
    repeated = [dapo_record(0), dapo_record(1), dapo_record(0), dapo_record(2), dapo_record(1)]
    for n, record in enumerate(repeated):
        record["extra_info"] = {"index": f"id-{n}"}
    file = write_parquet(tmp_path / "repeated.parquet", repeated)
    assert [p.id for p in file_problems(file, "dapo")] == ["id-0", "id-1", "id-3"]
    assert [p.id for p in file_problems(file, "dapo", limit=2)] == ["id-0", "id-1"]


def test_dapo_format_changes_what_is_read(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "dapo.jsonl", [dapo_record(i) for i in range(3)])
    as_jsonl = file_problems(file, "jsonl")
    # jsonl keeps DAPO's instruction in the question and numbers the ids itself.
    assert as_jsonl[0].question == DAPO_USER.format(problem=PROBLEMS[0][0])
    assert as_jsonl[0].id == "dapo-0" and as_jsonl[0].answer == "3"
    as_dapo = file_problems(file, "dapo")
    assert as_dapo[0].question == PROBLEMS[0][0] and as_dapo[0].id == DAPO_IDS[0]
    # A parquet file is not JSON lines: jsonl refuses it in one line.
    parquet = write_parquet(tmp_path / "dapo.parquet", [dapo_record(0)])
    with pytest.raises(DatasetFormatError, match=r"dapo\.parquet: not a text file") as refused:
        file_problems(parquet, "jsonl")
    assert "\n" not in str(refused.value)


def test_the_dataset_field_picks_the_reader(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "dapo.jsonl", [dapo_record(i) for i in range(3)])
    spec = DatasetSpec.model_validate({"path": str(file), "format": "dapo", "size": 2})
    assert triples(load_dataset(spec)) == [(DAPO_IDS[i], *PROBLEMS[i]) for i in range(2)]
    spec = DatasetSpec.model_validate({"path": str(file), "size": 2})  # format: jsonl
    assert [p.id for p in load_dataset(spec)] == ["dapo-0", "dapo-1"]
    aime = write_jsonl(
        tmp_path / "aime.jsonl",
        [
            {"ID": f"2024-I-{i + 1}", "Problem": q, "Answer": int(a)}
            for i, (q, a) in enumerate(PROBLEMS)
        ],
    )
    spec = DatasetSpec.model_validate({"path": str(aime), "format": "aime"})
    assert triples(load_dataset(spec))[0] == ("2024-I-1", *PROBLEMS[0])
    with pytest.raises(DatasetFormatError, match=r"record 1: no question"):
        load_dataset(DatasetSpec.model_validate({"path": str(aime)}))


def test_aime_published_layouts(tmp_path: Path) -> None:
    solutions = [f"A worked solution, so the answer is $\\boxed{{{a}}}$." for _, a in PROBLEMS]
    layouts: dict[str, tuple[Path, list[str]]] = {}
    # HuggingFaceH4/aime_2024 and AI-MO/aimo-validation-aime (parquet): id is an integer,
    # solution a worked solution, answer a string.
    file = write_parquet(
        tmp_path / "aime_2024.parquet",
        [
            {
                "id": 60 + i,
                "problem": q,
                "solution": solutions[i],
                "answer": a,
                "url": f"https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/{i}",
                "year": "2024",
            }
            for i, (q, a) in enumerate(PROBLEMS)
        ],
    )
    layouts["h4"] = (file, ["60", "61", "62"])
    # Maxwell-Jia/AIME_2024 (parquet): capitalised keys, an integer Answer.
    file = write_parquet(
        tmp_path / "aime_2024_problems.parquet",
        [
            {"ID": f"2024-I-{i + 1}", "Problem": q, "Solution": solutions[i], "Answer": int(a)}
            for i, (q, a) in enumerate(PROBLEMS)
        ],
    )
    layouts["maxwell"] = (file, ["2024-I-1", "2024-I-2", "2024-I-3"])
    # opencompass/AIME2025 (JSON lines): question and answer, no id.
    file = write_jsonl(
        tmp_path / "aime2025-I.jsonl", [{"question": q, "answer": a} for q, a in PROBLEMS]
    )
    layouts["opencompass"] = (file, ["aime2025-I-0", "aime2025-I-1", "aime2025-I-2"])
    # MathArena/aime_2025 (parquet): problem_idx, problem, an integer answer.
    file = write_parquet(
        tmp_path / "matharena.parquet",
        [
            {"problem_idx": i + 1, "problem": q, "answer": int(a)}
            for i, (q, a) in enumerate(PROBLEMS)
        ],
    )
    layouts["matharena"] = (file, ["1", "2", "3"])
    # di-zhang-fdu/AIME_1983_2024 (CSV): ID, Year, Problem Number, Question, Answer, Part.
    file = tmp_path / "AIME_Dataset_1983_2024.csv"
    with file.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["ID", "Year", "Problem Number", "Question", "Answer", "Part"])
        for i, (q, a) in enumerate(PROBLEMS):
            writer.writerow([f"1983-{i + 1}", "1983", str(i + 1), q, a, ""])
    layouts["aime-1983-2024"] = (file, ["1983-1", "1983-2", "1983-3"])
    # The same records as a JSON array.
    file = tmp_path / "aime.json"
    file.write_text(
        json.dumps(
            [{"id": f"p{i}", "problem": q, "answer": a} for i, (q, a) in enumerate(PROBLEMS)]
        )
    )
    layouts["json"] = (file, ["p0", "p1", "p2"])

    for name, (file, ids) in layouts.items():
        problems = file_problems(file, "aime")
        assert triples(problems) == [(i, q, a) for i, (q, a) in zip(ids, PROBLEMS, strict=True)], (
            name
        )
    (h4, _) = layouts["h4"]
    assert file_problems(h4, "aime")[0].metadata["year"] == "2024"
    assert "solution" in file_problems(h4, "aime")[0].metadata  # not the answer


def test_aime_format_changes_what_is_read(tmp_path: Path) -> None:
    # jsonl's keys are lower case: Maxwell-Jia/AIME_2024's ID/Problem/Answer are not found.
    maxwell = write_jsonl(
        tmp_path / "aime.jsonl",
        [{"ID": "2024-I-1", "Problem": PROBLEMS[0][0], "Answer": 3}],
    )
    with pytest.raises(DatasetFormatError, match=r"aime\.jsonl: record 1: no question"):
        file_problems(maxwell, "jsonl")
    assert triples(file_problems(maxwell, "aime")) == [("2024-I-1", *PROBLEMS[0])]
    csv_file = tmp_path / "aime.csv"
    csv_file.write_text(f'ID,Question,Answer\n1983-1,"{PROBLEMS[0][0]}",3\n')
    with pytest.raises(DatasetFormatError, match=r"aime\.csv:1: not JSON"):
        file_problems(csv_file, "jsonl")
    assert triples(file_problems(csv_file, "aime")) == [("1983-1", *PROBLEMS[0])]


def test_malformed_files_are_refused_in_one_line(tmp_path: Path) -> None:
    no_answer = [dapo_record(0), dapo_record(1)]
    no_answer[1]["reward_model"] = {"style": "rule-lighteval/MATH_v2"}
    no_index = [dapo_record(0), dapo_record(1), {**dapo_record(2), "extra_info": {}}]
    no_prompt = [{k: v for k, v in dapo_record(0).items() if k != "prompt"}]
    no_user = [{**dapo_record(0), "prompt": [{"role": "system", "content": "hi"}]}]
    aime_no_answer: list[dict[str, Any]] = [{"problem": q, "answer": a} for q, a in PROBLEMS]
    aime_no_answer[2]["answer"] = None
    cases = [
        (write_parquet(tmp_path / "a.parquet", no_answer), "dapo", 2, "reward_model.ground_truth"),
        (write_jsonl(tmp_path / "b.jsonl", no_index), "dapo", 3, "extra_info.index"),
        (write_jsonl(tmp_path / "c.jsonl", no_prompt), "dapo", 1, "prompt"),
        (write_jsonl(tmp_path / "d.jsonl", no_user), "dapo", 1, "prompt user message"),
        (write_parquet(tmp_path / "e.parquet", aime_no_answer), "aime", 3, "answer"),
        (write_jsonl(tmp_path / "f.jsonl", [{"answer": "1"}]), "aime", 1, "problem"),
    ]
    for file, format, number, field in cases:
        with pytest.raises(DatasetFormatError) as refused:
            file_problems(file, format)
        message = str(refused.value)
        assert message.startswith(f"{file}: record {number}: no {field} (format {format} needs")
        assert "\n" not in message and isinstance(refused.value, KubestarError)
    # A record that is not an object, a file that is not parquet, an unknown format.
    lines = tmp_path / "g.jsonl"
    lines.write_text(json.dumps(dapo_record(0)) + "\n\n[1, 2]\n")
    with pytest.raises(DatasetFormatError, match=r"g\.jsonl: record 3: not an object"):
        file_problems(lines, "dapo")
    fake = tmp_path / "fake.parquet"
    fake.write_text("data_source,prompt\n")
    with pytest.raises(DatasetFormatError, match=r"fake\.parquet: not a parquet file"):
        file_problems(fake, "aime")
    with pytest.raises(DatasetFormatError, match="unknown format 'gsm8k'"):
        file_problems(lines, "gsm8k")


def test_parquet_without_pyarrow_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write_parquet(tmp_path / "aime.parquet", [{"problem": "1+1?", "answer": "2"}])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what `import pyarrow` finds
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetFormatError, match=r"aime\.parquet: reading parquet needs pyarrow"):
        file_problems(file, "aime")


def test_evaluation_accuracy_per_family() -> None:
    from kubestar.training.datasets import Problem
    from kubestar.training.session import accuracy_by_family
    from kubestar.training.trajectory import Trajectory

    problems = [Problem("a", "q", "1", source="gcd"), Problem("b", "q", "2", source="lcm")]
    trajectories = [
        Trajectory(id=f"{p}-{i}", problem_id=p, sample_index=i, question="q", reference="r",
                   reward=reward)
        for p, i, reward in (("a", 0, 1.0), ("a", 1, 0.0), ("b", 0, 0.0))
    ]  # fmt: skip
    assert accuracy_by_family(problems, trajectories) == {"gcd": 0.5, "lcm": 0.0}
