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
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource
from kubestar.cli.options import local_services_options
from kubestar.search.scorer import PpmSource, ppm_scorer
from kubestar.search.solve import (
    BEAM,
    BEST_OF_N,
    MAJORITY,
    MCTS_MODE,
    MODES,
    PPM_VOTE,
    SCORED_MODES,
)

if TYPE_CHECKING:
    from kubestar.search.ppm_data import Encode
    from kubestar.search.solve import Solved, SolverStack, SolveSettings
    from kubestar.search.steps import StepFormat
    from kubestar.training.datasets import Problem

FORMATS = ("tool-call", "rstar")
F = TypeVar("F", bound=Callable[..., Any])


def step_format(name: str) -> StepFormat:
    """The step format by its command-line name."""
    from kubestar.search.steps import RStarFormat, ToolCallFormat

    return RStarFormat() if name == "rstar" else ToolCallFormat()


@asynccontextmanager
async def solver_stack(
    *,
    scheduler: str,
    sandbox: str,
    encode: Encode,
    format_name: str,
    ppm: PpmSource,
    tool_timeout: float,
) -> AsyncIterator[SolverStack]:
    """Clients of the running scheduler and sandbox, the judge and the PPM, as the stack
    every Solver of a command shares; closed when the block ends."""
    from kubestar.common.net import check_grpc_serving
    from kubestar.sandbox.client import SandboxClient
    from kubestar.scheduler.client import SchedulerClient
    from kubestar.search.adapters import SandboxExecutor
    from kubestar.search.solve import SolverStack
    from kubestar.training.rewards import RewardScorer

    await check_grpc_serving(scheduler, "--scheduler")
    await check_grpc_serving(sandbox, "--sandbox")
    judge = RewardScorer(workers=2)
    sandbox_client = SandboxClient(sandbox, timeout=max(60.0, 10 * tool_timeout))
    try:
        async with (
            SchedulerClient(scheduler, timeout=900.0) as scheduler_client,
            ppm_scorer(ppm, encode) as scorer,
        ):
            yield SolverStack(
                scheduler_client,
                SandboxExecutor(sandbox_client, timeout_seconds=tool_timeout),
                step_format(format_name),
                encode,
                judge.score,
                scorer,
            )
    finally:
        judge.close()
        await sandbox_client.aclose()
        sandbox_client.close()


