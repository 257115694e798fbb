"""`kubestar eval`: how well a model solves a problem set with the code tool.

Runs the agent loop (greedy by default) on the problems of a .jsonl file (`question`,
`answer`; or a reasoning-gym dataset name) and prints accuracy, how often the model answered
in `\\boxed{}`, tool use and errors, and response lengths. With --engine and --sandbox it
uses running services; without them it starts a vLLM engine on --model and a sandbox server
as local processes on 127.0.0.1 and stops them (by PID) when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click


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
    from kubestar.cli.rollout import format_stats

    n = metrics["trajectories"]
    lines = [
        format_stats(metrics),
        f"answered              {metrics['answered_rate']:.3f} "
        f"({round(metrics['answered_rate'] * n)}/{n} ended with a \\boxed{{}} answer)",
        f"tool-call rate        {metrics['tool_call_rate']:.3f} "
        f"(trajectories with a tool call; {metrics['tool_calls_per_problem']:.2f} calls / problem)",
    ]
    return "\n".join(lines)


def _stop_process(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def local_services(
    model_dir: Path | None,
    sandbox: str | None,
    log_dir: Path,
    *,
    engine_python: str = "",
    max_model_len: int = 4096,
    device: str = "cpu",
    executors: int = 4,
    preload: str = "numpy,sympy",
    progress: bool = True,
) -> Iterator[tuple[str | None, str]]:
    """An engine on `model_dir` (when given) and a sandbox (when `sandbox` is None), started
    here; yields (engine URL or None, sandbox endpoint) and stops what it started."""
    from kubestar.common.net import free_port, wait_serving
    from kubestar.engine.launch import EngineProcess, EngineSettings

    log_dir.mkdir(parents=True, exist_ok=True)
    engine: EngineProcess | None = None
    sandbox_process: subprocess.Popen[bytes] | None = None
    try:
        if model_dir is not None:
            settings = EngineSettings(
                model=str(model_dir),
                port=free_port(),
                max_model_len=max_model_len,
                device=device,
                python=engine_python,
            )
            if progress:
                click.echo(f"starting a vLLM engine on {model_dir} ({settings.url})", err=True)
            engine = EngineProcess(settings, log_path=log_dir / "engine.log").start(wait=False)
        if sandbox is None:
            sandbox = f"127.0.0.1:{free_port()}"
            command = [sys.executable, "-m", "kubestar.cli.main", "sandbox", "serve"]
            command += ["--listen", sandbox, "--executors", str(executors)]
            command += ["--preload", preload, "--log-level", "warning"]
            log = open(log_dir / "sandbox.log", "ab")  # noqa: SIM115 - closed once started
            sandbox_process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            if progress:
                click.echo(f"starting a sandbox server ({sandbox})", err=True)
        if engine is not None:
            try:
                engine.wait_ready(timeout=900)
            except (RuntimeError, TimeoutError) as exc:
                raise click.ClickException(f"{exc}\n{_tail(log_dir / 'engine.log')}") from exc
        if sandbox_process is not None:
            try:
                wait_serving(
                    sandbox,
                    sandbox_process,
                    what="the sandbox",
                    timeout=300,
                    log=log_dir / "sandbox.log",
                )
            except (RuntimeError, TimeoutError) as exc:
                raise click.ClickException(f"{exc}\n{_tail(log_dir / 'sandbox.log')}") from exc
        yield (engine.url if engine is not None else None), sandbox
    finally:
        if engine is not None:
            engine.stop()
        if sandbox_process is not None:
            _stop_process(sandbox_process)


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
    "--engine-python",
    default="",
    help="Python with vLLM for a local engine (default: KUBESTAR_ENGINE_PYTHON, else this one).",
)
@click.option(
    "--max-model-len",
    default=0,
    help="Context length of a local engine (0: max-response-tokens + 1024).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "rocm"]),
    default="cpu",
    show_default=True,
    help="Device of a local engine.",
)
@click.option("--sandbox-executors", default=4, show_default=True)
@click.option(
    "--sandbox-preload",
    default="numpy,sympy",
    show_default=True,
    help="Modules a local sandbox's executors import once.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    default="",
    help="Logs of the local engine and sandbox (default: a temporary folder).",
)
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

    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kubestar-eval-"))
    context_length = max_model_len or max_response_tokens + 1024
    from kubestar.cli.rollout import run_rollouts

    with local_services(
        model_dir if not engine_url else None,
        sandbox,
        logs,
        engine_python=engine_python,
        max_model_len=context_length,
        device=device,
        executors=sandbox_executors,
        preload=sandbox_preload,
        progress=not no_progress,
    ) as (local_engine, sandbox_endpoint):
        url = engine_url or local_engine
        assert url is not None
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
    metrics = eval_metrics(stats, trajectories)
    metrics["model"] = str(model_dir) if model_dir else ""
    metrics["engine"] = url
    metrics["sandbox"] = sandbox_endpoint
    metrics["problems_source"] = problems_spec
    metrics["temperature"] = temperature
    if output:
        with open(output, "w") as handle:
            for trajectory in trajectories:
                handle.write(json.dumps(trajectory, default=str) + "\n")
    if as_json:
        click.echo(json.dumps(metrics, indent=2))
    else:
        click.echo(format_eval(metrics))
