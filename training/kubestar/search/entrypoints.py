"""What `kubestar solve`, `kubestar eval --search` and `kubestar evolve` run, and what
bench/search_bench.py runs with them.

Each command takes one settings object (in the manner of vLLM's EngineArgs): the CLI builds it
from its flags, a benchmark builds the same object, and the function here does the rest.

* `SearchConfig`: what every command that grows search trees shares (the step format, the
  tree's shape, how steps are sampled and their code run, the PPM), turned into the tree's
  `SearchSettings`, the `StepSampling` and the `PpmSource` in one place.
* `SolveConfig` -> `solve`: `kubestar solve`.
* `SearchEvalConfig` -> `evaluate_search`: `kubestar eval --search`.
* `EvolveConfig` -> `evolve`: `kubestar evolve`, each policy served by `LocalSearchServices`.
* `PpmTrainConfig` -> `train_ppm`: `kubestar ppm train` (no services: the pairs to a PPM
  folder, `kubestar.search.ppm.train_ppm_folder`).

The services of a search (`search_services`): the scheduler and the sandbox given, the others
started as local processes on 127.0.0.1 (`LocalStack.for_command`: without a scheduler, vLLM
engines on the policy with a scheduler in front; without a sandbox, a sandbox server) and
stopped (by PID) when the search is done. A service that does not come up raises
`ServiceFailed`, whose message ends with its log. A setting that cannot work raises
`SettingError`, naming it.

Progress (bars, the services starting) goes to stderr; what the commands print is the
caller's (`SolveOutcome`, `SearchEvalOutcome`, the round's manifest).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubestar.api.errors import KubestarError, SettingError
from kubestar.search.adapters import StepSampling
from kubestar.search.scorer import PpmSource, ppm_scorer
from kubestar.search.solve import Solved, SolverStack, SolveSettings
from kubestar.search.steps import step_format
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem
from kubestar.training.entrypoints import problem_set, resolve_policy
from kubestar.training.local import LocalServiceSettings, LocalStack

if TYPE_CHECKING:
    from kubestar.search.evolve import RoundSettings, SolveFunction
    from kubestar.search.ppm import PpmTrainSettings
    from kubestar.search.ppm_data import Encode
    from kubestar.search.sweep import SweepPoint, SweepSettings


class PlotUnavailable(KubestarError, ImportError):
    """A plot was asked for and matplotlib is not installed."""


@dataclass(frozen=True)
class SearchConfig:
    """What every command that grows search trees shares (`kubestar solve`, `kubestar eval
    --search`, `kubestar evolve`, bench/search_bench.py); each field is the flag of the same
    name. Defaults are rStar-Math's."""

    step_format: str = "tool-call"  # --format: `<tool_call>` turns, or rStar's `<code>` steps
    children: int = 16  # mcts: steps sampled per expansion (one request of n samples)
    max_depth: int = 16  # a non-answer step deeper than this ends its branch
    max_code_errors: int = 1  # failed code steps in a row that end a branch
    exploration: float = 2.0  # c of the MCTS selection score Q + c * sqrt(ln N_parent / N)
    top_k: int = 4  # mcts, beam: the answer is voted over this many top-scored answers
    beam_samples: int = 8  # beam: B2, steps sampled per beam
    temperature: float = 0.7  # of step sampling (0: greedy)
    top_p: float = 0.95
    max_step_tokens: int = 512  # new tokens of one step at the most
    sampling_seed: int = 0  # seed of sampling (0: unseeded)
    tool_timeout: float = 10.0  # seconds per program
    concurrency: int = 4  # problems searched at once
    affinity: bool = True  # a tree's requests share its affinity key (--no-affinity: not)
    # The engines' context length (0: a local engine's; with a running scheduler unknown).
    max_context: int = 0
    ppm: str = ""  # a PPM folder, served in this process
    ppm_endpoint: str = ""  # or a running scoring service (HOST:PORT)
    ppm_device: str = "auto"  # device of `ppm`

    def tree(self, **budgets: int) -> SearchSettings:
        """The tree's settings; `budgets`: rollouts, beam_width, sft_traces, ..."""
        return SearchSettings(
            c=self.exploration,
            children=self.children,
            max_depth=self.max_depth,
            max_code_errors=self.max_code_errors,
            top_k=self.top_k,
            beam_samples=self.beam_samples,
            **budgets,
        )

    def sampling(self) -> StepSampling:
        """How steps are sampled."""
        return StepSampling(
            temperature=self.temperature,
            top_p=self.top_p,
            max_step_tokens=self.max_step_tokens,
            seed=self.sampling_seed,
        )

    def context(self, scheduler: str, max_model_len: int) -> int:
        """The engines' context length: `max_context`, else a local engine's; 0 (unknown)
        with a running scheduler."""
        return self.max_context or (0 if scheduler else max_model_len)

    def solver_fields(self, scheduler: str, max_model_len: int) -> dict[str, Any]:
        """What SolveSettings and SweepSettings take alike: the sampling, the problems at
        once, the engines' context (`context`) and the affinity."""
        return {
            "sampling": self.sampling(),
            "concurrency": self.concurrency,
            "max_context": self.context(scheduler, max_model_len),
            "affinity": self.affinity,
        }

    def ppm_source(self, model_dir: Path) -> PpmSource:
        """Where the PPM is, for the policy of `model_dir` (the PPM must read its ids)."""
        from kubestar.engine.models import tokenizer_sha256

        return PpmSource(self.ppm, self.ppm_endpoint, self.ppm_device, tokenizer_sha256(model_dir))


