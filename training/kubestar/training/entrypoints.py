"""What `kubestar eval` (the agent loop) and `kubestar train` run: per command one settings
object the CLI builds from its flags, and the function that runs it.

* `AgentEvalConfig` -> `evaluate`: `kubestar eval` without --search.
* `AgentRolloutConfig` -> `rollout`: `kubestar rollout`.
* `TrainConfig` -> `train`: `kubestar train`, on this machine or as a trainer pod's
  entrypoint (`--in-cluster`), and each training rank those start.

`kubestar eval`: problems come from a .jsonl file (`question`, `answer`) or a reasoning-gym
generator. With an engine and a sandbox given it uses them; without, it starts a vLLM
engine on the model and a sandbox server as local processes on 127.0.0.1
(`LocalStack.for_command`) and stops them (by PID) when it is done. A setting that cannot
work raises SettingError naming it, a service that does not come up ServiceFailed (its
message ends with its log).

`kubestar rollout`: N problems x G samples through the agent loop on running services (one
vLLM engine or the rollout scheduler, and the sandbox), as `kubestar eval` runs it
(`kubestar.training.evaluation.run_rollouts` with its `RolloutSettings`).

`kubestar train`: locally it starts the sandbox, the vLLM engines and the rollout scheduler
of the manifest's SandboxPool and RolloutFleet (`LocalStack.for_run`); in a cluster the
services come from the environment the operator sets (kubestar.api.trainer_contract). A
stop, a final failure and each rank's end leave with the exit codes of that contract.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kubestar.api.errors import KubestarError, SettingError
from kubestar.common import logs
from kubestar.training.datasets import Problem
from kubestar.training.local import LocalServiceSettings, LocalStack

if TYPE_CHECKING:
    from kubestar.api.trainer_contract import TrainerEnvironment
    from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool, TrainingRun
    from kubestar.training.distributed import World
    from kubestar.training.evaluation import RolloutSettings
    from kubestar.training.stopping import FinalFailure
    from kubestar.training.workers import SearchEvaluator


def say(line: str) -> None:
    """A progress line on stderr."""
    print(line, file=sys.stderr, flush=True)


def resolve_policy(model: str) -> Path:
    """The model's folder; SettingError("model") when kubestar cannot find or fetch it."""
    from kubestar.engine.models import resolve_model

    try:
        return resolve_model(model)
    except (FileNotFoundError, RuntimeError, ImportError) as exc:
        raise SettingError("model", str(exc)) from exc


def problem_set(spec: str, limit: int | None, seed: int) -> list[Problem]:
    """The problems of a .jsonl file or a reasoning-gym generator; SettingError("problems")
    when it cannot be read or holds none."""
    from kubestar.training.datasets import load_problems

    try:
        problems = load_problems(spec, limit=limit, seed=seed)
    except (ValueError, FileNotFoundError) as exc:
        raise SettingError("problems", str(exc)) from exc
    if not problems:
        raise SettingError("problems", f"{spec}: no problems")
    return problems


@dataclass(frozen=True)
class AgentEvalConfig:
    """`kubestar eval`: how well a model solves a problem set with the code tool, through
    the agent loop (greedy by default). Each field is the flag of the same name."""

    problems: str  # a .jsonl file of problems (question, answer), or a reasoning-gym name
    # The model to serve (a folder or a name kubestar resolves); with `engine`, only its
    # tokenizer is used ("": the engine's model).
    model: str = ""
    limit: int | None = None  # the first N problems only
    seed: int = 0  # of generated problems
    samples: int = 1  # per problem
    max_turns: int = 10
    max_response_tokens: int = 2048
    temperature: float = 0.0  # 0: greedy decoding
    top_p: float = 1.0
    sampling_seed: int = 0  # 0: unseeded
    tool_timeout: float = 10.0  # seconds per tool call
    request_timeout: float = 900.0  # seconds one generation may take before it fails
    engine: str = ""  # a running vLLM engine (URL); "": started locally
    sandbox: str = ""  # a running sandbox (HOST:PORT); "": started locally
    # The local services; a local engine's context is `services.max_model_len`.
    services: LocalServiceSettings = field(default_factory=LocalServiceSettings)
    output: str = ""  # every trajectory as a .jsonl file ("": none)
    progress: bool = True  # a progress bar and the services' start on stderr


