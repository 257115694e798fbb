"""Trajectories to padded tensors for the policy's forward pass.

Each row is prompt + response, right-padded to the longest row (L tokens). Losses are taken
on next-token predictions, so every per-token tensor here has L - 1 columns: column t scores
`input_ids[:, t + 1]`. `loss_mask[:, t]` is 1 exactly where that target is a token the model
generated (tool responses, prompts and padding are 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] float
    sampling_logprobs: torch.Tensor  # [B, L-1] float, the engine's logprob of each target

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def rows(self, index: slice | list[int]) -> TokenBatch:
        return TokenBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.loss_mask[index],
            self.sampling_logprobs[index],
        )

    def padded(self, rows: int) -> TokenBatch:
        """At least `rows` rows: filler rows of one attended token and no loss, so that every
        rank of a sharded trainer makes the same number of passes."""
        extra = rows - self.input_ids.shape[0]
        if extra <= 0:
            return self
        length = self.input_ids.shape[1]
        attention = torch.zeros((extra, length), dtype=self.attention_mask.dtype)
        attention[:, 0] = 1
        return TokenBatch(
            torch.cat([self.input_ids, self.input_ids.new_zeros((extra, length))]),
            torch.cat([self.attention_mask, attention]),
            torch.cat([self.loss_mask, self.loss_mask.new_zeros((extra, length - 1))]),
            torch.cat(
                [self.sampling_logprobs, self.sampling_logprobs.new_zeros((extra, length - 1))]
            ),
        )


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` rows."""
    extra = rows - tensor.shape[0]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_masks: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]] | None = None,
    pad_id: int = 0,
) -> TokenBatch:
    rows = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    loss_mask = torch.zeros((rows, length - 1), dtype=torch.float32)
    sampling = torch.zeros((rows, length - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        p, r = len(prompt), len(response)
        input_ids[i, : p + r] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[i, : p + r] = 1
        # The target at column t is token t + 1: the response's first token sits at column p - 1.
        loss_mask[i, p - 1 : p - 1 + r] = torch.tensor(response_masks[i], dtype=torch.float32)
        if response_logprobs is not None and len(response_logprobs[i]) == r:
            sampling[i, p - 1 : p - 1 + r] = torch.tensor(response_logprobs[i])
    return TokenBatch(input_ids, attention_mask, loss_mask, sampling)


def plan_micro_batches(
    lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """The rows of each forward/backward pass over rows of `lengths` tokens.

    Without `max_tokens`: `micro_batch_size` rows at a time, in order. With it
    (trainer.maxTokensPerMicroBatch), by tokens: rows longest first, each pass as many as keep
    rows x its longest row (what a padded pass computes) within `max_tokens`; a row longer
    than the budget passes alone. Similar lengths share a pass, so compute follows the
    tokens rather than the longest row of the batch."""
    rows = len(lengths)
    if max_tokens is None:
        return [list(range(start, min(start + micro_batch_size, rows)))
                for start in range(0, rows, micro_batch_size)]  # fmt: skip
    plan: list[list[int]] = []
    for row in sorted(range(rows), key=lambda r: -lengths[r]):
        current = plan[-1] if plan else None
        # Sorted longest first: a pass's first row is its longest.
        if current and (len(current) + 1) * lengths[current[0]] <= max_tokens:
            current.append(row)
        else:
            plan.append([row])
    return plan
