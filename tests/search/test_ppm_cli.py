"""`kubestar ppm train`: pairs from a JSONL file to a PPM folder, metrics as JSON; every
mistake is one line naming the flag or the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_errors import kubestar, one_line_error
from tests.real_parts import require_modules, tiny_model
from tests.search.ppm_support import write_marker_pairs

require_modules("torch", "transformers", "safetensors")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 marker pairs as text, the way a person writes them."""
    return write_marker_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 40)


def test_train_writes_a_ppm_folder_and_prints_its_metrics(
    model_dir: Path, pairs_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ppm"
    args = ["--pairs", str(pairs_file), "--out", str(out), "--model", str(model_dir)]
    fast = ["--learning-rate", "1e-3", "--epochs", "3", "--batch-size", "8", "--device", "cpu"]
    done = kubestar("ppm", "train", *args, *fast, "--held-out", "0.2")
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)
    assert metrics["out"] == str(out)
    assert (metrics["pairs"], metrics["held_out_pairs"], metrics["steps"]) == (32, 8, 12)
    assert metrics["epoch_losses"][-1] < metrics["epoch_losses"][0]
    info = json.loads((out / "ppm.json").read_text())
    assert info["training"] == {k: v for k, v in metrics.items() if k != "out"}
    assert info["settings"]["learning_rate"] == 1e-3 and info["reward_scale"] == 5.0


def test_train_mistakes_are_one_line(model_dir: Path, pairs_file: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    model = ["--model", str(model_dir)]
    done = kubestar("ppm", "train", "--pairs", str(pairs_file), "--out", str(taken), *model)
    one_line_error(done, "--out", str(taken), "not a PPM folder")
    assert (taken / "notes.txt").read_text() == "keep me"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(pairs_file.read_text().splitlines()[0] + "\n{oops\n")
    done = kubestar("ppm", "train", "--pairs", str(bad), "--out", str(tmp_path / "o"), *model)
    one_line_error(done, f"{bad}:2", "not JSON")
    done = kubestar("ppm", "train", "--pairs", str(tmp_path / "none.jsonl"), "--out", "x")
    one_line_error(done, "--pairs", "none.jsonl")
    done = kubestar(
        "ppm", "train", "--pairs", str(pairs_file), "--out", str(tmp_path / "o"),
        "--model", str(tmp_path / "no-model"),
    )  # fmt: skip
    one_line_error(done, "no-model")
    done = kubestar("ppm", "train", "--pairs", str(pairs_file), "--out", "o", "--epochs", "0")
    one_line_error(done, "--epochs")
