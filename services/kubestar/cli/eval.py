"""`kubestar eval`: how well a model solves a problem set with the code tool.

Runs the agent loop (greedy by default) on the problems of a .jsonl file (`question`,
`answer`; or a reasoning-gym dataset name) and prints accuracy, how often the model answered
in `\\boxed{}`, tool use and errors, and response lengths. With --engine and --sandbox it
uses running services; without them it starts a vLLM engine on --model and a sandbox server
as local processes on 127.0.0.1 and stops them (by PID) when it is done.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import click
from kubestar.cli.options import local_services_options


@click.command("eval")
@click.option(
    "--model",
    default="",
    help="Model folder (or embedded name, e.g. SmolLM2-135M-Instruct) to serve; with "
    "--engine, only its tokenizer is used (default: the engine's model).",
)
@click.option(
    "--problems",
    "problems_spec",
    required=True,
    help="A .jsonl file of problems (question, answer), or a reasoning-gym dataset name.",
)
@click.option("-n", "--limit", type=int, default=None, help="Only the first N problems.")
@click.option("--seed", default=0, show_default=True, help="Seed of generated problems.")
@click.option("-g", "--samples", default=1, show_default=True, help="Samples per problem.")
@click.option("--max-turns", default=10, show_default=True)
@click.option("--max-response-tokens", default=2048, show_default=True)
@click.option(
    "--temperature", default=0.0, show_default=True, help="0: greedy decoding (the default)."
)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--sampling-seed", default=0, help="Seed of sampling (0: unseeded).")
@click.option("--tool-timeout", default=10.0, show_default=True, help="Seconds per tool call.")
@click.option(
    "--request-timeout",
    default=900.0,
    show_default=True,
    help="Seconds one generation request may take before the trajectory fails.",
)
@click.option("--engine", "engine_url", metavar="URL", help="A running vLLM engine.")
@click.option("--sandbox", metavar="HOST:PORT", help="A running sandbox (gRPC).")
@click.option(
    "--max-model-len",
    default=0,
    help="Context length of a local engine (0: max-response-tokens + 1024).",
)
@local_services_options
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write every trajectory to this .jsonl file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def evaluate(
    model: str,
    problems_spec: str,
    limit: int | None,
    seed: int,
    samples: int,
    max_turns: int,
    max_response_tokens: int,
    temperature: float,
    top_p: float,
    sampling_seed: int,
    tool_timeout: float,
    request_timeout: float,
    engine_url: str | None,
    sandbox: str | None,
    engine_python: str,
    max_model_len: int,
    device: str,
    sandbox_executors: int,
    sandbox_preload: str,
    log_dir: str,
    output: str | None,
    as_json: bool,
    no_progress: bool,
) -> None:
    """Evaluate a model on problems with the agent loop: accuracy, answered rate, tool
    calls and errors, response lengths."""
    from kubestar.training.datasets import load_problems

    if not engine_url and not model:
        raise click.UsageError("give --model PATH (a local engine is started) or --engine URL")
    model_dir: Path | None = None
    if model:
        from kubestar.engine.models import resolve_model

        try:
            model_dir = resolve_model(model)
        except (FileNotFoundError, RuntimeError, ImportError) as exc:
            raise click.UsageError(str(exc)) from exc
    try:
        problems = load_problems(problems_spec, limit=limit, seed=seed)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from exc
    if not problems:
        raise click.UsageError(f"{problems_spec}: no problems")

    from kubestar.common.net import free_port
    from kubestar.engine.launch import EngineSettings
    from kubestar.training.evaluation import (
        TokenizerNotFound,
        eval_metrics,
        format_eval,
        run_rollouts,
        write_trajectories,
    )
    from kubestar.training.local import LocalSandbox, LocalStack, ServiceFailed

    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kubestar-eval-"))
    local_engines: list[EngineSettings] = []
    if not engine_url:
        assert model_dir is not None
        local_engines.append(
            EngineSettings(
                model=str(model_dir),
                port=free_port(),
                max_model_len=max_model_len or max_response_tokens + 1024,
                device=device,
                python=engine_python,
            )
        )
    local_sandbox = None
    if not sandbox:
        preload = tuple(name for name in sandbox_preload.split(",") if name)
        local_sandbox = LocalSandbox(sandbox_executors, preload, log_level="warning")
    # A GPU engine may take long to load a big model.
    stack = LocalStack(
        logs,
        sandbox=local_sandbox,
        engines=local_engines,
        engine_timeout=900.0,
        sandbox_timeout=300.0,
    )
    if not no_progress:
        for engine in local_engines:
            click.echo(f"starting a vLLM engine on {model_dir} ({engine.url})", err=True)
        if local_sandbox is not None:
            click.echo(f"starting a sandbox server (logs in {logs})", err=True)
    try:
        with stack.running() as started:
            url = engine_url or stack.engines[0].url
            sandbox_endpoint = sandbox or started.sandbox
            stats, trajectories = asyncio.run(
                run_rollouts(
                    engine_url=url,
                    scheduler=None,
                    sandbox=sandbox_endpoint,
                    problems=problems,
                    samples=samples,
                    max_turns=max_turns,
                    max_response_tokens=max_response_tokens,
                    max_context=0,
                    model=str(model_dir) if model_dir else "",
                    temperature=temperature,
                    top_p=top_p,
                    top_k=0,
                    sampling_seed=sampling_seed,
                    tool_timeout=tool_timeout,
                    concurrency=1024,
                    sandbox_mode="stream",
                    request_timeout=request_timeout,
                    verify_workers=2,
                    progress=not no_progress,
                )
            )
    except ServiceFailed as exc:
        raise click.ClickException(str(exc)) from exc
    except TokenizerNotFound as exc:
        raise click.UsageError(str(exc)) from exc
    metrics = eval_metrics(stats, trajectories)
    metrics["model"] = str(model_dir) if model_dir else ""
    metrics["engine"] = url
    metrics["sandbox"] = sandbox_endpoint
    metrics["problems_source"] = problems_spec
    metrics["temperature"] = temperature
    if output:
        write_trajectories(output, trajectories)
    if as_json:
        click.echo(json.dumps(metrics, indent=2))
    else:
        click.echo(format_eval(metrics))
