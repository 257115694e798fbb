"""`kubestar evolve`: a setting that cannot work is one line naming its flag, before anything
is started or written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_errors import kubestar, one_line_error
from tests.search.evolve_support import write_model, write_problems


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    return {
        "policy": write_model(tmp_path / "policy"),
        "stranger": write_model(tmp_path / "stranger", words=("<unk>", "<|im_end|>", "y")),
    }


def evolve(tmp_path: Path, *flags: str, policy: Path | None = None) -> list[str]:
    problems = write_problems(tmp_path / "problems.jsonl", 4)
    model = str(policy or tmp_path / "policy")
    return [
        "evolve", "--policy", model, "--problems", str(problems), "-n", "2",
        "--out", str(tmp_path / "round"), "--ppm-base", model, *flags,
    ]  # fmt: skip


def test_flag_mistakes_are_one_line_naming_the_flag(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    one_line_error(
        kubestar(*evolve(tmp_path, policy=tmp_path / "no-such-model")),
        "--policy",
        "no-such-model",
    )
    one_line_error(
        kubestar(*evolve(tmp_path, "--problems", str(tmp_path / "none.jsonl"))),
        "--problems",
        "none.jsonl",
    )
    one_line_error(
        kubestar(*evolve(tmp_path, "--ppm-base", str(models["stranger"]))),
        "--ppm-base",
        "another tokenizer",
    )
    one_line_error(kubestar(*evolve(tmp_path, "--sft-base", str(models["stranger"]))), "--sft-base")
    one_line_error(
        kubestar(*evolve(tmp_path, "-n", "4")), "--eval-problems", "no evaluation problems"
    )
    one_line_error(kubestar(*evolve(tmp_path, "--eval-mode", "greedy")), "--eval-mode")
    one_line_error(kubestar(*evolve(tmp_path, "--until", "later")), "--until")
    one_line_error(kubestar(*evolve(tmp_path, "--sft-learning-rate", "0")), "--sft-learning-rate")
    assert not (tmp_path / "round").exists()


def test_a_folder_holding_something_else_is_not_resumed(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """(A round made with other settings is refused the same way: tests/search/test_evolve.)"""
    folder = tmp_path / "round"
    folder.mkdir()
    (folder / "round.json").write_text(json.dumps({"stages": {}}))
    one_line_error(kubestar(*evolve(tmp_path)), "--out", "round.json", "not a round's manifest")
