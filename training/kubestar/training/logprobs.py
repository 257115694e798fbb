"""Token log-probabilities without the logits of the whole vocabulary and sequence.

A causal LM's last step is logits = hidden @ W^T over the vocabulary V; the trainer needs only
log p(target) = logit[target] - logsumexp(logits) at each position. Taking it from the full
logits holds [B, L, V] several times over (the compute-dtype logits, their fp32 copy, the
exponentials of logsumexp, the gradient in fp32 and again in the compute dtype: about 17.6
bytes a logit at bf16, 22 GB for one 8K-token row of Qwen3's 151,936 tokens).

`chunked_token_logprobs` computes the projection, the logsumexp and the gathered target logit
a chunk of positions at a time, keeps only the hidden states and one fp32 logsumexp per
position, and recomputes each chunk's logits in the backward pass: the peak is one chunk's
logits (`LOGITS_PER_CHUNK`) whatever the length. `model_token_logprobs` runs a Hugging Face
causal LM that way: the model's own forward (so FSDP2 gathers and frees its parameters as
usual), with the output projection's forward replaced for the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Logits computed at once: 2**26 is 441 positions of Qwen3's vocabulary, about 270 MB of fp32
# logits per chunk; large enough that each chunk's matmul keeps an accelerator busy.
LOGITS_PER_CHUNK = 1 << 26


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token from the full logits.  logits: [B, L, V] ->
    [B, L-1]. The fallback for heads that are not a plain projection (and the reference the
    chunked path is tested against)."""
    logits = logits[:, :-1, :].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    # logsumexp instead of a full log_softmax: one [B, L-1, V] tensor less in memory.
    return torch.gather(logits, -1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunk_positions(vocab: int, logits_per_chunk: int = LOGITS_PER_CHUNK) -> int:
    return max(1, logits_per_chunk // vocab)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight^T)[target], `chunk` positions at a time, forward and
    backward. hidden: [N, H], weight: [V, H] (both in the compute dtype), targets: [N] ->
    `shape` (N elements) fp32: made in its shape, not a view (FSDP2 warns of a view
    returned by a module, whose in-place changes would skip its backward hooks)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        shape: torch.Size,
    ) -> torch.Tensor:
        positions = hidden.shape[0]
        wide = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
        out = torch.empty(shape, dtype=wide, device=hidden.device)
        logprobs = out.view(-1)
        lse = torch.empty(positions, dtype=wide, device=hidden.device)
        # One chunk holds every position (short rows): its logits are kept for the backward
        # pass instead of recomputed, which costs no more memory than the recompute would.
        kept: torch.Tensor | None = None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, positions, chunk):
                end = min(start + chunk, positions)
                # The projection in the compute dtype, the reduction in fp32, as the full path.
                logits = (hidden[start:end] @ weight.T).to(wide)  # [c, V]
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                target = logits.gather(-1, targets[start:end, None]).squeeze(-1)
                logprobs[start:end] = target - lse[start:end]
                if positions <= chunk:
                    kept = logits
                del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.kept = kept
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        positions = hidden.shape[0]
        wide = lse.dtype
        grad_logprobs = grad_logprobs.reshape(-1).to(wide)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # Summed over chunks in fp32, then cast once (a bf16 running sum would round).
        grad_weight = (
            torch.zeros(weight.shape, dtype=wide, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, positions, ctx.chunk):
                end = min(start + ctx.chunk, positions)
                h = hidden[start:end]
                g = grad_logprobs[start:end, None]  # [c, 1]
                kept, ctx.kept = ctx.kept, None
                logits = kept if kept is not None else (h @ weight.T).to(wide)  # [c, V]
                # d logprob / d logits = onehot(target) - softmax(logits)
                grad_logits = torch.exp(logits.sub_(lse[start:end, None])).mul_(-g)
                grad_logits.scatter_add_(-1, targets[start:end, None], g)
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits @ weight
                if grad_weight is not None:
                    grad_weight += grad_logits.T @ h
                del logits, grad_logits
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
) -> torch.Tensor:
    """log softmax(hidden @ weight^T)[targets] without the full logits.
    hidden: [..., H], weight: [V, H], targets: [...] -> [...] fp32 (fp64 for fp64 inputs).

    Computes in the autocast dtype when autocast is on (as `torch.nn.Linear` would), else
    in the weight's dtype (FSDP2's gathered bf16 weight)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    chunk = chunk_positions(weight.shape[0], logits_per_chunk)
    apply: Any = _ChunkedTargetLogprobs.apply
    logprobs: torch.Tensor = apply(flat, weight.to(dtype), targets.reshape(-1), chunk, shape)
    return logprobs


def plain_head(model: Any) -> torch.nn.Linear | None:
    """The model's output projection when logits are exactly hidden @ W^T (no bias, no
    soft-capping or scaling after it), else None: such models take the full-logits path."""
    head = model.get_output_embeddings()
    config = model.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head


@contextmanager
def _head_gives_logprobs(
    head: torch.nn.Linear, targets: torch.Tensor, logits_per_chunk: int
) -> Iterator[None]:
    """For the duration: the head, given hidden states [B, L, H], returns the chunked
    log-probabilities of `targets` ([B, L-1]) at positions 0 .. L-2 instead of logits."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(hidden[:, :-1], head.weight, targets, logits_per_chunk)

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def model_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunked: bool = True,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
) -> torch.Tensor:
    """Log-probability of each next token under `model`.  input_ids: [B, L] -> [B, L-1].

    Chunked (the default, for a plain output projection) the full logits never exist; the
    head's parameters are used inside the model's forward, where FSDP2 has gathered them."""
    head = plain_head(model) if chunked else None
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(logits, input_ids)
    with _head_gives_logprobs(head, input_ids[:, 1:], logits_per_chunk):
        logprobs: torch.Tensor = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logprobs
