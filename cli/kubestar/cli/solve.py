"""`kubestar solve`: solve a problem set by test-time search (rStar-Math's MCTS or beam
search, guided by a process preference model) or by a baseline at the same generated-token
budget (greedy, majority vote, best-of-N by the PPM, a vote weighted by the PPM), on the
rollout scheduler and the sandbox.

Problems come from a .jsonl file (`question`, `answer`) or a reasoning-gym generator, as in
`kubestar eval`. With --scheduler and --sandbox it uses running services; without them it
starts a vLLM engine on --model with a scheduler in front (the search's n-sample requests
and tree affinity are the scheduler's) and a sandbox server, as local processes on
127.0.0.1, and stops them (by PID) when it is done. The PPM is a folder served in this
process (--ppm) or a running scoring service (--ppm-endpoint). It prints accuracy and the
tokens generated per problem, and writes every tree as one JSON line per problem
(--output).

The flags become one `kubestar.search.entrypoints.SolveConfig`, which
`kubestar.search.entrypoints.solve` runs; the search flags, shared with `kubestar eval
--search` and `kubestar evolve`, are declared here (`search_options`) and read into a
`SearchConfig` (`search_config`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource
from kubestar.cli.options import library_errors, local_service_settings, local_services_options
from kubestar.search.solve import (
    BEAM,
    BEST_OF_N,
    MAJORITY,
    MCTS_MODE,
    MODES,
    PPM_VOTE,
    SCORED_MODES,
)
from kubestar.search.steps import FORMATS

if TYPE_CHECKING:
    from kubestar.search.entrypoints import SearchConfig

F = TypeVar("F", bound=Callable[..., Any])
# The search flags whose parameter is not named as their SearchConfig field.
SEARCH_FIELDS = {"format_name": "step_format"}


def search_config(**changes: Any) -> SearchConfig:
    """The running command's search flags (`search_step_options`, `step_sampling_options`,
    `search_options`: those it has) as the library's SearchConfig; `changes` override."""
    from kubestar.search.entrypoints import SearchConfig

    params = click.get_current_context().params
    values = {SEARCH_FIELDS.get(name, name): value for name, value in params.items()}
    if "no_affinity" in params:
        values["affinity"] = not params["no_affinity"]
    values["ppm"] = values.get("ppm") or ""
    names = {field.name for field in fields(SearchConfig)}
    given = {name: value for name, value in values.items() if name in names}
    return SearchConfig(**{**given, **changes})


# The budget flags and the modes that spend them; another mode refuses them when given.
MODE_FLAGS: dict[str, frozenset[str]] = {
    "rollouts": frozenset({MCTS_MODE}),
    "children": frozenset({MCTS_MODE}),
    "exploration": frozenset({MCTS_MODE}),
    "beams": frozenset({BEAM}),
    "beam_samples": frozenset({BEAM}),
    "top_k": frozenset({MCTS_MODE, BEAM}),
    "samples": frozenset({MAJORITY, BEST_OF_N, PPM_VOTE}),
    "token_budget": frozenset({MAJORITY, BEST_OF_N, PPM_VOTE}),
}


def _check_mode_flags(mode: str) -> None:
    """A budget flag given on the command line that `mode` does not spend is a mistake (it
    would change nothing): refuse it, naming it."""
    context = click.get_current_context()
    for name, modes in MODE_FLAGS.items():
        if mode in modes or context.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        flag = "--" + name.replace("_", "-")
        raise click.BadParameter(
            f"{mode} does not use it; it is for {', '.join(sorted(modes))}", param_hint=flag
        )


def _check_values(mode: str, ppm: str, ppm_endpoint: str, ground_truth: bool) -> None:
    """Which modes take which values; every mistake names its flag."""
    if ppm and ppm_endpoint:
        raise click.BadParameter(
            "give the PPM once: a folder (--ppm) or a running service (--ppm-endpoint)",
            param_hint="--ppm",
        )
    if ground_truth and mode != MCTS_MODE:
        raise click.BadParameter(
            f"ground-truth values are for mcts (to make training data), not {mode}",
            param_hint="--ground-truth",
        )
    if ground_truth and (ppm or ppm_endpoint):
        raise click.BadParameter(
            "mcts takes its values from the PPM or from the reference answers, not both",
            param_hint="--ground-truth",
        )
    if mode in SCORED_MODES and not (ppm or ppm_endpoint or ground_truth):
        extra = (
            " (or --ground-truth to value answers by the reference)" if mode == MCTS_MODE else ""
        )
        raise click.BadParameter(
            f"{mode} needs a process preference model: give --ppm FOLDER or --ppm-endpoint "
            f"HOST:PORT{extra}",
            param_hint="--ppm",
        )