def evaluate(config: AgentEvalConfig) -> dict[str, Any]:
    """`kubestar eval`: the rollouts on the services (see the module docstring); returns
    the metrics (`kubestar.training.evaluation.eval_metrics` with where they were measured)
    and writes the trajectories to `config.output`. Raises TokenizerNotFound when no
    tokenizer can be had."""
    from kubestar.training.evaluation import (
        RolloutSettings,
        eval_metrics,
        run_rollouts,
        write_trajectories,
    )

    model_dir = resolve_policy(config.model) if config.model else None
    problems = problem_set(config.problems, config.limit, config.seed)
    stack = LocalStack.for_command(
        config.services,
        model_dir,
        command="eval",
        engines=not config.engine,
        scheduler=False,
        sandbox=not config.sandbox,
    )
    if config.progress:
        for engine in stack.engine_settings:
            say(f"starting a vLLM engine on {model_dir} ({engine.url})")
        if stack.sandbox is not None:
            say(f"starting a sandbox server (logs in {stack.log_dir})")
    with stack.running() as started:
        url = config.engine or stack.engines[0].url
        sandbox = config.sandbox or started.sandbox
        # The rest as `kubestar rollout` has it by default: the engine's context, top-k
        # off, 1024 trajectories at once on one sandbox stream, 2 verifying processes.
        settings = RolloutSettings(
            sandbox=sandbox,
            engine=url,
            samples=config.samples,
            max_turns=config.max_turns,
            max_response_tokens=config.max_response_tokens,
            model=str(model_dir) if model_dir else "",
            temperature=config.temperature,
            top_p=config.top_p,
            sampling_seed=config.sampling_seed,
            tool_timeout=config.tool_timeout,
            request_timeout=config.request_timeout,
            progress=config.progress,
        )
        stats, trajectories = asyncio.run(run_rollouts(problems, settings))
    metrics = eval_metrics(stats, trajectories)
    metrics["model"] = str(model_dir) if model_dir else ""
    metrics["engine"] = url
    metrics["sandbox"] = sandbox
    metrics["problems_source"] = config.problems
    metrics["temperature"] = config.temperature
    if config.output:
        write_trajectories(config.output, trajectories)
    return metrics


# -- kubestar rollout -------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentRolloutConfig:
    """`kubestar rollout`: N problems x G samples through the agent loop on running
    services, for the stats of the batch (accuracy, tool use, response lengths,
    throughput). Each field is the flag of the same name."""

    # Where and how the agent loop runs (the services, samples, turns, sampling, ...).
    rollouts: RolloutSettings
    # A reasoning-gym dataset, optionally NAME:key=value,... for its config.
    dataset: str = "basic_arithmetic"
    problems: str = ""  # a .jsonl file of problems (question, answer) instead of `dataset`
    num_problems: int = 10
    seed: int = 0  # of generated problems
    output: str = ""  # every trajectory as a .jsonl file ("": none)


def rollout(config: AgentRolloutConfig) -> dict[str, Any]:
    """`kubestar rollout`: the batch's stats (`kubestar.training.evaluation.format_stats`
    prints them); the trajectories written to `config.output`. Raises SettingError
    ("problems") when the problems cannot be had, TokenizerNotFound when no tokenizer can."""
    from kubestar.training.datasets import load_problems
    from kubestar.training.evaluation import run_rollouts, write_trajectories

    spec = config.problems or config.dataset
    try:
        problems = load_problems(spec, limit=config.num_problems, seed=config.seed)
    except (ValueError, FileNotFoundError) as exc:
        raise SettingError("problems", str(exc)) from exc
    stats, trajectories = asyncio.run(run_rollouts(problems, config.rollouts))
    if config.output:
        write_trajectories(config.output, trajectories)
    return stats


# -- kubestar train ---------------------------------------------------------------------------
class RunRefused(KubestarError, ValueError):
    """The manifest cannot run here; the message says why."""


@dataclass(frozen=True)
class TrainConfig:
    """`kubestar train`: SFT, then the RL stages, then evaluation and a report, of the one
    TrainingRun of a manifest. Each field is the flag of the same name."""

    # YAML with a TrainingRun (and, for local runs, its SandboxPool and RolloutFleet): the
    # same file `kubectl apply -f` takes.
    manifest: str
    # Metrics, checkpoints, logs and the report ("": runs/NAME; in a cluster
    # /var/run/kubestar, or the checkpoint volume's run/).
    run_dir: str = ""
    fresh: bool = False  # ignore (delete) the run directory's checkpoints
    engine_python: str = ""  # Python with vLLM for the local engines ("": this one)
    # Run as the trainer Job of a TrainingRun: services from the KUBESTAR_* environment the
    # operator sets, progress to the TrainingRun's status.
    in_cluster: bool = False
    log_level: str = "warning"


