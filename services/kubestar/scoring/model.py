"""rStar-Math's process preference model (PPM): a causal LM with a scalar head that values a
partial solution. This module is the model, its folder and its inference, as the scoring
service serves it; training it is `kubestar.search.ppm`'s.

* The reward of a token sequence is the head (dropout, then one linear layer, initialised
  near zero as rStar's `ValueHead`) applied to the final hidden state of the sequence's last
  token: the backbone reads the whole prefix, the last position summarises it.
* At inference a raw reward r is squashed to tanh(r / 5) (`squash`), as rStar's
  `rm_generate` does: values in [-1, 1], on the scale of the ground-truth rewards the
  search backpropagates (+1 correct, -1 wrong).
* On disk a PPM is a folder: the backbone as a Hugging Face causal-LM folder (fp32
  safetensors, config, tokenizer), `value_head.safetensors` (rStar's key names,
  `v_head.summary.weight` / `.bias`) and `ppm.json` (the squash scale, the base model, the
  training metrics). Loading a plain model folder gives a PPM with a fresh head, the start
  of training.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from kubestar.engine.models import TOKENIZER_FILES, resolve_model, tokenizer_sha256

# rStar-Math's rm_generate: rewards = tanh(reward / 5) ("PPM use 5 as the scale").
REWARD_SCALE = 5.0
HEAD_FILE = "value_head.safetensors"
INFO_FILE = "ppm.json"
FORMAT = "kubestar-ppm/1"
# rStar's ValueHead: dropout 0.1 (summary_dropout_prob) before the linear layer.
HEAD_DROPOUT = 0.1
HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")


def squash(raw: float, scale: float = REWARD_SCALE) -> float:
    """A raw reward on the search's scale: tanh(raw / scale), in [-1, 1]."""
    return math.tanh(raw / scale)


class ValueHead(torch.nn.Module):
    """Dropout, then a linear layer to one value; its weights start near zero (rStar's
    normal(5e-7, 1e-6), bias 1e-6), so an untrained PPM scores everything about 0 and the
    backbone's features are not swamped by a random head at the start of training."""

    def __init__(self, hidden_size: int, dropout: float = HEAD_DROPOUT) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.summary = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.summary.weight, mean=5e-7, std=1e-6)
        torch.nn.init.constant_(self.summary.bias, 1e-6)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.summary(self.dropout(hidden.to(self.summary.weight.dtype)))
        return output.squeeze(-1)


class ProcessPreferenceModel(torch.nn.Module):
    """A causal LM's backbone and a `ValueHead` (see the module docstring). Load one with
    `ProcessPreferenceModel.load`."""

    def __init__(
        self,
        backbone: Any,
        head: ValueHead,
        source: Path,
        reward_scale: float = REWARD_SCALE,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.source = source
        self.reward_scale = reward_scale
        self.tokenizer_sha256 = tokenizer_sha256(source)

    @classmethod
    def load(cls, model: str | Path, device: str = "auto", seed: int = 0) -> ProcessPreferenceModel:
        """A PPM folder, or a causal LM's folder (or a model name kubestar resolves, such as
        SmolLM2-135M-Instruct) with a fresh head made from `seed`."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        folder = resolve_model(str(model))
        torch.manual_seed(seed)
        # fp32 weights, as the policy keeps them: AdamW steps of 7e-6 vanish in bf16, and the
        # served scores equal the trained model's.
        backbone: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        backbone.config.use_cache = False
        head = ValueHead(int(backbone.config.hidden_size))
        scale = REWARD_SCALE
        if (folder / HEAD_FILE).exists():
            state = load_file(str(folder / HEAD_FILE))
            head.summary.load_state_dict({key.rpartition(".")[2]: state[key] for key in HEAD_KEYS})
        if (folder / INFO_FILE).exists():
            scale = float(json.loads((folder / INFO_FILE).read_text()).get("reward_scale", scale))
        ppm = cls(backbone, head, folder, scale)
        return ppm.to(torch_device(device))

    @property
    def device(self) -> torch.device:
        return self.head.summary.weight.device

    @property
    def vocab_size(self) -> int:
        return int(self.backbone.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of right-padded rows [B, L]: the head at each row's last token."""
        hidden = self.backbone.base_model(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state  # the final hidden states, after the last norm
        last = attention_mask.sum(dim=1) - 1
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        rewards: torch.Tensor = self.head(hidden[rows, last])
        return rewards

    def rewards(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rewards [B] of token sequences, in one forward pass (with gradients when
        training)."""
        if any(not ids for ids in sequences):
            raise ValueError("every sequence needs at least one token")
        width = max(len(ids) for ids in sequences)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        rewards: torch.Tensor = self(input_ids.to(self.device), attention_mask.to(self.device))
        return rewards

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], batch_size: int = 16) -> list[float]:
        """Raw rewards of token sequences (no dropout, no gradients), `batch_size` at a time."""
        self.eval()
        scores: list[float] = []
        for start in range(0, len(sequences), batch_size):
            scores.extend(self.rewards(sequences[start : start + batch_size]).cpu().tolist())
        return scores

    def save(self, folder: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write the PPM folder (see the module docstring); it appears whole or not at all."""
        from safetensors.torch import save_file

        target = Path(folder)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.backbone.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (self.source / name).exists():
                shutil.copy(self.source / name, tmp / name)
        weight, bias = self.head.summary.weight, self.head.summary.bias
        tensors = {
            key: tensor.detach().cpu().contiguous()
            for key, tensor in zip(HEAD_KEYS, (weight, bias), strict=True)
        }
        save_file(tensors, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        info = {"format": FORMAT, "reward_scale": self.reward_scale, "base_model": str(self.source)}
        info.update(metadata or {})
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target


def torch_device(name: str = "auto") -> torch.device:
    """auto: the GPU when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