@dataclass(frozen=True)
class SearchServices:
    """Where a search's services are: the scheduler and the sandbox, and the URLs of the
    engines started for it (none when it was given a running scheduler)."""

    scheduler: str
    sandbox: str
    engine_urls: tuple[str, ...] = ()

    def endpoints(self, encode: Encode, search: SearchConfig, ppm: PpmSource) -> SolverEndpoints:
        """What the Solvers of a search on these services open (`solver_stack`)."""
        return SolverEndpoints(
            self.scheduler, self.sandbox, encode, search.step_format, ppm, search.tool_timeout
        )


@contextmanager
def search_services(
    model_dir: Path,
    services: LocalServiceSettings,
    *,
    scheduler: str = "",
    sandbox: str = "",
    command: str = "solve",
    progress: bool = True,
) -> Iterator[SearchServices]:
    """The services given, and the others started as local processes for as long as the
    block runs (see the module docstring); raises ServiceFailed for one that does not come
    up."""
    stack = LocalStack.for_command(
        services, model_dir, command=command, engines=not scheduler, sandbox=not sandbox
    )
    if progress and (stack.engine_settings or stack.sandbox):
        print(f"starting local services (logs in {stack.log_dir})", file=sys.stderr, flush=True)
    with stack.running() as started:
        yield SearchServices(
            scheduler=scheduler or started.scheduler,
            sandbox=sandbox or started.sandbox,
            engine_urls=tuple(engine.url for engine in stack.engines),
        )


@dataclass(frozen=True)
class SolverEndpoints:
    """What `solver_stack` opens: the running scheduler and sandbox, the policy's tokenizer,
    the step format, the PPM and the programs' timeout."""

    scheduler: str  # HOST:PORT
    sandbox: str  # HOST:PORT
    encode: Encode
    format_name: str = "tool-call"
    ppm: PpmSource = field(default_factory=PpmSource)
    tool_timeout: float = 10.0  # seconds per program


