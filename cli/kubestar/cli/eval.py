"""`kubestar eval`: how well a model solves a problem set with the code tool.

Runs the agent loop (greedy by default) on the problems of a .jsonl file (`question`,
`answer`; or a reasoning-gym dataset name) and prints accuracy, how often the model answered
in `\\boxed{}`, tool use and errors, and response lengths. With --engine and --sandbox it
uses running services; without them it starts a vLLM engine on --model and a sandbox server
as local processes on 127.0.0.1 and stops them (by PID) when it is done.

With --search MODES it measures test-time search instead: every mode of the list at every
budget of --budgets on the same problems (`kubestar.search.sweep`), on the scheduler and
the sandbox as `kubestar solve` runs them (its options and service startup), and prints
accuracy with a 95% bootstrap interval against the tokens generated per problem; --plot
draws it as a PNG.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from kubestar.cli.options import local_services_options
from kubestar.cli.solve import SolvedTally, search_options, search_services, solver_stack
from kubestar.search.scorer import PpmSource
from kubestar.search.solve import BEAM, GREEDY, MCTS_MODE, MODES, SCORED_MODES

if TYPE_CHECKING:
    from kubestar.search.ppm_data import Encode
    from kubestar.search.sweep import SweepPoint, SweepSettings
    from kubestar.training.datasets import Problem

# The agent loop's own flags: --search refuses them.
AGENT_LOOP_FLAGS = ("engine_url", "samples", "max_turns", "max_response_tokens", "request_timeout")
# The flags only --search uses, and the modes that use each (every mode: None).
SEARCH_FLAGS: dict[str, frozenset[str] | None] = {
    "budgets": frozenset(MODES) - {GREEDY},
    "plot": None,
    "format_name": None,
    "ppm": SCORED_MODES,
    "ppm_endpoint": SCORED_MODES,
    "ppm_device": SCORED_MODES,
    "children": frozenset({MCTS_MODE}),
    "exploration": frozenset({MCTS_MODE}),
    "beam_samples": frozenset({BEAM}),
    "top_k": frozenset({MCTS_MODE, BEAM}),
    "max_depth": None,
    "max_code_errors": None,
    "max_step_tokens": None,
    "concurrency": None,
    "scheduler": None,
    "scheduler_policy": None,
    "no_affinity": None,
    "max_context": None,
}


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
    "--temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="0: greedy decoding [default: 0; 0.7 with --search].",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1),
    default=None,
    help="[default: 1; 0.95 with --search].",
)
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
    help="Context length of a local engine (0: max-response-tokens + 1024; 4096 with --search).",
)
@click.option(
    "--search",
    "search_modes",
    metavar="MODES",
    default="",
    help=f"Measure test-time search instead of the agent loop: these modes ({', '.join(MODES)}; "
    "comma-separated) at each of --budgets, accuracy against generated tokens.",
)
@click.option(
    "--budgets",
    default="2,4,8",
    show_default=True,
    help="--search: budgets, comma-separated; b is b MCTS rollouts, b beams (B1) of "
    "--beam-samples steps, and for majority, best-of-n and ppm-vote b solutions topped up to "
    "the tokens the tree search (mcts, else beam) spent on the problem at b.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    help="--search: draw accuracy against generated tokens per problem into this PNG.",
)
@search_options
@local_services_options
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write every trajectory to this .jsonl file (with --search: every tree, one line per "
    "mode, budget and problem).",
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
    temperature: float | None,
    top_p: float | None,
    sampling_seed: int,
    tool_timeout: float,
    request_timeout: float,
    engine_url: str | None,
    sandbox: str | None,
    max_model_len: int,
    search_modes: str,
    budgets: str,
    plot: str | None,
    format_name: str,
    ppm: str | None,
    ppm_endpoint: str,
    ppm_device: str,
    children: int,
    beam_samples: int,
    max_depth: int,
    max_code_errors: int,
    exploration: float,
    top_k: int,
    max_step_tokens: int,
    concurrency: int,
    scheduler: str | None,
    scheduler_policy: str,
    no_affinity: bool,
    max_context: int,
    engine_python: str,
    device: str,
    sandbox_executors: int,
    sandbox_preload: str,
    log_dir: str,
    output: str | None,
    as_json: bool,
    no_progress: bool,
) -> None:
    """Evaluate a model on problems with the agent loop: accuracy, answered rate, tool
    calls and errors, response lengths. With --search: accuracy against generated tokens
    of test-time search and its baselines, per mode and budget."""
    from kubestar.training.datasets import load_problems

    modes = _search_modes(search_modes)
    _check_flags(modes)
    settings: SweepSettings | None = None
    if modes:
        from kubestar.search.adapters import StepSampling
        from kubestar.search.sweep import SweepSettings
        from kubestar.search.tree import SearchSettings

        _check_ppm(modes, ppm or "", ppm_endpoint)
        budget_list = _budgets(budgets)
        if not model:
            raise click.UsageError(
                "--search needs --model: the policy (with --scheduler, its tokenizer)"
            )
        try:
            settings = SweepSettings(
                modes=modes,
                budgets=budget_list,
                search=SearchSettings(
                    c=exploration,
                    children=children,
                    max_depth=max_depth,
                    max_code_errors=max_code_errors,
                    top_k=top_k,
                    beam_samples=beam_samples,
                ),
                sampling=StepSampling(
                    temperature=0.7 if temperature is None else temperature,
                    top_p=0.95 if top_p is None else top_p,
                    max_step_tokens=max_step_tokens,
                    seed=sampling_seed,
                ),
                concurrency=concurrency,
                max_context=max_context or (0 if scheduler else max_model_len or 4096),
                affinity=not no_affinity,
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--budgets") from exc

    if not modes and not engine_url and not model:
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
    if settings is not None:
        assert model_dir is not None
        _evaluate_search(
            settings=settings,
            problems=problems,
            problems_spec=problems_spec,
            model_dir=model_dir,
            format_name=format_name,
            ppm=ppm or "",
            ppm_endpoint=ppm_endpoint,
            ppm_device=ppm_device,
            tool_timeout=tool_timeout,
            scheduler=scheduler,
            sandbox=sandbox,
            scheduler_policy=scheduler_policy,
            max_model_len=max_model_len or 4096,
            device=device,
            engine_python=engine_python,
            sandbox_executors=sandbox_executors,
            sandbox_preload=sandbox_preload,
            log_dir=log_dir,
            plot=plot,
            output=output,
            as_json=as_json,
            progress=not no_progress,
        )
        return
    temperature = 0.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p

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


def _search_modes(text: str) -> tuple[str, ...]:
    """--search's modes, in the order given; () without --search."""
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    for mode in modes:
        if mode not in MODES:
            raise click.BadParameter(
                f"unknown mode {mode!r}; choose from {', '.join(MODES)}", param_hint="--search"
            )
    if len(set(modes)) != len(modes):
        raise click.BadParameter("give each mode once", param_hint="--search")
    if text and not modes:
        raise click.BadParameter("no mode given", param_hint="--search")
    return modes


