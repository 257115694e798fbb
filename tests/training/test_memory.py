"""The trainer's memory arithmetic (kubestar.training.memory): its parameter count is the
model's, its activation bytes are what autograd keeps, and the figures the GPU examples'
headers state are the ones it computes for their specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubestar.api.v1alpha1 import RolloutFleetSpec, TrainingRunSpec
from kubestar.training.memory import GB, QWEN3, ModelShape, spec_memory, trainer_memory

from tests.real_parts import REPO, require_modules

EXAMPLES = REPO / "examples"
# Each GPU example: its accelerator's memory, GB.
GPU_EXAMPLES = {"paper-amd.yaml": 192, "qwen3-nvidia.yaml": 80}


def documents(path: Path) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def example_memory(name: str) -> tuple[list[str], float, str]:
    """The lines `spec_memory` gives for an example, its total, and the example's header."""
    text = (EXAMPLES / name).read_text()
    docs = documents(EXAMPLES / name)
    run = TrainingRunSpec.model_validate(docs["TrainingRun"]["spec"])
    fleet = RolloutFleetSpec.model_validate(docs["RolloutFleet"]["spec"])
    model = (run.model.pvc_sub_path or run.model.name or "").removesuffix("-Base")
    # The longest row the trainer sees: what the engines may hold (prompt, turns, answer).
    memory = spec_memory(run, QWEN3[model], row_tokens=fleet.engine.max_model_len)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    return memory.lines(), memory.total, header


@pytest.mark.parametrize("name", sorted(GPU_EXAMPLES))
def test_the_examples_headers_state_what_the_arithmetic_gives(name: str) -> None:
    lines, total, header = example_memory(name)
    missing = [line for line in lines if f"#   {line}" not in header]
    assert not missing, f"{name}: recompute its header's memory lines:\n" + "\n".join(
        f"#   {line}" for line in lines
    )
    assert total <= 0.9 * GPU_EXAMPLES[name] * GB  # room for the allocator and NCCL


def test_chunked_logprobs_and_checkpointing_are_what_make_the_paper_fit() -> None:
    shape, tokens = QWEN3["Qwen3-14B"], 32768
    chunked = trainer_memory(shape, ranks=32, micro_batch_tokens=tokens,
                             activation_checkpointing=True)  # fmt: skip
    full = trainer_memory(shape, ranks=32, micro_batch_tokens=tokens,
                          activation_checkpointing=True, chunked_logprobs=False)  # fmt: skip
    # 17.6 bytes a logit of 32K positions x 151,936 (88 GB) and the head's gradient.
    assert full.get("log-probabilities") / GB == pytest.approx(92.3, abs=0.1)
    assert chunked.get("log-probabilities") < full.get("log-probabilities") / 15
    every_layer = trainer_memory(shape, ranks=32, micro_batch_tokens=tokens,
                                 activation_checkpointing=False)  # fmt: skip
    assert every_layer.get("activations") > 10 * chunked.get("activations")
    # Deferring the reduction holds the whole model's fp32 gradients on every rank.
    deferred = chunked.get("gradients summed unsharded")
    assert deferred == 4 * shape.parameters
    once = trainer_memory(shape, ranks=32, micro_batch_tokens=tokens,
                          activation_checkpointing=True, defer_gradient_sync=False)  # fmt: skip
    assert chunked.total - once.total == deferred
    single = trainer_memory(shape, ranks=1, micro_batch_tokens=tokens,
                            activation_checkpointing=True)  # fmt: skip
    assert single.get("gradients summed unsharded") == 0  # nothing to reduce at world size 1


@pytest.mark.parametrize("size", sorted(QWEN3))
def test_parameter_counts_are_the_models(size: str) -> None:
    require_modules("torch", "transformers")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = QWEN3[size]
    config = Qwen3Config(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
    )
    with torch.device("meta"):  # no memory: shapes only
        model = AutoModelForCausalLM.from_config(config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(config.to_dict()) == shape


def test_activation_bytes_are_what_autograd_keeps_for_a_qwen3_layer() -> None:
    require_modules("torch", "transformers")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=100,
    )  # fmt: skip
    model: Any = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    parameters = {p.data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}  # storage -> bytes

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters:
            storage = tensor.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = 128
    hidden = torch.randn(1, tokens, 256, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model.layers[0](hidden, position_ids=positions, position_embeddings=rotary)
    per_token = sum(kept.values()) / tokens
    expected = ModelShape.from_config(config.to_dict()).activation_bytes_per_token()
    assert per_token == pytest.approx(expected, rel=0.05)