class SolvedTally:
    """A progress bar's postfix over the problems solved so far: accuracy and generated
    tokens per problem (`reset` starts a new count, e.g. for a sweep's next point)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.reset()

    def reset(self) -> None:
        self.done = self.correct = self.tokens = 0

    def __call__(self, solved: Solved) -> None:
        self.done += 1
        self.correct += solved.correct
        self.tokens += solved.generated_tokens
        self.bar.set_postfix(
            acc=f"{self.correct / self.done:.3f}",
            tok=f"{self.tokens / self.done:.0f}",
            refresh=False,
        )
        self.bar.update(1)


async def run_solve(
    *,
    problems: list[Problem],
    settings: SolveSettings,
    scheduler: str,
    sandbox: str,
    encode: Encode,
    format_name: str,
    ppm: PpmSource,
    tool_timeout: float,
    progress: bool,
    on_done: Callable[[Solved], None] | None = None,
) -> list[Solved]:
    """Solve every problem against the services (see the module docstring); `on_done`
    receives each outcome as soon as it is found."""
    from tqdm import tqdm

    bar = tqdm(
        total=len(problems),
        unit="problem",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    tally = SolvedTally(bar)

    def done(solved: Solved) -> None:
        tally(solved)
        if on_done is not None:
            on_done(solved)

    try:
        async with solver_stack(
            scheduler=scheduler,
            sandbox=sandbox,
            encode=encode,
            format_name=format_name,
            ppm=ppm,
            tool_timeout=tool_timeout,
        ) as stack:
            return await stack.solver(settings).solve_all(problems, on_done=done)
    finally:
        bar.close()


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


@dataclass(frozen=True)
class SearchServices:
    """Where a search's services are: the scheduler and the sandbox, and the URLs of the
    engines the command started (none when it was given a running scheduler)."""

    scheduler: str
    sandbox: str
    engine_urls: tuple[str, ...] = ()


@contextmanager
def search_services(
    *,
    model_dir: Path,
    scheduler: str | None,
    sandbox: str | None,
    scheduler_policy: str,
    max_model_len: int,
    device: str,
    engine_python: str,
    sandbox_executors: int,
    sandbox_preload: str,
    log_dir: str,
    progress: bool,
    engines: int = 1,
    command: str = "solve",
) -> Iterator[SearchServices]:
    """The services given, and the others started as local processes on 127.0.0.1 for as
    long as the block runs: without a scheduler, `engines` vLLM engines on `model_dir` (on a
    GPU they share it, each taking its part of the memory) with a scheduler in front;
    without a sandbox, a sandbox server. A service that does not come up is a
    ClickException ending with its log."""
    from kubestar.common.net import free_port
    from kubestar.engine.launch import EngineSettings
    from kubestar.training.local import LocalSandbox, LocalScheduler, LocalStack, ServiceFailed

    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"kubestar-{command}-"))
    local_engines = []
    if not scheduler:
        local_engines = [
            EngineSettings(
                model=str(model_dir),
                port=free_port(),
                max_model_len=max_model_len,
                device=device,
                python=engine_python,
                gpu_memory_utilization=round(0.9 / engines, 2),
            )
            for _ in range(engines)
        ]
    local_sandbox = None
    if not sandbox:
        preload = tuple(name for name in sandbox_preload.split(",") if name)
        local_sandbox = LocalSandbox(sandbox_executors, preload, log_level="warning")
    stack = LocalStack(
        logs,
        sandbox=local_sandbox,
        engines=local_engines,
        scheduler=LocalScheduler(scheduler_policy, poll_interval=0.2, segment_tokens=256)
        if local_engines
        else None,
        engine_timeout=900.0,
        sandbox_timeout=300.0,
    )
    if progress and (local_engines or local_sandbox):
        click.echo(f"starting local services (logs in {logs})", err=True)
    try:
        try:
            started = stack.start()
        except ServiceFailed as exc:
            raise click.ClickException(str(exc)) from exc
        yield SearchServices(
            scheduler=scheduler or started.scheduler,
            sandbox=sandbox or started.sandbox,
            engine_urls=tuple(engine.url for engine in stack.engines),
        )
    finally:
        stack.stop()


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
    from kubestar.engine.models import resolve_model, tokenizer_sha256
    from kubestar.search.adapters import StepSampling
    from kubestar.search.solve import SolveSettings, format_summary, summary, write_trees
    from kubestar.search.tree import SearchSettings
    from kubestar.training.chat import ChatTokenizer
    from kubestar.training.datasets import load_problems

    try:
        model_dir = resolve_model(model)
    except (FileNotFoundError, RuntimeError, ImportError) as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc
    try:
        problems = load_problems(problems_spec, limit=limit, seed=seed)
    except (ValueError, FileNotFoundError) as exc:
        raise click.BadParameter(str(exc), param_hint="--problems") from exc
    if not problems:
        raise click.BadParameter(f"{problems_spec}: no problems", param_hint="--problems")
    settings = SolveSettings(
        mode=mode,
        search=SearchSettings(
            c=exploration,
            children=children,
            rollouts=rollouts,
            max_depth=max_depth,
            max_code_errors=max_code_errors,
            top_k=top_k,
            beam_width=beams,
            beam_samples=beam_samples,
        ),
        sampling=StepSampling(
            temperature=temperature,
            top_p=top_p,
            max_step_tokens=max_step_tokens,
            seed=sampling_seed,
        ),
        samples=samples,
        token_budget=token_budget,
        ground_truth=ground_truth,
        concurrency=concurrency,
        max_context=max_context or (0 if scheduler else max_model_len),
        affinity=not no_affinity,
    )
    tokenizer = ChatTokenizer.from_model(model_dir)
    source = PpmSource(ppm or "", ppm_endpoint, ppm_device, tokenizer_sha256(model_dir))

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
        progress=not no_progress,
    ) as services:
        solved = asyncio.run(
            run_solve(
                problems=problems,
                settings=settings,
                scheduler=services.scheduler,
                sandbox=services.sandbox,
                encode=tokenizer.encode,
                format_name=format_name,
                ppm=source,
                tool_timeout=tool_timeout,
                progress=not no_progress,
            )
        )
    figures: dict[str, Any] = {"mode": mode, **summary(solved)}
    if output:
        write_trees(output, solved)
        figures["output"] = output
    if as_json:
        click.echo(json.dumps(figures, indent=2))
    else:
        click.echo(format_summary(mode, figures))