def _budgets(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: give whole numbers separated by commas, e.g. 2,4,8", param_hint="--budgets"
        ) from None
    if not budgets or min(budgets) < 1 or len(set(budgets)) != len(budgets):
        raise click.BadParameter(
            f"{text!r}: give each budget once, each at least 1", param_hint="--budgets"
        )
    return budgets


def _flag(name: str) -> str:
    """The long flag of the parameter `name` of the running command."""
    command = click.get_current_context().command
    for param in command.params:
        if param.name == name:
            return max(param.opts, key=len)
    return "--" + name.replace("_", "-")


def _check_flags(modes: tuple[str, ...]) -> None:
    """Refuse, naming it, a flag given on the command line that changes nothing: an agent
    loop flag with --search, a search flag without it, or a flag no mode of --search uses."""
    context = click.get_current_context()

    def given(name: str) -> bool:
        return context.get_parameter_source(name) == ParameterSource.COMMANDLINE

    if not modes:
        for name in SEARCH_FLAGS:
            if given(name):
                raise click.BadParameter(
                    "it is for --search (the agent loop does not use it)", param_hint=_flag(name)
                )
        return
    for name in AGENT_LOOP_FLAGS:
        if given(name):
            raise click.BadParameter(
                "it is for the agent loop; --search does not use it", param_hint=_flag(name)
            )
    for name, users in SEARCH_FLAGS.items():
        if users is None or not given(name) or users.intersection(modes):
            continue
        raise click.BadParameter(
            f"no mode of --search uses it ({', '.join(modes)}); it is for "
            f"{', '.join(mode for mode in MODES if mode in users)}",
            param_hint=_flag(name),
        )


def _check_ppm(modes: tuple[str, ...], ppm: str, ppm_endpoint: str) -> None:
    """The PPM once, and there when a mode needs it; each mistake names its flag."""
    if ppm and ppm_endpoint:
        raise click.BadParameter(
            "give the PPM once: a folder (--ppm) or a running service (--ppm-endpoint)",
            param_hint="--ppm",
        )
    scored = [mode for mode in modes if mode in SCORED_MODES]
    if scored and not (ppm or ppm_endpoint):
        raise click.BadParameter(
            f"{', '.join(scored)} {'needs' if len(scored) == 1 else 'need'} a process "
            "preference model: give --ppm FOLDER or --ppm-endpoint HOST:PORT",
            param_hint="--ppm",
        )


