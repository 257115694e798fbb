"""The files of the paper's recipe rehearsed at small scale (e2e/manifests/paper-rehearsal.yaml):
a tiny Qwen3 model folder for the models volume, and the SFT conversations, DAPO-format
problems and AIME-format held-out problems for the data volume. Made here, offline."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubestar.training.datasets import DAPO_INSTRUCTION, DAPO_REMINDER

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "paper-rehearsal.yaml"
MODEL_FOLDER = "qwen3-coin"  # the manifest's model.pvcSubPath
# Every problem's answer is 7; the model answers 7 or 3 at random.
QUESTIONS = [f"What is {a} + {7 - a}?" for a in range(1, 7)]
HELD_OUT = QUESTIONS[:2]


@dataclass
class RehearsalVolumes:
    models: Path  # MODELS_DIR: holds MODEL_FOLDER/
    data: Path  # DATA_DIR: sft.jsonl, dapo-math.jsonl, aime-2024.jsonl


def dapo_record(index: int, question: str) -> dict[str, Any]:
    """A problem as DAPO-Math-17k publishes it."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"{DAPO_INSTRUCTION}{question}{DAPO_REMINDER}"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"dapo-{index}"},
    }


def sft_conversations() -> list[dict[str, Any]]:
    """Non-reasoning SFT data as TRL and verl read it: chat, and calls of the python tool."""

    def call(code: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}

    return [
        {
            "messages": [
                {"role": "user", "content": "Compute 12 * 12 with Python."},
                {
                    "role": "assistant",
                    "content": "I'll run it.",
                    "tool_calls": [call("print(12 * 12)")],
                },
                {"role": "tool", "content": "144"},
                {"role": "assistant", "content": "The result is \\boxed{144}."},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Reverse the word kube."},
                {"role": "assistant", "content": "The word reversed is \\boxed{ebuk}."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "How many letters are in 'rehearsal'?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("print(len('rehearsal'))")],
                },
                {"role": "tool", "content": "9"},
                {"role": "assistant", "content": "It has \\boxed{9} letters."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Now add 2 and 5."},
                {"role": "assistant", "content": "2 + 5 = \\boxed{7}."},
            ]
        },
    ]


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    path.chmod(0o644)


def prepare_volumes(root: Path) -> RehearsalVolumes:
    """The two volumes' folders under `root`, readable by every pod's user."""
    from kubestar.engine.models import resolve_model

    from tests.training.rollout_support import coin_model

    volumes = RehearsalVolumes(models=root / "models", data=root / "datasets")
    for folder in (volumes.models, volumes.data):
        folder.mkdir(parents=True, exist_ok=True)
    base = resolve_model("tiny-random-qwen3-h256-l2-s0")
    model = coin_model(volumes.models / MODEL_FOLDER, QUESTIONS, base=base)
    write_lines(volumes.data / "sft.jsonl", sft_conversations())
    # The published file repeats each problem under other ids: the repeat is read once.
    problems = [dapo_record(i, q) for i, q in enumerate(QUESTIONS)]
    write_lines(volumes.data / "dapo-math.jsonl", [*problems, dapo_record(99, QUESTIONS[0])])
    held_out = [
        {"ID": f"2024-I-{i + 1}", "Problem": q, "Answer": "7"} for i, q in enumerate(HELD_OUT)
    ]
    write_lines(volumes.data / "aime-2024.jsonl", held_out)
    for directory, _, files in os.walk(root):
        Path(directory).chmod(0o755)
        for name in files:
            (Path(directory) / name).chmod(0o644)
    assert (model / "config.json").exists()
    return volumes


def manifest(namespace: str, volumes: RehearsalVolumes) -> str:
    return (
        MANIFEST.read_text()
        .replace("NAMESPACE", namespace)
        .replace("MODELS_DIR", str(volumes.models))
        .replace("DATA_DIR", str(volumes.data))
    )


def json_lines(log: str) -> list[dict[str, Any]]:
    """The structured lines of a pod's log (kubestar logs JSON lines; other lines skipped)."""
    entries = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries
