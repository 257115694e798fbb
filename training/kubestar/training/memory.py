"""What the trainer holds per GPU, by arithmetic, in one place.

`trainer_memory` adds up, for a model's shape and the trainer's settings, the bytes each
rank holds at its peak: the sharded state (fp32 weights, gradients and AdamW moments), the
gradients summed unsharded until an update's last micro-batch (`Policy._sync_gradients`),
the parameters gathered in the compute dtype, the activations (with and without activation
checkpointing) and the log-probabilities as the trainer computes them (chunked, or from the
full logits). `spec_memory` takes them from a TrainingRun's spec. The examples' headers
state these figures (tests/training/test_memory.py recomputes them) and
bench/trainer_logprob_bench.py and bench/gpu_check.py print them beside what they measure.

Activation bytes come from counting what autograd keeps for one Hugging Face Qwen3 decoder
layer in bf16 (sdpa, whose kernels keep no [L, L] scores): 16 bytes per hidden unit, 8 per
MLP unit, 10 per query and 10 per key/value channel, per token. Nothing here imports
pydantic or torch, so a machine with only PyTorch can run it (bench/gpu_check.sh).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubestar.api.v1alpha1 import TrainingRunSpec

GB = 1e9
# Mirrors kubestar.training.logprobs.LOGITS_PER_CHUNK (not imported: that module needs torch).
LOGITS_PER_CHUNK = 1 << 26
# Bytes per logit of the full-logits path, forward and backward at its peak: measured on CPU
# with bf16 logits (the compute-dtype logits, their fp32 copy, logsumexp's exponentials, the
# fp32 gradient and its compute-dtype cast); at fp32 the first copy is the logits themselves.
FULL_LOGIT_BYTES = {"bf16": 17.6, "fp32": 16.0}
# A chunk's logits in flight: the compute-dtype product, its fp32 copy and exponentials.
CHUNK_LOGIT_BYTES = 10.0


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen3-style decoder, as its Hugging Face config.json describes it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = True  # Qwen3's q_norm and k_norm

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type", "qwen3") == "qwen3",
        )

    @property
    def layer_parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * q + 2 * kv) + (2 * self.head_dim if self.qk_norm else 0)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        head = 0 if self.tied else self.embedding_parameters
        return (
            self.layers * self.layer_parameters
            + self.embedding_parameters
            + head
            + self.hidden  # the final norm
        )

    def activation_bytes_per_token(self, compute_bytes: int = 2) -> float:
        """What autograd keeps for one decoder layer per token (see the module's note)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bf16 = 16 * self.hidden + 8 * self.intermediate + 10 * q + 10 * kv
        return bf16 * compute_bytes / 2


# config.json of each Qwen3 size (the -Base models share their instruct model's shape).
QWEN3: dict[str, ModelShape] = {
    "Qwen3-0.6B": ModelShape(1024, 3072, 28, 16, 8, 128, 151936, tied=True),
    "Qwen3-1.7B": ModelShape(2048, 6144, 28, 16, 8, 128, 151936, tied=True),
    "Qwen3-4B": ModelShape(2560, 9728, 36, 32, 8, 128, 151936, tied=True),
    "Qwen3-8B": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, tied=False),
    "Qwen3-14B": ModelShape(5120, 17408, 40, 40, 8, 128, 151936, tied=False),
}


@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: float


@dataclass(frozen=True)
class TrainerMemory:
    """Per-GPU bytes, item by item, and what they were computed for."""

    items: tuple[MemoryItem, ...]
    ranks: int
    micro_batch_tokens: int
    compute: str
    activation_checkpointing: bool
    chunked_logprobs: bool

    @property
    def total(self) -> float:
        return sum(item.bytes for item in self.items)

    def get(self, prefix: str) -> float:
        """The bytes of the items whose name starts with `prefix`."""
        return sum(item.bytes for item in self.items if item.name.startswith(prefix))

    def lines(self, width: int = 78) -> list[str]:
        """One line per item and the total, each `name .... 12.3 GB` in `width` characters
        (the form the examples' headers quote)."""
        rows = [*((item.name, item.bytes) for item in self.items), ("total", self.total)]
        return [f"{name} ".ljust(width - 9, ".") + f"{size / GB:6.1f} GB" for name, size in rows]


