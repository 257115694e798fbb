"""A model on a problem set, outside training: the agent loop against running services.

`run_rollouts` runs `samples` trajectories per problem through the agent loop, against one
vLLM engine or the rollout scheduler, with the sandbox for the code tool (`RolloutSettings`),
and returns the batch's stats with every trajectory (`write_trajectories` keeps them as JSON
lines).
`kubestar rollout` prints those stats (`format_stats`); `kubestar eval` adds how often the
model answered and called the tool (`eval_metrics`, `format_eval`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubestar.api.errors import SettingError
from kubestar.common.net import check_grpc_serving, check_http_serving
from kubestar.engine.models import resolve_model
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem
from kubestar.training.executors import SandboxBatchExecutor, SandboxStreamExecutor, ToolExecutor
from kubestar.training.generators import EngineGenerator, Generator, Sampling, SchedulerGenerator
from kubestar.training.rewards import RewardScorer
from kubestar.training.rollout import AgentLoop, RolloutConfig, rollout
from kubestar.training.trajectory import Trajectory
from tqdm import tqdm

# The tokenizer when neither the caller nor the engine names one.
FALLBACK_TOKENIZER_MODEL = "SmolLM2-135M-Instruct"


class TokenizerNotFound(RuntimeError):
    """No tokenizer to encode the problems with (pass a model that has one)."""


def tokenizer_source(model: str, engine_root: str) -> Path:
    """The model folder whose tokenizer the agent loop uses: `model` when given, else the
    engine's own model folder when it is readable here, else the default model."""
    if model:
        return resolve_model(model)
    if engine_root and (Path(engine_root) / "tokenizer.json").exists():
        return Path(engine_root)
    return resolve_model(FALLBACK_TOKENIZER_MODEL)


