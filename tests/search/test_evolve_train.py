"""A whole self-evolution round with real training on a tiny real model and planted search
trees (no engines): the SFT changes the policy's weights and records its base, the PPM is
trained and measured on held-out pairs, and the evaluation compares old and new."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers", "safetensors")

import torch  # noqa: E402
from kubestar.search.evolve import (  # noqa: E402
    LINEAGE,
    NEW_GREEDY,
    NEW_SEARCH,
    OLD_GREEDY,
    POLICY,
    PPM,
    STAGES,
    EvalSettings,
    PpmSettings,
    Round,
    RoundSettings,
    SftSettings,
)
from kubestar.search.tree import SearchSettings  # noqa: E402
from kubestar.training.chat import ChatTokenizer  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.search.evolve_support import FakeServices, write_problems  # noqa: E402


def weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_model(64)


def test_a_round_trains_the_policy_and_the_ppm(tmp_path: Path, base: Path) -> None:
    encode = ChatTokenizer.from_model(base).encode
    services = FakeServices(ids=lambda text: tuple(encode(text)))
    settings = RoundSettings(
        policy=str(base),
        problems=str(write_problems(tmp_path / "problems.jsonl", 5)),
        out=str(tmp_path / "round"),
        limit=3,
        search=SearchSettings(rollouts=2, children=2),
        # Rates far above the defaults: a few steps must move bf16 weights.
        sft=SftSettings(epochs=2, batch_size=2, learning_rate=1e-3),
        ppm=PpmSettings(
            base=str(base), held_out=0.34, learning_rate=1e-3, batch_size=2, max_tokens=256
        ),
        evaluation=EvalSettings(limit=2, rollouts=1, children=2),
        device="cpu",
    )
    lines: list[str] = []
    manifest = Round(settings, services, lines.append).run()
    folder = tmp_path / "round"

    assert all(manifest["stages"][stage]["done"] for stage in STAGES)
    sft = manifest["stages"]["sft"]["figures"]
    assert sft["examples"] == 3 and sft["base"] == str(base)
    assert math.isfinite(sft["loss"]) and sft["loss"] < sft["initial_loss"]
    before, after = weights(base), weights(folder / POLICY)
    assert set(after) <= set(before)
    changed = [name for name in after if not torch.equal(before[name], after[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert len(changed) >= len(after) // 2
    assert json.loads((folder / POLICY / LINEAGE).read_text())["base"] == str(base)
    tokenizer = (folder / POLICY / "tokenizer.json").read_bytes()
    assert tokenizer == (base / "tokenizer.json").read_bytes()

    ppm = manifest["stages"]["ppm"]["figures"]
    assert (ppm["pairs"], ppm["held_out_pairs"]) == (2, 1)
    assert ppm["held_out_accuracy"] in (0.0, 1.0)
    info = json.loads((folder / PPM / "ppm.json").read_text())
    assert info["training"]["pairs"] == 2 and info["base_model"] == str(base)

    evaluation = json.loads((folder / "eval.json").read_text())["parts"]
    assert (evaluation[OLD_GREEDY]["accuracy"], evaluation[NEW_GREEDY]["accuracy"]) == (0.0, 1.0)
    assert evaluation[NEW_SEARCH]["mode"] == "mcts"
    assert evaluation[NEW_SEARCH]["ppm"] == str(folder / PPM)
    assert services.calls == [
        (base.name, "mcts", True, ""),
        (base.name, "greedy", False, ""),
        ("policy", "greedy", False, ""),
        ("policy", "mcts", False, str(folder / PPM)),
    ]
    figures = manifest["stages"]["evaluate"]["figures"]
    assert figures[f"{NEW_SEARCH}_accuracy"] == 1.0
    assert any(line.startswith("  sft step") for line in lines)
    assert lines[-1].startswith("[5/5] evaluate: 2 problems: greedy 0.000 -> 1.000, mcts")