def trainer_memory(
    shape: ModelShape,
    *,
    ranks: int,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    compute: str = "bf16",
    chunked_logprobs: bool = True,
    defer_gradient_sync: bool = True,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
) -> TrainerMemory:
    """Peak bytes per GPU of one rank of a trainer of `ranks` (FSDP2 over all of them at
    more than one) training on micro-batches of `micro_batch_tokens` tokens."""
    if compute not in FULL_LOGIT_BYTES:
        raise ValueError(f"compute: {compute!r} is not bf16 or fp32")
    size = 2 if compute == "bf16" else 4
    p, tokens, h, v = shape.parameters, micro_batch_tokens, shape.hidden, shape.vocab
    items = [
        MemoryItem(f"fp32 weights, sharded (4 B/parameter / {ranks})", 4 * p / ranks),
        MemoryItem(f"fp32 gradients, sharded (4 B/parameter / {ranks})", 4 * p / ranks),
        MemoryItem(f"AdamW moments, sharded (8 B/parameter / {ranks})", 8 * p / ranks),
    ]
    if ranks > 1 and defer_gradient_sync:
        items.append(MemoryItem("gradients summed unsharded until the last micro-batch", 4 * p))
    if ranks > 1:
        # FSDP2: the root (embedding, head) stays gathered between forward and backward;
        # one decoder layer computes while the next is gathered.
        root = shape.embedding_parameters * (1 if shape.tied else 2)
        gathered = size * (root + 2 * shape.layer_parameters)
        items.append(MemoryItem(f"{compute} parameters gathered (root and 2 layers)", gathered))
    elif compute == "bf16":
        items.append(MemoryItem("bf16 copies of the weights (autocast)", 2 * p))
    per_layer = shape.activation_bytes_per_token(size)
    if activation_checkpointing:
        items.append(
            MemoryItem("activations: each layer's input kept", size * h * tokens * shape.layers)
        )
        items.append(MemoryItem("activations: one layer recomputed", per_layer * tokens))
    else:
        items.append(MemoryItem("activations of every layer", per_layer * tokens * shape.layers))
    head_gradient = 6 * v * h  # the head's gradient: fp32 for the reduction, and its cast
    if chunked_logprobs:
        chunk = max(1, logits_per_chunk // v)
        logprobs = (
            tokens * (size * h + 8)  # the head's input, and one fp32 logsumexp per position
            + min(chunk, tokens) * v * CHUNK_LOGIT_BYTES
            + head_gradient
        )
        items.append(MemoryItem("log-probabilities, chunked", logprobs))
    else:
        logits = tokens * v * FULL_LOGIT_BYTES[compute]
        items.append(MemoryItem("log-probabilities from full logits", logits + head_gradient))
    return TrainerMemory(
        items=tuple(items),
        ranks=ranks,
        micro_batch_tokens=tokens,
        compute=compute,
        activation_checkpointing=activation_checkpointing,
        chunked_logprobs=chunked_logprobs,
    )


def micro_batch_tokens(max_tokens: int | None, rows: int, row_tokens: int) -> int:
    """The most tokens one pass holds: a token budget (a longer row passes alone), or `rows`
    rows of up to `row_tokens` each."""
    return max(max_tokens, row_tokens) if max_tokens else rows * row_tokens


def spec_memory(spec: TrainingRunSpec, shape: ModelShape, row_tokens: int) -> TrainerMemory:
    """`trainer_memory` of a TrainingRun: its ranks, micro-batches, activation
    checkpointing and precision (auto: bf16 where the pods ask for GPUs), for rows of up to
    `row_tokens` tokens (the engines' maxModelLen: prompt, responses and tool output)."""
    trainer = spec.trainer
    gpus = any(name.endswith("/gpu") for name in trainer.resources.limits)
    compute = trainer.precision
    if compute == "auto":
        compute = "bf16" if gpus or trainer.device == "cuda" else "fp32"
    return trainer_memory(
        shape,
        ranks=trainer.workers * trainer.processes_per_worker,
        micro_batch_tokens=micro_batch_tokens(
            trainer.max_tokens_per_micro_batch, trainer.micro_batch_size, row_tokens
        ),
        activation_checkpointing=trainer.activation_checkpointing,
        compute=compute,
    )