def train(config: TrainConfig, search: SearchEvaluator | None = None) -> None:
    """Run the manifest's TrainingRun (see the module docstring). `search`: the test-time
    search of spec.evaluation.search (kubestar.search.evaluation.SearchEvaluation), which
    this layer cannot import. Raises ManifestError, RunRefused and ServiceFailed; exits with
    the trainer contract's codes when stopped or failed for good."""
    logs.configure(config.log_level)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from kubestar.training.distributed import World

    run, pool, fleet = load_run(config.manifest)
    if config.in_cluster:
        _train_in_cluster(run, Path(config.run_dir or "/var/run/kubestar"), search)
        return
    directory = Path(config.run_dir or Path("runs") / run.metadata.name)
    world = World.from_env()
    if world.rank > 0:  # a training rank started by rank 0 below: it follows rank 0's steps
        _train_rank(run, directory, world)
        return
    _train_here(config, run, pool, fleet, directory, world, search)


def load_run(manifest: str) -> tuple[TrainingRun, SandboxPool, RolloutFleet]:
    """The manifest's one TrainingRun, and its SandboxPool and RolloutFleet (their defaults
    where the file has none of that name)."""
    from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool, TrainingRun, load_manifests

    resources = load_manifests(manifest)
    runs = [r for r in resources if isinstance(r, TrainingRun)]
    if len(runs) != 1:
        raise RunRefused(f"{manifest}: expected one TrainingRun, found {len(runs)}")
    run = runs[0]
    pools = {r.metadata.name: r for r in resources if isinstance(r, SandboxPool)}
    fleets = {r.metadata.name: r for r in resources if isinstance(r, RolloutFleet)}
    pool = pools.get(run.spec.sandbox_pool_ref.name) or SandboxPool(
        metadata={"name": run.spec.sandbox_pool_ref.name}
    )  # type: ignore[arg-type]
    fleet = fleets.get(run.spec.rollout_fleet_ref.name) or RolloutFleet(
        metadata={"name": run.spec.rollout_fleet_ref.name}
    )  # type: ignore[arg-type]
    return run, pool, fleet


def _train_here(
    config: TrainConfig,
    run: TrainingRun,
    pool: SandboxPool,
    fleet: RolloutFleet,
    directory: Path,
    world: World,
    search: SearchEvaluator | None,
) -> None:
    """Rank 0 of a run on this machine: its services as local processes, the other ranks
    as this command again, progress on a bar, then the report."""
    from kubestar.engine.models import resolve_model
    from kubestar.training.distributed import local_ranks
    from kubestar.training.local import ServiceFailed
    from kubestar.training.progress import FileReporter
    from kubestar.training.report import write_report
    from kubestar.training.runlock import hold_run_folder
    from kubestar.training.session import TrainingSession
    from kubestar.training.stopping import EXIT_STOPPED, FinalFailure, StopRequest, TrainingStopped
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    # A second `kubestar train` of the folder is refused.
    with hold_run_folder(directory):
        if config.fresh:
            for entry in directory.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif not entry.name.startswith(".trainer"):  # not the lock just taken
                    entry.unlink()
        if run.spec.model.pvc_claim_name and not run.spec.model.path:
            raise RunRefused(
                f"spec.model.pvcClaimName: a local run cannot mount the claim "
                f"{run.spec.model.pvc_claim_name!r}; set spec.model.path to the model's folder"
            )
        if fleet.spec.autoscaling is not None:
            raise RunRefused(
                f"RolloutFleet {fleet.metadata.name} spec.autoscaling: a local run starts "
                f"spec.replicas engines and scales none (the operator does, in a cluster); "
                "remove it from the manifest to run here"
            )
        source = run.spec.model.local_location()
        say(f"preparing model {source}")
        model_dir = resolve_model(source)

        total = sum(stage.steps for stage in run.spec.stages)
        bar = tqdm(total=total, desc="training", unit="step", file=sys.stderr)

        def progress(stage: str, step: int, total_steps: int, metrics: dict[str, float]) -> None:
            # SFT reports its own optimizer steps and loss; RL steps their rollout metrics.
            if stage == "sft":
                bar.set_description("sft")
                bar.set_postfix_str(f"loss={metrics.get('loss', 0):.3f}")
            else:
                bar.set_description("training")
                # kept: the trajectories RoC kept for the update (0: every group answered alike).
                bar.set_postfix_str(
                    f"{stage} reward={metrics.get('reward', 0):.2f} "
                    f"kept={metrics.get('kept', 0):.0f}/{metrics.get('rollouts', 0):.0f} "
                    f"acc={metrics.get('accuracy', 0):.2f} "
                    f"tool_err={metrics.get('tool_error_rate', 0):.2f} "
                    f"len={metrics.get('mean_response_tokens', 0):.0f}"
                )
            bar.total = total_steps
            bar.n = step
            bar.refresh()

        stack = LocalStack.for_run(
            pool, fleet, model_dir, directory / "logs", engine_python=config.engine_python
        )
        say(
            f"starting sandbox, {max(fleet.spec.replicas, 1)} engine(s) and the scheduler "
            f"(logs in {directory / 'logs'})"
        )
        # The other training ranks: this command again, with torchrun's environment. Locally
        # every worker's processes run on this machine.
        trainer = run.spec.trainer
        processes = (
            1 if "WORLD_SIZE" in os.environ else trainer.workers * trainer.processes_per_worker
        )
        rank_command = [sys.executable, "-m", "kubestar.cli.main", "train", "-f", config.manifest]
        rank_command += ["--run-dir", str(directory), "--log-level", config.log_level]
        stop = StopRequest().install()
        # The services come up while the training processes load the model.
        with (
            stack.running(wait=False) as endpoints,
            local_ranks(processes, rank_command, directory / "logs") as ranks,
        ):
            session = TrainingSession(
                run,
                endpoints,
                directory,
                model_dir,
                FileReporter(directory / "status.json"),
                progress=progress,
                call_limits=pool.spec.limits,
                world=ranks if ranks.sharded else world,
                stop=stop,
                services_ready=stack.wait_ready,
                search=search,
            )
            try:
                status = session.run_all()
            except TrainingStopped as stopped:
                bar.close()
                say(f"{stopped}; run the same command again to resume")
                sys.exit(EXIT_STOPPED)
            except FinalFailure as failure:
                bar.close()
                exit_final(failure, None)
            except ServiceFailed:
                bar.close()
                raise
        bar.close()
        report = write_report(directory)
        logging.getLogger(__name__).info("done")
        print(
            f"{status.phase}: {status.step}/{status.total_steps} steps; report: {report}",
            flush=True,
        )


def exit_final(error: FinalFailure, termination_log: str | None) -> NoReturn:
    """A failure no retry fixes: say so in one line (in a cluster also as the termination
    message, which the operator shows in TrainerReady) and exit with the code that fails the
    trainer's Job without retrying it."""
    from kubestar.api.trainer_contract import EXIT_FINAL_FAILURE

    say(f"kubestar: {error}")
    if termination_log:
        try:
            Path(termination_log).write_text(f"{error.reason}: {error}\n")
        except OSError as failure:  # the error itself is printed above
            say(f"kubestar: cannot write {termination_log}: {failure.strerror}")
    sys.exit(EXIT_FINAL_FAILURE)


def _train_rank(
    run: TrainingRun, directory: Path, world: World, termination_log: str | None = None
) -> None:
    """A rank other than 0: it trains its shard and takes part in every collective; rollouts,
    status, metrics and files other than its checkpoint shards are rank 0's.
    `termination_log`: where a pod's first process states why it failed."""
    from kubestar.engine.models import resolve_model
    from kubestar.training.distributed import close_world
    from kubestar.training.endpoints import Endpoints
    from kubestar.training.progress import FileReporter
    from kubestar.training.session import TrainingSession
    from kubestar.training.stopping import EXIT_STOPPED, FinalFailure, TrainingStopped

    model_dir = resolve_model(run.spec.model.local_location())
    reporter = FileReporter(directory / f"status-rank-{world.rank}.json")  # never written
    session = TrainingSession(
        run, Endpoints(scheduler="", sandbox=""), directory, model_dir, reporter, world=world
    )
    try:
        session.run_all()
    except TrainingStopped:
        # This rank's shard is in the checkpoint. Not a success: in a cluster every
        # worker's Job must retry, so that the world meets again and resumes.
        sys.exit(EXIT_STOPPED)
    except FinalFailure as failure:  # a full volume: every rank raises it alike
        exit_final(failure, termination_log)
    finally:
        close_world()


