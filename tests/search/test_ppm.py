"""The process preference model on a tiny real model: the Bradley-Terry loss, rStar's squash,
learning a marker from pairs, and the folder it is saved as."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers", "safetensors")

import torch  # noqa: E402
from kubestar.scoring.model import (  # noqa: E402
    HEAD_FILE,
    HEAD_KEYS,
    INFO_FILE,
    ProcessPreferenceModel,
    squash,
)
from kubestar.search.ppm import (  # noqa: E402
    PpmTrainMetrics,
    PpmTrainSettings,
    bradley_terry_loss,
    pair_accuracy,
    train_ppm,
    truncate,
)
from kubestar.search.ppm_data import PpmExample  # noqa: E402
from kubestar.training.chat import ChatTokenizer  # noqa: E402

from tests.search.ppm_support import marker_pairs  # noqa: E402

# Enough to learn the marker in a few seconds on the tiny model.
FAST = PpmTrainSettings(learning_rate=1e-3, epochs=3, batch_size=8, micro_batch_size=8)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


@pytest.fixture(scope="module")
def held_out(model_dir: Path) -> list[PpmExample]:
    return marker_pairs(64, ChatTokenizer.from_model(model_dir).encode, seed=1)


def mean_margin(ppm: ProcessPreferenceModel, examples: list[PpmExample]) -> float:
    chosen = ppm.score([e.chosen for e in examples])
    rejected = ppm.score([e.rejected for e in examples])
    return sum(c - r for c, r in zip(chosen, rejected, strict=True)) / len(examples)


@pytest.fixture(scope="module")
def trained(
    model_dir: Path, held_out: list[PpmExample]
) -> tuple[ProcessPreferenceModel, PpmTrainMetrics, float]:
    """A PPM trained on 64 marker pairs (other seeds than the held-out ones), and its mean
    held-out margin before training."""
    ppm = ProcessPreferenceModel.load(model_dir, seed=0)
    before = mean_margin(ppm, held_out)
    train = marker_pairs(64, ChatTokenizer.from_model(model_dir).encode, seed=0)
    metrics = train_ppm(ppm, train, FAST, held_out=held_out)
    return ppm, metrics, before


def test_bradley_terry_loss_is_the_mean_negative_log_sigmoid_of_the_margin() -> None:
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    # (-log sigmoid(1) - log sigmoid(-1)) / 2 = (log(1 + e^-1) + log(1 + e)) / 2
    assert float(loss) == pytest.approx(0.5 + math.log(1 + math.exp(-1)), abs=1e-7)
    assert float(loss) == pytest.approx(0.8132616875, abs=1e-7)
    assert float(bradley_terry_loss(torch.zeros(3), torch.zeros(3))) == pytest.approx(math.log(2))


def test_scores_are_squashed_as_rstar_does() -> None:
    # rStar-Math's rm_generate: tanh(reward / 5).
    assert squash(5.0) == pytest.approx(math.tanh(1.0))
    assert squash(-10.0) == pytest.approx(math.tanh(-2.0))
    assert squash(0.0) == 0.0


def test_too_long_sequences_keep_their_last_tokens() -> None:
    assert truncate([1, 2, 3, 4, 5], 3) == [3, 4, 5]
    assert truncate([1, 2], 3) == [1, 2]


@pytest.mark.slow
def test_the_ppm_learns_a_marker_it_was_never_shown_in_these_pairs(
    trained: tuple[ProcessPreferenceModel, PpmTrainMetrics, float],
    held_out: list[PpmExample],
) -> None:
    ppm, metrics, before = trained
    assert metrics.pairs == 64 and metrics.steps == 3 * 8 and len(metrics.epoch_losses) == 3
    assert metrics.epoch_losses[-1] < metrics.epoch_losses[0] < math.log(2) + 0.05
    assert metrics.held_out_pairs == 64
    assert metrics.held_out_accuracy is not None and metrics.held_out_accuracy > 0.9
    assert metrics.train_accuracy > 0.9
    assert pair_accuracy(ppm, held_out) == metrics.held_out_accuracy
    # The untrained head (rStar's near-zero init) barely tells the two apart; training does.
    assert abs(before) < 1e-3
    assert mean_margin(ppm, held_out) > 0.5


@pytest.mark.slow
def test_save_and_load_give_identical_scores(
    trained: tuple[ProcessPreferenceModel, PpmTrainMetrics, float],
    held_out: list[PpmExample],
    tmp_path: Path,
) -> None:
    ppm, metrics, _ = trained
    folder = ppm.save(tmp_path / "ppm", metadata={"training": metrics.as_dict()})
    assert (folder / HEAD_FILE).exists() and (folder / "tokenizer.json").exists()
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["reward_scale"] == 5.0 and info["training"]["pairs"] == 64
    sequences = [e.chosen for e in held_out[:8]] + [e.rejected for e in held_out[:8]]
    loaded = ProcessPreferenceModel.load(folder, seed=123)  # the seed of a fresh head only
    assert loaded.score(sequences) == ppm.score(sequences)
    assert loaded.tokenizer_sha256 == ppm.tokenizer_sha256 != ""
    from safetensors.torch import load_file

    assert sorted(load_file(str(folder / HEAD_FILE))) == sorted(HEAD_KEYS)  # rStar's names
    # Saving again over a PPM folder replaces it whole.
    assert ppm.save(folder) == folder and not list(tmp_path.glob("ppm.tmp-*"))


def test_a_plain_model_folder_loads_with_a_fresh_head(model_dir: Path) -> None:
    ppm = ProcessPreferenceModel.load(model_dir)
    scores = ppm.score([[1, 2, 3], [4, 5, 6, 7, 8]])
    assert all(abs(s) < 1e-3 for s in scores)
    assert ppm.reward_scale == 5.0 and ppm.vocab_size == 49152


def test_scores_do_not_depend_on_the_batch(model_dir: Path) -> None:
    """Right padding: a row's reward is read at its own last token, whatever else is in the
    batch."""
    ppm = ProcessPreferenceModel.load(model_dir)
    with torch.no_grad():
        torch.nn.init.normal_(ppm.head.summary.weight, std=1.0)
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    alone = [ppm.score([row])[0] for row in rows]
    assert ppm.score(rows) == pytest.approx(alone, rel=1e-5, abs=1e-6)