def _evaluate_search(
    *,
    settings: SweepSettings,
    problems: list[Problem],
    problems_spec: str,
    model_dir: Path,
    format_name: str,
    ppm: str,
    ppm_endpoint: str,
    ppm_device: str,
    tool_timeout: float,
    scheduler: str | None,
    sandbox: str | None,
    scheduler_policy: str,
    max_model_len: int,
    device: str,
    engine_python: str,
    sandbox_executors: int,
    sandbox_preload: str,
    log_dir: str,
    plot: str | None,
    output: str | None,
    as_json: bool,
    progress: bool,
) -> None:
    """--search: the sweep on the services (started as `kubestar solve` starts them), then
    the table, the PNG and the trees."""
    from kubestar.engine.models import tokenizer_sha256
    from kubestar.search.sweep import format_table, plot_sweep
    from kubestar.training.chat import ChatTokenizer

    tokenizer = ChatTokenizer.from_model(model_dir)
    source = PpmSource(ppm, ppm_endpoint, ppm_device, tokenizer_sha256(model_dir))
    with search_services(
        model_dir=model_dir,
        scheduler=scheduler,
        sandbox=sandbox,
        scheduler_policy=scheduler_policy,
        max_model_len=max_model_len,
        device=device,
        engine_python=engine_python,
        sandbox_executors=sandbox_executors,
        sandbox_preload=sandbox_preload,
        log_dir=log_dir,
        progress=progress,
        command="eval",
    ) as services:
        points = asyncio.run(
            run_search_sweep(
                problems=problems,
                settings=settings,
                scheduler=services.scheduler,
                sandbox=services.sandbox,
                encode=tokenizer.encode,
                format_name=format_name,
                ppm=source,
                tool_timeout=tool_timeout,
                progress=progress,
            )
        )
    drawn = False
    if plot:
        title = f"{problems_spec} ({len(problems)} problems): accuracy against generated tokens"
        try:
            drawn = plot_sweep(points, plot, title=title)
        except ImportError as exc:
            raise click.ClickException(
                f"--plot needs matplotlib (pip install 'kubestar[training]'): {exc}"
            ) from exc
    if output:
        write_sweep_trees(output, points)
    if as_json:
        figures: dict[str, Any] = {
            "model": str(model_dir),
            "problems_source": problems_spec,
            "problems": len(problems),
            "points": [point.figures() for point in points],
        }
        if drawn:
            figures["plot"] = plot
        if output:
            figures["output"] = output
        click.echo(json.dumps(figures, indent=2))
        return
    click.echo(f"{problems_spec}: {len(problems)} problems, 95% bootstrap intervals over them")
    click.echo(format_table(points))
    if drawn:
        click.echo(f"plot: {plot}")


async def run_search_sweep(
    *,
    problems: list[Problem],
    settings: SweepSettings,
    scheduler: str,
    sandbox: str,
    encode: Encode,
    format_name: str,
    ppm: PpmSource,
    tool_timeout: float,
    progress: bool,
) -> list[SweepPoint]:
    """The sweep against running services, with a progress bar over every problem of every
    point (the point running, its accuracy and tokens per problem so far)."""
    from kubestar.search.solve import Solved
    from kubestar.search.sweep import sweep
    from tqdm import tqdm

    bar = tqdm(
        total=len(settings.points()) * len(problems),
        unit="problem",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    # A tally per point: the rollout budgets of one MCTS search end together, problem by
    # problem, so their outcomes come interleaved.
    tallies: dict[tuple[str, int], SolvedTally] = {}

    def done(mode: str, budget: int, solved: Solved) -> None:
        tally = tallies.get((mode, budget))
        if tally is None:
            tally = tallies[(mode, budget)] = SolvedTally(bar)
        bar.set_description(f"{mode} {budget}" if budget else mode, refresh=False)
        tally(solved)

    try:
        async with solver_stack(
            scheduler=scheduler,
            sandbox=sandbox,
            encode=encode,
            format_name=format_name,
            ppm=ppm,
            tool_timeout=tool_timeout,
        ) as stack:
            return await sweep(problems, settings, stack, on_done=done)
    finally:
        bar.close()


def write_sweep_trees(path: str | Path, points: list[SweepPoint]) -> Path:
    """One JSON line per point and problem: `kubestar solve --output`'s record with the
    point's `budget`."""
    target = Path(path)
    with target.open("w") as out:
        for point in points:
            for solved in point.solved:
                out.write(json.dumps({**solved.record(), "budget": point.budget}) + "\n")
    return target
