"""The tokenizer the agent loop uses: encode and decode ChatML text with a model's
`tokenizer.json` (the `tokenizers` library; no transformers or torch needed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kubestar.training.tools import IM_END
from tokenizers import Tokenizer


class ChatTokenizer:
    """Special tokens written in the text (`<|im_start|>`, `<|im_end|>`) encode to their ids."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str = IM_END) -> None:
        self.tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"the tokenizer has no {eos_token!r} token")
        self.eos_token = eos_token
        self.eos_id: int = eos_id

    @classmethod
    def from_model(cls, model_dir: str | Path) -> ChatTokenizer:
        folder = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        eos = IM_END
        config = folder / "tokenizer_config.json"
        if config.exists() and tokenizer.token_to_id(IM_END) is None:
            value = json.loads(config.read_text()).get("eos_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                eos = value
        return cls(tokenizer, eos)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))
