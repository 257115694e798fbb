"""Log-probabilities a chunk of positions at a time equal those from the full logits, forward
and gradient, on a real model; and the full logits are never kept for the backward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real_parts import require_modules, tiny_model

require_modules("torch", "transformers")

import torch  # noqa: E402
from kubestar.training.batch import make_batch  # noqa: E402
from kubestar.training.logprobs import (  # noqa: E402
    chunked_token_logprobs,
    model_token_logprobs,
    plain_head,
    token_logprobs,
)
from kubestar.training.policy import OptimizerConfig, Policy  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(64)


def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 13 and 8 tokens (the second right-padded); loss on the responses."""
    batch = make_batch([[1, 17, 42], [5, 6]], [list(range(30, 40)), [7, 8, 9, 10, 11, 12]],
                       [[1] * 10, [1, 1, 0, 0, 1, 1]])  # fmt: skip
    return batch.input_ids, batch.attention_mask, batch.loss_mask


def logprobs_and_grads(
    model: Any, chunked: bool, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    input_ids, attention_mask, loss_mask = rows()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        # 3 positions per chunk: every row spans several chunks, the last one short.
        vocab = model.config.vocab_size
        logprobs = model_token_logprobs(
            model, input_ids, attention_mask, chunked=chunked, logits_per_chunk=3 * vocab
        )
    weights = torch.linspace(-1.0, 2.0, logprobs.shape[1])  # tokens weigh differently
    (logprobs * loss_mask * weights).sum().backward()
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return logprobs.detach(), grads


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
    ids=["fp32", "bf16-autocast"],
)
def test_chunked_logprobs_and_gradients_equal_the_full_logits(
    model_dir: Path, dtype: torch.dtype, tolerance: float
) -> None:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert plain_head(model) is model.get_output_embeddings()
    full, full_grads = logprobs_and_grads(model, chunked=False, dtype=dtype)
    chunked, chunked_grads = logprobs_and_grads(model, chunked=True, dtype=dtype)
    assert chunked.dtype == torch.float32 and chunked.shape == full.shape == (2, 12)
    torch.testing.assert_close(chunked, full, rtol=tolerance, atol=tolerance)
    assert full_grads.keys() == chunked_grads.keys()
    # Every parameter's gradient, the output projection's (tied to the embedding) included.
    for name, grad in full_grads.items():
        scale = float(grad.abs().max()) or 1.0
        torch.testing.assert_close(
            chunked_grads[name], grad, rtol=tolerance, atol=tolerance * scale, msg=name
        )
    head = next(name for name, p in model.named_parameters() if p is model.lm_head.weight)
    assert float(full_grads[head].abs().max()) > 0
    assert "forward" not in vars(model.lm_head)  # the class's forward again


@pytest.mark.parametrize(("dtype", "computed"), [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_the_head_multiplies_in_the_compute_dtype(
    model_dir: Path, dtype: torch.dtype, computed: torch.dtype
) -> None:
    """Under bf16 autocast the output projection's weight and input are cast to bf16, as
    torch.nn.Linear's would be (what the chunks multiply is what autograd keeps)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids, attention_mask, _ = rows()
    shape = model.lm_head.weight.shape
    kept: set[torch.dtype] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape == shape:
            kept.add(tensor.dtype)
        return tensor

    with (
        torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        model_token_logprobs(model, input_ids, attention_mask)
    assert kept == {computed}


def test_the_function_alone_matches_log_softmax_with_uneven_chunks() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    got = chunked_token_logprobs(hidden, weight, targets, logits_per_chunk=4 * 11)
    expected = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None])
    torch.testing.assert_close(got, expected.squeeze(-1))
    # The backward pass in float64, checked against finite differences.
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_token_logprobs(h, w, targets, logits_per_chunk=3 * 11),
        (hidden, weight),
    )
    # Every position in one chunk: the forward's logits serve the backward pass as they are.
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_token_logprobs(h, w, targets, logits_per_chunk=10 * 11),
        (hidden, weight),
    )


def saved_elements(model: Any, chunked: bool) -> int:
    """The largest tensor (elements) autograd keeps for the backward pass of one forward,
    the parameters themselves left out."""
    input_ids, attention_mask, _ = rows()
    parameters = {p.data_ptr() for p in model.parameters()}
    largest = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if tensor.data_ptr() not in parameters:
            largest = max(largest, tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model_token_logprobs(model, input_ids, attention_mask, chunked=chunked)
    return largest


def test_no_logits_of_the_whole_sequence_are_kept(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids, _, _ = rows()
    logits = input_ids.shape[0] * (input_ids.shape[1] - 1) * model.config.vocab_size
    assert saved_elements(model, chunked=False) >= logits  # the full path keeps them all
    # Chunked, nothing kept has even one position's logits (the vocabulary).
    assert saved_elements(model, chunked=True) < model.config.vocab_size


def test_the_policy_trains_the_same_through_either_path(model_dir: Path) -> None:
    """One SFT step with chunked log-probabilities leaves the parameters the full-logits
    path leaves."""
    after = []
    for chunked in (False, True):
        policy = Policy(
            model_dir, OptimizerConfig(learning_rate=1e-3), device="cpu",
            chunked_logprobs=chunked,
        )  # fmt: skip
        before = [p.detach().clone() for p in policy.model.parameters()]
        batch = make_batch([[1, 17, 42], [5, 6]], [list(range(30, 40)), [7, 8, 9]],
                           [[1] * 10, [1, 0, 1]])  # fmt: skip
        policy.sft_step(batch)
        params = [p.detach().clone() for p in policy.model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
        after.append(params)
    for full, chunked_params in zip(*after, strict=True):
        torch.testing.assert_close(chunked_params, full, rtol=1e-5, atol=1e-6)


def test_token_logprobs_is_log_softmax_of_the_targets() -> None:
    logits = torch.randn(1, 4, 9)
    ids = torch.randint(0, 9, (1, 4))
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids), expected)
