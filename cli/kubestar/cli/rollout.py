"""`kubestar rollout`: run N problems x G samples through the agent loop and report.

The flags become one settings object the library runs:
`kubestar.training.entrypoints.AgentRolloutConfig` (`rollout`), whose `rollouts` are the
agent loop's `kubestar.training.evaluation.RolloutSettings`.
"""

from __future__ import annotations

import json

import click
from kubestar.cli.options import library_errors


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
    from kubestar.training.entrypoints import AgentRolloutConfig
    from kubestar.training.entrypoints import rollout as run
    from kubestar.training.evaluation import RolloutSettings, TokenizerNotFound, format_stats

    config = AgentRolloutConfig(
        rollouts=RolloutSettings(
            sandbox=sandbox,
            engine=engine_url or "",
            scheduler=scheduler or "",
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
        ),
        dataset=dataset,
        problems=problems_file or "",
        num_problems=num_problems,
        seed=seed,
        output=output or "",
    )
    try:
        with library_errors():
            stats = run(config)
    except TokenizerNotFound as exc:
        raise click.UsageError(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        click.echo(format_stats(stats))
