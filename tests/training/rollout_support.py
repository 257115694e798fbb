"""Helpers of the agent-loop tests: a hermetic ChatML tokenizer, sandbox servers, tool calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

from kubestar.sandbox.server import ServerConfig
from kubestar.training.chat import ChatTokenizer
from kubestar.training.tools import PYTHON_TOOL_SCHEMA, system_prompt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.sandbox.support import TEST_PRELOAD, ThreadedServer, executor_config

REPO = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Modules the tests' tool calls import (calls run as an unprivileged uid that may not read
# the interpreter's library directory, so they use what the executor imported).
ROLLOUT_PRELOAD = (*TEST_PRELOAD, "time", "math", "json")


@cache
def chat_tokenizer() -> ChatTokenizer:
    """A small byte-level BPE with ChatML's special tokens, trained here in milliseconds.

    Byte-level, so any text round-trips; trained on the format's own text, so tool calls
    take a realistic number of tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [
        system_prompt(),
        json.dumps(PYTHON_TOOL_SCHEMA),
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1 + 2)"}}\n</tool_call>',
        "<tool_response>\n3\n</tool_response> The answer is \\boxed{3}.",
        "Calculate 12 + 30. Let me compute this with Python. Traceback (most recent call last)",
        "0123456789 +-*/=()[]{} abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    ] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return ChatTokenizer(tokenizer)


def start_sandbox(executors: int = 2) -> ThreadedServer:
    return ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            executors=executors,
            executor=executor_config(preload=ROLLOUT_PRELOAD),
        )
    ).start()


def tool_call(code: str) -> str:
    return (
        "Let me compute this with Python.\n<tool_call>\n"
        + json.dumps({"name": "python", "arguments": {"code": code}})
        + "\n</tool_call>"
    )


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def coin_model(
    folder: Path,
    questions: list[str],
    answers: tuple[str, ...] = ("7", "3"),
    base: Path | None = None,
) -> Path:
    """The tiny random model `base` (default: tests.real_parts.tiny_model's Llama) taught to
    answer each of `questions` with `\\boxed{a}` for an `a` of `answers`, each exactly equally
    often: sampled, a group's rewards are mixed on purpose. Trained here (a few seconds) and
    written to `folder` as the engines load it; `base` must tie its output layer to its
    embeddings.

    A fair coin on every CPU: the answers' tokens share one embedding row (the model ties its
    output layer to it), projected back to their mean after every step, so their logits are
    the same number wherever the model runs, and so is what follows them."""
    import torch
    from kubestar.training.policy import OptimizerConfig, Policy
    from kubestar.training.tools import IM_END, render_prompt

    from tests.real_parts import tiny_model

    base = base or tiny_model()
    tokenizer = ChatTokenizer.from_model(base)
    policy = Policy(base, OptimizerConfig(learning_rate=3e-3), device="cpu")
    model = policy.model
    prompts = [tokenizer.encode(render_prompt(q, system_prompt())) for q in questions]
    replies = [tokenizer.encode(f"The answer is \\boxed{{{a}}}.{IM_END}") for a in answers]
    # Each answer is one token, the only place where the replies differ.
    common = set.intersection(*(set(reply) for reply in replies))
    sides = sorted({token for reply in replies for token in reply} - common)
    assert len(answers) == 1 or len(sides) == len(answers), f"{answers}: not one token each"
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    assert head.weight.data_ptr() == embeddings.data_ptr()
    # One batch of every (question, answer) row, right-padded: causal attention keeps the
    # padding out of every real position. The loss is the reply tokens' only, the output
    # layer applied at their positions alone (over the whole prompt, its 49,152 columns
    # would cost 40x the rest of the model).
    rows = [(prompt + reply, len(prompt)) for prompt in prompts for reply in replies]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([row + [row[-1]] * (width - len(row)) for row, _ in rows])  # [rows, width]
    targets = torch.zeros_like(ids, dtype=torch.bool)  # positions whose token is learnt
    for index, (row, start) in enumerate(rows):
        targets[index, start : len(row)] = True
    predicted_from = targets.roll(-1, dims=1)  # the position before each learnt token
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        optimizer.zero_grad()
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state  # [rows, width, hidden]
        logits = head(hidden[predicted_from])  # [learnt tokens, vocab]
        loss = torch.nn.functional.cross_entropy(logits, ids[targets], reduction="sum")
        (loss / len(rows)).backward()
        optimizer.step()
        if len(sides) > 1:
            with torch.no_grad():
                embeddings[sides] = embeddings[sides].mean(dim=0)
    return policy.save_weights(folder)