def search_step_options(function: F) -> F:
    """The options of every command that grows search trees (`kubestar solve`, `kubestar
    eval --search`, `kubestar evolve`): the step format, the tree's shape and terminal rules,
    the step length, how many problems at once, and the local scheduler's policy."""
    options = [
        click.option(
            "--format",
            "format_name",
            type=click.Choice(FORMATS),
            default="tool-call",
            show_default=True,
            help="Steps as `<tool_call>` turns (policies trained by the agent loop) or in "
            "rStar's format (`<code>`, `<end_of_step>`).",
        ),
        click.option(
            "--children",
            type=click.IntRange(min=1),
            default=16,
            show_default=True,
            help="mcts: steps sampled per expansion (one request of n samples).",
        ),
        click.option("--max-depth", type=click.IntRange(min=1), default=16, show_default=True),
        click.option(
            "--max-code-errors",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Failed code steps in a row that end a branch.",
        ),
        click.option(
            "--exploration",
            type=click.FloatRange(min=0),
            default=2.0,
            show_default=True,
            help="c of the MCTS selection score Q + c * sqrt(ln N_parent / N).",
        ),
        click.option(
            "--max-step-tokens", type=click.IntRange(min=1), default=512, show_default=True
        ),
        click.option(
            "--concurrency",
            type=click.IntRange(min=1),
            default=4,
            show_default=True,
            help="Problems searched at once.",
        ),
        click.option(
            "--scheduler-policy",
            type=click.Choice(["kv-aware", "least-requests", "round-robin"]),
            default="kv-aware",
            show_default=True,
            help="Policy of the local scheduler.",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def step_sampling_options(function: F) -> F:
    """How `kubestar solve` and `kubestar evolve` sample steps and run their code."""
    options = [
        click.option("--temperature", type=click.FloatRange(min=0), default=0.7, show_default=True),
        click.option(
            "--top-p", type=click.FloatRange(min=0, max=1), default=0.95, show_default=True
        ),
        click.option("--sampling-seed", default=0, help="Seed of sampling (0: unseeded)."),
        click.option(
            "--tool-timeout", default=10.0, show_default=True, help="Seconds per program."
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def search_options(function: F) -> F:
    """The options of every command that searches with a PPM and may use a running scheduler
    (`kubestar solve`, `kubestar eval --search`): `search_step_options`, the PPM, beam
    search's B2, the vote, and the scheduler (running or local)."""
    options = [
        click.option("--ppm", type=click.Path(exists=True, file_okay=False), help="A PPM folder."),
        click.option("--ppm-endpoint", default="", metavar="HOST:PORT", help="A scoring service."),
        click.option("--ppm-device", default="auto", show_default=True, help="Device of --ppm."),
        click.option(
            "--beam-samples",
            type=click.IntRange(min=1),
            default=8,
            show_default=True,
            help="B2: steps sampled per beam.",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=1),
            default=4,
            show_default=True,
            help="mcts, beam: the answer is voted over this many top-scored answers.",
        ),
        click.option("--scheduler", "scheduler", metavar="HOST:PORT", help="A running scheduler."),
        click.option(
            "--no-affinity",
            is_flag=True,
            help="Send each request of a tree under its own affinity key, not the tree's (to "
            "measure the prefill that affinity saves).",
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=0),
            default=0,
            help="The engines' context length (default: a local engine's; with --scheduler "
            "unknown: a path that outgrows it is refused by the scheduler).",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return search_step_options(function)


@click.command("solve")
@click.option("--mode", type=click.Choice(MODES), required=True, help="Search or baseline.")
@click.option(
    "--problems",
    "problems_spec",
    required=True,
    help="A .jsonl file of problems (question, answer), or a reasoning-gym dataset name.",
)
@click.option("-n", "--limit", type=click.IntRange(min=1), default=None, help="First N only.")
@click.option("--seed", default=0, show_default=True, help="Seed of generated problems.")
@click.option(
    "--model",
    default="SmolLM2-135M-Instruct",
    show_default=True,
    help="The policy: a model folder or a name kubestar resolves; served by a local engine, "
    "or, with --scheduler, only its tokenizer is used (it must be the fleet's).",
)
@search_options
@click.option(
    "--ground-truth",
    is_flag=True,
    help="mcts: value answers by the reference answers (to make training data).",
)
@click.option("--rollouts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--beams", type=click.IntRange(min=1), default=8, show_default=True, help="B1.")
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="majority, best-of-n, ppm-vote: solutions sampled per problem (the first wave with "
    "--token-budget).",
)
@click.option(
    "--token-budget",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="majority, best-of-n, ppm-vote: draw waves of up to --samples solutions until this "
    "many tokens were generated for the problem (0: one wave).",
)
@step_sampling_options
@click.option("--sandbox", metavar="HOST:PORT", help="A running sandbox (gRPC).")
@click.option(
    "--max-model-len",
    type=click.IntRange(min=256),
    default=4096,
    show_default=True,
    help="Context length of a local engine.",
)
@local_services_options
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the trees here: one JSON line per problem.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def solve(
    mode: str,
    problems_spec: str,
    limit: int | None,
    seed: int,
    model: str,
    format_name: str,
    ppm: str | None,
    ppm_endpoint: str,
    ppm_device: str,
    ground_truth: bool,
    rollouts: int,
    children: int,
    beams: int,
    beam_samples: int,
    samples: int,
    token_budget: int,
    max_depth: int,
    max_code_errors: int,
    exploration: float,
    top_k: int,
    temperature: float,
    top_p: float,
    max_step_tokens: int,
    sampling_seed: int,
    tool_timeout: float,
    concurrency: int,
    scheduler: str | None,
    scheduler_policy: str,
    no_affinity: bool,
    sandbox: str | None,
    max_context: int,
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
    """Solve problems by search (mcts, beam) or a baseline (greedy, majority, best-of-n,
    ppm-vote): accuracy, tokens generated per problem, and the trees as JSONL."""
    _check_mode_flags(mode)
    _check_values(mode, ppm or "", ppm_endpoint, ground_truth)
    from kubestar.search.entrypoints import SolveConfig
    from kubestar.search.entrypoints import solve as run

    config = SolveConfig(
        mode=mode,
        problems=problems_spec,
        limit=limit,
        seed=seed,
        model=model,
        search=search_config(),
        ground_truth=ground_truth,
        rollouts=rollouts,
        beams=beams,
        samples=samples,
        token_budget=token_budget,
        scheduler=scheduler or "",
        sandbox=sandbox or "",
        services=local_service_settings(),
        output=output or "",
        progress=not no_progress,
    )
    with library_errors(lambda setting: f"--{setting}"):
        outcome = run(config)
    if as_json:
        click.echo(json.dumps(outcome.figures(), indent=2))
    else:
        click.echo(outcome.text())