def _train_in_cluster(run: TrainingRun, directory: Path, search: SearchEvaluator | None) -> None:
    """A trainer pod: endpoints and checkpoint place from the operator, status to the API.

    Worker W of a world of workers x P processes starts ranks W*P .. W*P+P-1 (this process
    the first) and meets the other pods at worker 0's rendezvous. Rank 0 trains and reports;
    the other ranks follow its steps."""
    from kubestar.api.trainer_contract import TrainerEnvironment
    from kubestar.training.distributed import World
    from kubestar.training.runlock import hold_run_folder

    env = TrainerEnvironment.from_env()
    # The operator mounts the model's claim (model.pvcClaimName) in this pod: every rank reads
    # the model from there.
    run.spec.model.path = run.spec.model.location()
    if env.checkpoint_dir:
        run.spec.checkpoint.path = env.checkpoint_dir
        # Weights pushed to the engines must be readable by them: keep the run directory on
        # the checkpoint volume, which the fleet's engines mount at the same path.
        directory = Path(env.checkpoint_dir) / "run"
    if "WORLD_SIZE" in os.environ:  # a rank this pod's first process started (below)
        _train_rank(run, directory, World.from_env())
        return
    directory.mkdir(parents=True, exist_ok=True)
    # A replacement pod waits here until the pod it replaces has checkpointed and exited.
    with hold_run_folder(directory, f"trainer-worker-{env.worker_index}", wait=True):
        _train_worker_pod(run, directory, env, search)


def _train_worker_pod(
    run: TrainingRun, directory: Path, env: TrainerEnvironment, search: SearchEvaluator | None
) -> None:
    """This trainer pod's ranks, once it holds its worker's lock on the run folder."""
    from kubestar.api.trainer_contract import TERMINATION_LOG
    from kubestar.api.v1alpha1 import CallLimitsSpec
    from kubestar.engine.models import resolve_model
    from kubestar.training.distributed import local_ranks, rendezvous_host
    from kubestar.training.endpoints import Endpoints
    from kubestar.training.progress import StatusPatcher
    from kubestar.training.session import TrainingSession
    from kubestar.training.stopping import EXIT_STOPPED, FinalFailure, StopRequest, TrainingStopped
    from kubestar.training.telemetry import trainer_pod_listeners

    size = env.workers * env.processes
    master = None
    if size > 1:
        host, _, port = env.rendezvous.rpartition(":")
        run_status = StatusPatcher.in_cluster(env)
        address = rendezvous_host(host, lambda: run_status.current().get("rendezvousAddress"))
        master = (address, int(port))
    stop = StopRequest().install()  # before the ranks start: a drain may come at any time
    first_rank = env.worker_index * env.processes
    command = [sys.executable, "-m", "kubestar.cli.main", "train", "-f", env.run_config]
    level = logging.getLevelName(logging.getLogger().level).lower()  # this pod's --log-level
    command += ["--in-cluster", "--log-level", level]
    with local_ranks(size, command, None, first_rank, env.processes, master) as world:
        pod = os.environ.get("HOSTNAME", "")
        print(
            f"trainer worker {env.worker_index} ({pod}): rank {world.rank} of {size}, "
            f"model {run.spec.model.path}",
            flush=True,
        )
        if not world.main:
            _train_rank(run, directory, world, TERMINATION_LOG)
            return
        model_dir = resolve_model(run.spec.model.local_location())
        endpoints = Endpoints(
            scheduler=env.scheduler_endpoint,
            sandbox=env.sandbox_endpoint,
            weight_sync=env.weight_sync,
            weights_listen=env.weights_listen,
        )
        session = TrainingSession(
            run,
            endpoints,
            directory,
            model_dir,
            StatusPatcher.in_cluster(env),
            call_limits=CallLimitsSpec.model_validate(env.sandbox_limits),
            world=world,
            stop=stop,
            telemetry=trainer_pod_listeners(env),
            search=search,
        )
        try:
            status = session.run_all()
        except TrainingStopped as stopped:
            # The Job's next pod resumes from the checkpoint (trainer.backoffLimit).
            say(f"{stopped}; the next trainer pod resumes from it")
            sys.exit(EXIT_STOPPED)
        except FinalFailure as failure:
            exit_final(failure, TERMINATION_LOG)
    print(f"{status.phase}: {status.step}/{status.total_steps} steps", flush=True)