@asynccontextmanager
async def solver_stack(where: SolverEndpoints) -> AsyncIterator[SolverStack]:
    """Clients of the running scheduler and sandbox, the judge and the PPM, as the stack
    every Solver of a command shares; closed when the block ends."""
    from kubestar.common.net import check_grpc_serving
    from kubestar.sandbox.client import SandboxClient
    from kubestar.scheduler.client import SchedulerClient
    from kubestar.search.adapters import SandboxExecutor
    from kubestar.training.rewards import RewardScorer

    await check_grpc_serving(where.scheduler, "--scheduler")
    await check_grpc_serving(where.sandbox, "--sandbox")
    judge = RewardScorer(workers=2)
    sandbox_client = SandboxClient(where.sandbox, timeout=max(60.0, 10 * where.tool_timeout))
    try:
        async with (
            SchedulerClient(where.scheduler, timeout=900.0) as scheduler_client,
            ppm_scorer(where.ppm, where.encode) as scorer,
        ):
            yield SolverStack(
                scheduler_client,
                SandboxExecutor(sandbox_client, timeout_seconds=where.tool_timeout),
                step_format(where.format_name),
                where.encode,
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


@asynccontextmanager
async def _stack_with_bar(
    where: SolverEndpoints, total: int, progress: bool
) -> AsyncIterator[tuple[SolverStack, Any]]:
    """`solver_stack` and a progress bar over `total` problems on stderr."""
    from tqdm import tqdm

    bar = tqdm(
        total=total, unit="problem", disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    try:
        async with solver_stack(where) as stack:
            yield stack, bar
    finally:
        bar.close()


async def run_solve(
    problems: list[Problem],
    settings: SolveSettings,
    where: SolverEndpoints,
    *,
    progress: bool,
    on_done: Callable[[Solved], None] | None = None,
) -> list[Solved]:
    """Solve every problem against running services, with a progress bar; `on_done`
    receives each outcome as soon as it is found."""
    async with _stack_with_bar(where, len(problems), progress) as (stack, bar):
        tally = SolvedTally(bar)

        def done(solved: Solved) -> None:
            tally(solved)
            if on_done is not None:
                on_done(solved)

        return await stack.solver(settings).solve_all(problems, on_done=done)


async def run_search_sweep(
    problems: list[Problem], settings: SweepSettings, where: SolverEndpoints, *, progress: bool
) -> list[SweepPoint]:
    """The sweep against running services, with a progress bar over every problem of every
    point (the point running, its accuracy and tokens per problem so far)."""
    from kubestar.search.sweep import sweep

    total = len(settings.points()) * len(problems)
    async with _stack_with_bar(where, total, progress) as (stack, bar):
        # A tally per point: the rollout budgets of one MCTS search end together, problem
        # by problem, so their outcomes come interleaved.
        tallies: dict[tuple[str, int], SolvedTally] = {}

        def done(mode: str, budget: int, solved: Solved) -> None:
            tally = tallies.get((mode, budget))
            if tally is None:
                tally = tallies[(mode, budget)] = SolvedTally(bar)
            bar.set_description(f"{mode} {budget}" if budget else mode, refresh=False)
            tally(solved)

        return await sweep(problems, settings, stack, on_done=done)


def write_sweep_trees(path: str | Path, points: list[SweepPoint]) -> Path:
    """One JSON line per point and problem: `kubestar solve --output`'s record with the
    point's `budget`."""
    target = Path(path)
    with target.open("w") as out:
        for point in points:
            for solved in point.solved:
                out.write(json.dumps({**solved.record(), "budget": point.budget}) + "\n")
    return target


# -- kubestar solve ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SolveConfig:
    """`kubestar solve`: solve a problem set by search (mcts, beam) or a baseline (greedy,
    majority, best-of-n, ppm-vote) at the same generated-token budget."""

    mode: str  # one of kubestar.search.solve.MODES
    problems: str  # a .jsonl file of problems (question, answer), or a reasoning-gym name
    limit: int | None = None  # the first N problems only
    seed: int = 0  # of generated problems
    # The policy: a model folder or a name kubestar resolves; served by a local engine, or,
    # with `scheduler`, only its tokenizer is used (it must be the fleet's).
    model: str = "SmolLM2-135M-Instruct"
    search: SearchConfig = field(default_factory=SearchConfig)
    ground_truth: bool = False  # mcts: value answers by the reference answers
    rollouts: int = 8  # mcts
    beams: int = 8  # beam: B1
    # majority, best-of-n, ppm-vote: solutions sampled per problem (the first wave with a
    # token budget), and the tokens to draw waves until (0: one wave).
    samples: int = 8
    token_budget: int = 0
    scheduler: str = ""  # a running scheduler (HOST:PORT); "": started locally
    sandbox: str = ""  # a running sandbox (HOST:PORT); "": started locally
    services: LocalServiceSettings = field(default_factory=LocalServiceSettings)
    output: str = ""  # the trees, one JSON line per problem ("": not written)
    progress: bool = True  # a progress bar and the services' start on stderr

    def solve_settings(self) -> SolveSettings:
        return SolveSettings(
            mode=self.mode,
            search=self.search.tree(rollouts=self.rollouts, beam_width=self.beams),
            samples=self.samples,
            token_budget=self.token_budget,
            ground_truth=self.ground_truth,
            **self.search.solver_fields(self.scheduler, self.services.max_model_len),
        )


@dataclass
class SolveOutcome:
    """What `solve` found: every problem's outcome, and the figures the command prints."""

    mode: str
    solved: list[Solved]
    output: str = ""

    def figures(self) -> dict[str, Any]:
        from kubestar.search.solve import summary

        figures: dict[str, Any] = {"mode": self.mode, **summary(self.solved)}
        if self.output:
            figures["output"] = self.output
        return figures

    def text(self) -> str:
        from kubestar.search.solve import format_summary

        return format_summary(self.mode, self.figures())


def solve(config: SolveConfig) -> SolveOutcome:
    """`kubestar solve`: the problems solved on the services (see the module docstring); the
    trees written to `config.output`."""
    from kubestar.search.solve import write_trees
    from kubestar.training.chat import ChatTokenizer

    model_dir = resolve_policy(config.model)
    problems = problem_set(config.problems, config.limit, config.seed)
    settings = config.solve_settings()
    tokenizer = ChatTokenizer.from_model(model_dir)
    source = config.search.ppm_source(model_dir)
    with search_services(
        model_dir,
        config.services,
        scheduler=config.scheduler,
        sandbox=config.sandbox,
        progress=config.progress,
    ) as services:
        solved = asyncio.run(
            run_solve(
                problems,
                settings,
                services.endpoints(tokenizer.encode, config.search, source),
                progress=config.progress,
            )
        )
    if config.output:
        write_trees(config.output, solved)
    return SolveOutcome(config.mode, solved, config.output)


# -- kubestar eval --search -------------------------------------------------------------------
@dataclass(frozen=True)
class SearchEvalConfig:
    """`kubestar eval --search`: every mode of `modes` at every budget of `budgets` on the
    same problems (`kubestar.search.sweep`), accuracy against generated tokens."""

    modes: tuple[str, ...]  # of kubestar.search.solve.MODES, each once
    problems: str  # a .jsonl file of problems (question, answer), or a reasoning-gym name
    model: str  # the policy (with `scheduler`, its tokenizer)
    # b is b MCTS rollouts, b beams (B1) of `search.beam_samples` steps, and for the chain
    # modes b solutions topped up to the tokens the tree search spent at b.
    budgets: tuple[int, ...] = (2, 4, 8)
    limit: int | None = None  # the first N problems only
    seed: int = 0  # of generated problems
    search: SearchConfig = field(default_factory=SearchConfig)
    scheduler: str = ""  # a running scheduler (HOST:PORT); "": started locally
    sandbox: str = ""  # a running sandbox (HOST:PORT); "": started locally
    services: LocalServiceSettings = field(default_factory=LocalServiceSettings)
    plot: str = ""  # a PNG of accuracy against generated tokens per problem ("": none)
    output: str = ""  # every tree, one line per mode, budget and problem ("": none)
    progress: bool = True

    def __post_init__(self) -> None:
        self.sweep_settings()  # a ValueError for modes or budgets that cannot be swept

    def sweep_settings(self) -> SweepSettings:
        from kubestar.search.sweep import SweepSettings

        return SweepSettings(
            modes=self.modes,
            budgets=self.budgets,
            search=self.search.tree(),
            **self.search.solver_fields(self.scheduler, self.services.max_model_len),
        )


@dataclass
class SearchEvalOutcome:
    """The sweep's points and what the command prints of them."""

    config: SearchEvalConfig
    model_dir: Path
    problems: int
    points: list[SweepPoint]
    drawn: bool  # the plot was drawn

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "model": str(self.model_dir),
            "problems_source": self.config.problems,
            "problems": self.problems,
            "points": [point.figures() for point in self.points],
        }
        if self.drawn:
            figures["plot"] = self.config.plot
        if self.config.output:
            figures["output"] = self.config.output
        return figures

    def text(self) -> str:
        from kubestar.search.sweep import format_table

        lines = [
            f"{self.config.problems}: {self.problems} problems, 95% bootstrap intervals over them",
            format_table(self.points),
        ]
        if self.drawn:
            lines.append(f"plot: {self.config.plot}")
        return "\n".join(lines)


def evaluate_search(config: SearchEvalConfig) -> SearchEvalOutcome:
    """`kubestar eval --search`: the sweep on the services (started as `solve` starts them),
    then the PNG and the trees. PlotUnavailable without matplotlib."""
    from kubestar.search.sweep import plot_sweep
    from kubestar.training.chat import ChatTokenizer

    model_dir = resolve_policy(config.model)
    problems = problem_set(config.problems, config.limit, config.seed)
    tokenizer = ChatTokenizer.from_model(model_dir)
    with search_services(
        model_dir,
        config.services,
        scheduler=config.scheduler,
        sandbox=config.sandbox,
        command="eval",
        progress=config.progress,
    ) as services:
        points = asyncio.run(
            run_search_sweep(
                problems,
                config.sweep_settings(),
                services.endpoints(
                    tokenizer.encode, config.search, config.search.ppm_source(model_dir)
                ),
                progress=config.progress,
            )
        )
    drawn = False
    if config.plot:
        title = f"{config.problems} ({len(problems)} problems): accuracy against generated tokens"
        try:
            drawn = plot_sweep(points, config.plot, title=title)
        except ImportError as exc:
            raise PlotUnavailable(
                f"--plot needs matplotlib (pip install 'kubestar[training]'): {exc}"
            ) from exc
    if config.output:
        write_sweep_trees(config.output, points)
    return SearchEvalOutcome(config, model_dir, len(problems), points, drawn)


# -- kubestar evolve --------------------------------------------------------------------------
@dataclass(frozen=True)
class EvolveConfig:
    """`kubestar evolve`: one round of self-evolution (`kubestar.search.evolve.Round`), each
    policy served by local processes (`LocalSearchServices`)."""

    round: RoundSettings  # what the round does (round.json keeps it)
    # The step format and the programs' timeout of the round's searches.
    search: SearchConfig = field(default_factory=SearchConfig)
    sandbox: str = ""  # a running sandbox (HOST:PORT); "": started with each engine
    # The local services; their logs go to `log_dir`, else the round's folder's logs/.
    services: LocalServiceSettings = field(default_factory=LocalServiceSettings)
    until: str | None = None  # stop after this stage (a later run goes on from there)
    progress: bool = True  # progress lines ("evolve ...") and bars on stderr


@dataclass
class LocalSearchServices:
    """`kubestar.search.evolve.Services` as local processes: for each policy a vLLM engine,
    a scheduler and (without `sandbox`) a sandbox server, stopped when the block ends; the
    PPM is served in this process (on `ppm_device`) while a search needs it. Each start logs
    to a folder of its own under `log_dir`."""

    search: SearchConfig
    services: LocalServiceSettings
    sandbox: str
    log_dir: Path
    ppm_device: str
    progress: bool
    starts: int = 0

    @contextmanager
    def serving(self, policy: Path) -> Iterator[SolveFunction]:
        from dataclasses import replace

        from kubestar.engine.models import tokenizer_sha256
        from kubestar.training.chat import ChatTokenizer

        encode = ChatTokenizer.from_model(policy).encode
        tokenizer = tokenizer_sha256(policy)
        self.starts += 1
        services = replace(
            self.services, log_dir=str(self.log_dir / f"{self.starts}-{policy.name}")
        )
        with search_services(
            policy, services, sandbox=self.sandbox, command="evolve", progress=self.progress
        ) as running:

            def solve(
                problems: Sequence[Problem],
                settings: SolveSettings,
                ppm: str,
                on_done: Callable[[Solved], None] | None = None,
            ) -> list[Solved]:
                return asyncio.run(
                    run_solve(
                        list(problems),
                        settings,
                        running.endpoints(
                            encode, self.search, PpmSource(ppm, "", self.ppm_device, tokenizer)
                        ),
                        progress=self.progress,
                        on_done=on_done,
                    )
                )

            yield solve


def evolve(config: EvolveConfig) -> dict[str, Any]:
    """`kubestar evolve`: the round run (resumed) until `config.until`; its manifest
    (round.json)."""
    from kubestar.search.evolve import Round

    settings = config.round
    services = LocalSearchServices(
        search=config.search,
        services=config.services,
        sandbox=config.sandbox,
        log_dir=Path(config.services.log_dir or Path(settings.out) / "logs"),
        ppm_device=settings.device,
        progress=config.progress,
    )

    def progress(line: str) -> None:
        if config.progress:
            print(f"evolve {line}", file=sys.stderr, flush=True)

    manifest: dict[str, Any] = Round(settings, services, progress).run(until=config.until)
    return manifest


# -- kubestar ppm train -----------------------------------------------------------------------
@dataclass(frozen=True)
class PpmTrainConfig:
    """`kubestar ppm train`: a PPM trained on preference pairs with the Bradley-Terry loss
    and written to `out`. Each field is the flag of the same name."""

    # JSONL of preference pairs: prompt, chosen, rejected (text, or token ids in prompt_ids,
    # chosen_ids, rejected_ids).
    pairs: str
    out: str  # the PPM folder to write (new, or a PPM folder to replace)
    # The policy's model (a folder or a name kubestar resolves): the PPM starts from it and
    # reads token ids with its tokenizer.
    model: str = "SmolLM2-135M-Instruct"
    # How it is trained (--learning-rate, --epochs, --batch-size, --micro-batch-size,
    # --max-tokens, --seed; None: PpmTrainSettings(), rStar-Math's); the seed also splits
    # the pairs.
    training: PpmTrainSettings | None = None
    held_out: float = 0.05  # the share of pairs kept out of training to measure accuracy on
    device: str = "auto"  # cuda, cpu, ... (auto: a GPU if any)


def train_ppm(config: PpmTrainConfig) -> dict[str, Any]:
    """`kubestar ppm train`: the PPM folder written to `config.out` with a progress bar on
    stderr; returns the folder (`out`) and the metrics (loss per epoch, pair accuracy on the
    training and the held-out pairs), which its ppm.json keeps too. Raises SettingError("out")
    when `out` holds something other than a PPM."""
    from kubestar.engine.models import resolve_model
    from kubestar.scoring.model import INFO_FILE
    from kubestar.search.ppm import PpmTrainSettings, train_ppm_folder
    from kubestar.search.ppm_data import read_pairs
    from kubestar.training.chat import ChatTokenizer
    from tqdm import tqdm

    target = Path(config.out)
    if target.exists() and any(target.iterdir()) and not (target / INFO_FILE).exists():
        raise SettingError("out", f"{config.out} exists and is not a PPM folder: give a new folder")
    folder = resolve_model(config.model)
    examples = read_pairs(config.pairs, ChatTokenizer.from_model(folder).encode)
    with tqdm(desc="ppm", unit="step", dynamic_ncols=True) as bar:

        def progress(epoch: int, step: int, total: int, loss: float) -> None:
            bar.total = total
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}")
            bar.update(step - bar.n)

        report = train_ppm_folder(
            folder,
            examples,
            target,
            config.training or PpmTrainSettings(),
            held_out=config.held_out,
            device=config.device,
            pairs_file=Path(config.pairs),
            progress=progress,
        )
    return {"out": str(target), **report}