async def engine_info(url: str) -> tuple[int, str]:
    """The engine's context length and model folder, from its /v1/models (0, "" if unknown)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"{url.rstrip('/')}/v1/models") as response,
        ):
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return 0, ""
    for entry in data.get("data") or []:
        return int(entry.get("max_model_len") or 0), str(entry.get("root") or "")
    return 0, ""


@dataclass(frozen=True)
class RolloutSettings:
    """How `run_rollouts` runs the agent loop, and on which running services: the sandbox
    and exactly one of `engine` and `scheduler`. Defaults are `kubestar rollout`'s; each
    field is its flag of the same name."""

    sandbox: str  # the sandbox (HOST:PORT)
    engine: str = ""  # one vLLM engine (http://HOST:PORT)
    scheduler: str = ""  # or the rollout scheduler (HOST:PORT)
    samples: int = 4  # per problem
    max_turns: int = 10
    max_response_tokens: int = 2048
    max_context: int = 0  # the engine's context length (0: ask the engine; a scheduler: none)
    # The tokenizer: a model folder or a name kubestar resolves ("": the engine's model,
    # else FALLBACK_TOKENIZER_MODEL).
    model: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    sampling_seed: int = 0  # 0: unseeded
    tool_timeout: float = 10.0  # seconds per tool call
    concurrency: int = 1024  # trajectories in flight at once
    sandbox_mode: str = "stream"  # one long-lived stream, or micro-batches ("batch")
    request_timeout: float = 1800.0  # seconds one turn may take, queueing included
    verify_workers: int = 2  # processes that verify answers
    progress: bool = True  # a progress bar on stderr

    def __post_init__(self) -> None:
        if bool(self.engine) == bool(self.scheduler):
            raise SettingError("engine", "give exactly one of engine and scheduler")


async def run_rollouts(
    problems: list[Problem], settings: RolloutSettings
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `settings.samples` trajectories per problem through the agent loop (against one
    engine or a scheduler); returns the batch's stats and each trajectory as a dict. Raises
    ServiceUnreachable when a service does not answer, TokenizerNotFound when no tokenizer can
    be had."""
    s = settings
    sandbox, engine_url, scheduler = s.sandbox, s.engine, s.scheduler
    await check_grpc_serving(sandbox, "--sandbox")
    if engine_url:
        await check_http_serving(engine_url, "--engine")
    else:
        await check_grpc_serving(scheduler, "--scheduler")
    generator: Generator
    engine_root = ""
    max_context = s.max_context
    if engine_url:
        engine_context, engine_root = await engine_info(engine_url)
        max_context = max_context or engine_context
        generator = EngineGenerator(engine_url, timeout=s.request_timeout)
    else:
        generator = SchedulerGenerator(scheduler, timeout=s.request_timeout)
    try:
        tokenizer = ChatTokenizer.from_model(tokenizer_source(s.model, engine_root))
    except (FileNotFoundError, ImportError, RuntimeError) as exc:
        raise TokenizerNotFound(f"no tokenizer: {exc} (pass --model PATH)") from exc
    tools: ToolExecutor
    if s.sandbox_mode == "stream":
        tools = SandboxStreamExecutor(sandbox)
    else:
        tools = SandboxBatchExecutor(sandbox)
    config = RolloutConfig(
        max_turns=s.max_turns,
        max_response_tokens=s.max_response_tokens,
        max_context_tokens=max_context,
        sampling=Sampling(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.sampling_seed
        ),
        tool_timeout_seconds=s.tool_timeout,
        max_concurrency=s.concurrency,
    )
    loop = AgentLoop(generator, tools, tokenizer, config)
    scorer = RewardScorer(workers=s.verify_workers)
    bar = tqdm(
        total=len(problems) * s.samples,
        unit="traj",
        disable=not s.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    totals = {"reward": 0.0, "calls": 0, "errors": 0, "done": 0}

    def done(trajectory: Trajectory) -> None:
        totals["done"] += 1
        totals["reward"] += trajectory.reward or 0.0
        totals["calls"] += trajectory.num_tool_calls
        totals["errors"] += trajectory.num_tool_errors
        calls = totals["calls"]
        bar.set_postfix(
            acc=f"{totals['reward'] / totals['done']:.3f}",
            calls=calls,
            err=f"{totals['errors'] / calls:.2f}" if calls else "-",
            refresh=False,
        )
        bar.update(1)

    try:
        trajectories, stats = await rollout(loop, problems, s.samples, scorer, on_done=done)
    finally:
        bar.close()
        scorer.close()
        await tools.close()
        await generator.close()
    return stats.to_dict(), [t.to_dict() for t in trajectories]


def write_trajectories(path: str | Path, trajectories: list[dict[str, Any]]) -> None:
    """Every trajectory as one JSON line."""
    with open(path, "w") as handle:
        for trajectory in trajectories:
            handle.write(json.dumps(trajectory, default=str) + "\n")


def format_stats(stats: dict[str, Any]) -> str:
    """The stats of a batch of rollouts, one figure a line (what `kubestar rollout` prints)."""
    finish = ", ".join(f"{k} {v}" for k, v in sorted(stats["finish_reasons"].items()))
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(stats["tool_statuses"].items()))
    lines = [
        f"trajectories          {stats['trajectories']} "
        f"({stats['problems']} problems x {stats['samples']} samples)",
        f"accuracy              {stats['accuracy']:.3f} "
        f"(pass@{stats['samples']} {stats['pass_at_samples']:.3f})",
        f"finish reasons        {finish or '-'}",
        f"tool calls / traj     {stats['tool_calls_per_trajectory']:.2f} "
        f"({stats['tool_calls']} calls, {stats['mean_turns']:.2f} turns / traj)",
        f"tool error rate       {stats['tool_error_rate']:.3f} ({stats['tool_errors']} errors"
        + (f": {statuses}" if statuses else "")
        + ")",
        f"response tokens       mean {stats['response_tokens_mean']:.1f}, "
        f"p50 {stats['response_tokens_p50']:.0f}, max {stats['response_tokens_max']} "
        f"(model {stats['model_tokens']}, tool {stats['tool_tokens']})",
        f"throughput            {stats['trajectories_per_s']:.3f} trajectories/s, "
        f"{stats['tokens_per_s']:.1f} tokens/s ({stats['generated_tokens_per_s']:.1f} "
        "generated tokens/s)",
        f"wall time             {stats['wall_s']:.1f} s",
    ]
    if stats["errors"]:
        lines.append(f"failed trajectories   {stats['errors']} (generation errors)")
    return "\n".join(lines)


def eval_metrics(stats: dict[str, Any], trajectories: list[dict[str, Any]]) -> dict[str, Any]:
    """What eval adds to the rollout stats: answered and tool-call rates, calls per problem."""
    n = len(trajectories)
    answered = sum(1 for t in trajectories if t.get("finish_reason") == "answered")
    with_calls = sum(1 for t in trajectories if (t.get("num_tool_calls") or 0) > 0)
    problems = stats.get("problems") or 0
    return {
        **stats,
        "answered_rate": answered / n if n else 0.0,
        "tool_call_rate": with_calls / n if n else 0.0,
        "tool_calls_per_problem": stats.get("tool_calls", 0) / problems if problems else 0.0,
    }


def format_eval(metrics: dict[str, Any]) -> str:
    """The rollout stats and eval's own figures, one a line (what `kubestar eval` prints)."""
    n = metrics["trajectories"]
    lines = [
        format_stats(metrics),
        f"answered              {metrics['answered_rate']:.3f} "
        f"({round(metrics['answered_rate'] * n)}/{n} ended with a \\boxed{{}} answer)",
        f"tool-call rate        {metrics['tool_call_rate']:.3f} "
        f"(trajectories with a tool call; {metrics['tool_calls_per_problem']:.2f} calls / problem)",
    ]
    return "\n".join(lines)
