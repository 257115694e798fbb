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

The flags become one settings object the library runs: `kubestar.training.entrypoints.
AgentEvalConfig` (`evaluate`), or with --search `kubestar.search.entrypoints.
SearchEvalConfig` (`evaluate_search`).
"""

from __future__ import annotations

import json

import click
from click.core import ParameterSource
from kubestar.cli.options import library_errors, local_service_settings, local_services_options
from kubestar.cli.solve import search_config, search_options
from kubestar.search.solve import BEAM, GREEDY, MCTS_MODE, MODES, SCORED_MODES

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
    modes = _search_modes(search_modes)
    _check_flags(modes)
    if modes:
        _check_ppm(modes, ppm or "", ppm_endpoint)
        budget_list = _budgets(budgets)
        if not model:
            raise click.UsageError(
                "--search needs --model: the policy (with --scheduler, its tokenizer)"
            )
        from kubestar.search.entrypoints import SearchEvalConfig, evaluate_search

        try:
            sweep = SearchEvalConfig(
                modes=modes,
                problems=problems_spec,
                model=model,
                budgets=budget_list,
                limit=limit,
                seed=seed,
                search=search_config(
                    temperature=0.7 if temperature is None else temperature,
                    top_p=0.95 if top_p is None else top_p,
                ),
                scheduler=scheduler or "",
                sandbox=sandbox or "",
                services=local_service_settings(max_model_len=max_model_len or 4096),
                plot=plot or "",
                output=output or "",
                progress=not no_progress,
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--budgets") from exc
        with library_errors():
            outcome = evaluate_search(sweep)
        click.echo(json.dumps(outcome.figures(), indent=2) if as_json else outcome.text())
        return
    if not engine_url and not model:
        raise click.UsageError("give --model PATH (a local engine is started) or --engine URL")
    from kubestar.training.entrypoints import AgentEvalConfig
    from kubestar.training.entrypoints import evaluate as run
    from kubestar.training.evaluation import TokenizerNotFound, format_eval

    config = AgentEvalConfig(
        problems=problems_spec,
        model=model,
        limit=limit,
        seed=seed,
        samples=samples,
        max_turns=max_turns,
        max_response_tokens=max_response_tokens,
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        sampling_seed=sampling_seed,
        tool_timeout=tool_timeout,
        request_timeout=request_timeout,
        engine=engine_url or "",
        sandbox=sandbox or "",
        services=local_service_settings(max_model_len=max_model_len or max_response_tokens + 1024),
        output=output or "",
        progress=not no_progress,
    )
    try:
        with library_errors():
            metrics = run(config)
    except TokenizerNotFound as exc:
        raise click.UsageError(str(exc)) from exc
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
