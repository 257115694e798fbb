"""`kubestar rollout`: run N problems x G samples through the agent loop and report."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import click


def _tokenizer_source(model: str, engine_root: str) -> Path:
    from kubestar.engine.models import resolve_model

    if model:
        return resolve_model(model)
    if engine_root and (Path(engine_root) / "tokenizer.json").exists():
        return Path(engine_root)
    return resolve_model("SmolLM2-135M-Instruct")


async def _engine_info(url: str) -> tuple[int, str]:
    """The engine's context length and model folder, from its /v1/models (0, "" if unknown)."""
    import aiohttp

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


def format_stats(stats: dict[str, Any]) -> str:
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


@click.command("rollout")
@click.option("--engine", "engine_url", metavar="URL", help="One vLLM engine (http://HOST:PORT).")
@click.option("--scheduler", metavar="HOST:PORT", help="The rollout scheduler (gRPC).")
@click.option("--sandbox", required=True, metavar="HOST:PORT", help="The sandbox (gRPC).")
@click.option(
    "--dataset",
    default="basic_arithmetic",
    show_default=True,
    help="reasoning-gym dataset, optionally NAME:key=value,... for its config.",
)
@click.option(
    "--problems",
    "problems_file",
    type=click.Path(exists=True, dir_okay=False),
    help="A .jsonl file of problems (question, answer) instead of --dataset.",
)
@click.option("-n", "--num-problems", default=10, show_default=True)
@click.option("-g", "--samples", default=4, show_default=True, help="Samples per problem.")
@click.option("--seed", default=0, show_default=True, help="Seed of the generated problems.")
@click.option("--max-turns", default=10, show_default=True)
@click.option("--max-response-tokens", default=2048, show_default=True)
@click.option(
    "--max-context",
    default=0,
    help="The engine's context length (0: ask the engine; unlimited with a scheduler).",
)
@click.option(
    "--model",
    default="",
    help="Tokenizer: a model folder or embedded name (default: the engine's model, "
    "else SmolLM2-135M-Instruct).",
)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--sampling-seed", default=0, help="Seed of sampling (0: unseeded).")
@click.option("--tool-timeout", default=10.0, show_default=True, help="Seconds per tool call.")
@click.option(
    "--concurrency", default=1024, show_default=True, help="Trajectories in flight at once."
)
@click.option(
    "--sandbox-mode",
    type=click.Choice(["stream", "batch"]),
    default="stream",
    show_default=True,
    help="One long-lived stream, or micro-batches.",
)
@click.option(
    "--request-timeout",
    default=1800.0,
    show_default=True,
    help="Seconds one turn may take (queueing included) before its trajectory fails.",
)
@click.option(
    "--verify-workers", default=2, show_default=True, help="Processes that verify answers."
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write every trajectory to this .jsonl file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the stats as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def rollout(
    engine_url: str | None,
    scheduler: str | None,
    sandbox: str,
    dataset: str,
    problems_file: str | None,
    num_problems: int,
    samples: int,
    seed: int,
    max_turns: int,
    max_response_tokens: int,
    max_context: int,
    model: str,
    temperature: float,
    top_p: float,
    top_k: int,
    sampling_seed: int,
    tool_timeout: float,
    concurrency: int,
    sandbox_mode: str,
    request_timeout: float,
    verify_workers: int,
    output: str | None,
    as_json: bool,
    no_progress: bool,
) -> None:
    """Run N problems x G samples through the agent loop and print accuracy, tool use,
    response lengths and throughput."""
    if bool(engine_url) == bool(scheduler):
        raise click.UsageError("give exactly one of --engine URL and --scheduler HOST:PORT")
    from kubestar.training.datasets import load_problems

    try:
        problems = load_problems(problems_file or dataset, limit=num_problems, seed=seed)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from exc
    stats, trajectories = asyncio.run(
        run_rollouts(
            engine_url=engine_url,
            scheduler=scheduler,
            sandbox=sandbox,
            problems=problems,
            samples=samples,
            max_turns=max_turns,
            max_response_tokens=max_response_tokens,
            max_context=max_context,
            model=model,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            sampling_seed=sampling_seed,
            tool_timeout=tool_timeout,
            concurrency=concurrency,
            sandbox_mode=sandbox_mode,
            request_timeout=request_timeout,
            verify_workers=verify_workers,
            progress=not no_progress,
        )
    )
    if output:
        with open(output, "w") as handle:
            for trajectory in trajectories:
                handle.write(json.dumps(trajectory, default=str) + "\n")
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        click.echo(format_stats(stats))


async def run_rollouts(
    *,
    engine_url: str | None,
    scheduler: str | None,
    sandbox: str,
    problems: list[Any],
    samples: int,
    max_turns: int,
    max_response_tokens: int,
    max_context: int,
    model: str,
    temperature: float,
    top_p: float,
    top_k: int,
    sampling_seed: int,
    tool_timeout: float,
    concurrency: int,
    sandbox_mode: str,
    request_timeout: float,
    verify_workers: int,
    progress: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `samples` trajectories per problem through the agent loop (against one engine or
    a scheduler); returns the batch's stats and each trajectory as a dict. `kubestar eval`
    uses it too."""
    from kubestar.training.chat import ChatTokenizer
    from kubestar.training.executors import (
        SandboxBatchExecutor,
        SandboxStreamExecutor,
        ToolExecutor,
    )
    from kubestar.training.generators import (
        EngineGenerator,
        Generator,
        Sampling,
        SchedulerGenerator,
    )
    from kubestar.training.rewards import RewardScorer
    from kubestar.training.rollout import AgentLoop, RolloutConfig, rollout
    from kubestar.training.trajectory import Trajectory
    from tqdm import tqdm

    generator: Generator
    engine_root = ""
    if engine_url:
        engine_context, engine_root = await _engine_info(engine_url)
        max_context = max_context or engine_context
        generator = EngineGenerator(engine_url, timeout=request_timeout)
    else:
        assert scheduler is not None
        generator = SchedulerGenerator(scheduler, timeout=request_timeout)
    try:
        tokenizer = ChatTokenizer.from_model(_tokenizer_source(model, engine_root))
    except (FileNotFoundError, ImportError, RuntimeError) as exc:
        raise click.UsageError(f"no tokenizer: {exc} (pass --model PATH)") from exc
    tools: ToolExecutor
    if sandbox_mode == "stream":
        tools = SandboxStreamExecutor(sandbox)
    else:
        tools = SandboxBatchExecutor(sandbox)
    config = RolloutConfig(
        max_turns=max_turns,
        max_response_tokens=max_response_tokens,
        max_context_tokens=max_context,
        sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=sampling_seed),
        tool_timeout_seconds=tool_timeout,
        max_concurrency=concurrency,
    )
    loop = AgentLoop(generator, tools, tokenizer, config)
    scorer = RewardScorer(workers=verify_workers)
    bar = tqdm(
        total=len(problems) * samples,
        unit="traj",
        disable=not progress,
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
        trajectories, stats = await rollout(loop, problems, samples, scorer, on_done=done)
    finally:
        bar.close()
        scorer.close()
        await tools.close()
        await generator.close()
    return stats.to_dict(), [t.to_dict() for t in trajectories]
