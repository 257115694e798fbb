"""Helpers of the agent-loop tests: a hermetic ChatML tokenizer, sandbox servers, engines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


# Engines --------------------------------------------------------------------------------
MODELS = (
    Path(
        os.environ.get("KUBESTAR_CACHE")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubestar"
        )
    )
    / "models"
)
# CPU attention in vLLM needs head_dim >= 32: hidden 256 / 4 heads = 64.
TINY_HIDDEN = 256


def engine_python() -> str | None:
    """A python with vLLM: KUBESTAR_ENGINE_PYTHON, this one, or /work/vllm-venv's."""
    candidates = [os.environ.get("KUBESTAR_ENGINE_PYTHON", ""), sys.executable]
    candidates.append("/work/vllm-venv/bin/python")
    for python in filter(None, candidates):
        if not shutil.which(python) and not Path(python).exists():
            continue
        probe = subprocess.run(
            [python, "-c", "import importlib.util as u; print(bool(u.find_spec('vllm')))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.stdout.strip() == "True":
            return python
    return None


def prepare_model(python: str, call: str) -> Path:
    """Run a kubestar.engine.models preparation in the engine's python (it has torch)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "services"))
    out = subprocess.run(
        [python, "-c", f"from kubestar.engine.models import *; print({call})"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{call} failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def tiny_model(python: str) -> Path:
    folder = MODELS / f"tiny-random-llama-h{TINY_HIDDEN}-l2-s0"
    if (folder / "model.safetensors").exists():
        return folder
    return prepare_model(python, f"prepare_tiny_model(hidden_size={TINY_HIDDEN})")


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
