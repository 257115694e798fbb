"""`kubestar train`: run a TrainingRun on this machine (or, with --in-cluster, in its Job)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from kubestar.common import logs

if TYPE_CHECKING:
    from kubestar.api.trainer_contract import TrainerEnvironment
    from kubestar.api.v1alpha1 import TrainingRun
    from kubestar.training.distributed import World
    from kubestar.training.stopping import FinalFailure


@click.command("train")
@click.option(
    "-f",
    "--file",
    "manifest",
    required=True,
    type=click.Path(exists=True),
    help="YAML with a TrainingRun (and, for local runs, its SandboxPool and "
    "RolloutFleet): the same file `kubectl apply -f` takes.",
)
@click.option(
    "--run-dir",
    type=click.Path(),
    default="",
    help="Where metrics, checkpoints, logs and the report go (default runs/NAME).",
)
@click.option("--fresh", is_flag=True, help="Ignore existing checkpoints in the run directory.")
@click.option(
    "--engine-python", default="", help="Python with vLLM for the engines (default: this one)."
)
@click.option(
    "--in-cluster",
    is_flag=True,
    help="Run as the trainer Job of a TrainingRun: services come from the "
    "KUBESTAR_* environment the operator sets, progress goes to the "
    "TrainingRun's status (see kubestar.api.trainer_contract).",
)
@click.option("--log-level", default="warning", show_default=True)
def train(
    manifest: str, run_dir: str, fresh: bool, engine_python: str, in_cluster: bool, log_level: str
) -> None:
    """Train: SFT, then the RL stages, then evaluation and a report.

    Locally this starts the sandbox, the vLLM engines and the rollout scheduler as processes
    on 127.0.0.1, resumes from the run directory's newest checkpoint unless --fresh, and
    writes metrics.jsonl, status.json, evaluation-*.json and report/ (table and plots).
    With trainer.workers x trainer.processesPerWorker N > 1 it trains in N processes (this one
    is rank 0).
    """
    logs.configure(log_level)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from kubestar.api.v1alpha1 import (
        ManifestError,
        RolloutFleet,
        SandboxPool,
        TrainingRun,
        load_manifests,
    )
    from kubestar.engine.models import resolve_model
    from kubestar.search.evaluation import SearchEvaluation
    from kubestar.training.distributed import World, local_ranks
    from kubestar.training.local import LocalStack, ServiceFailed
    from kubestar.training.progress import FileReporter
    from kubestar.training.report import write_report
    from kubestar.training.runlock import hold_run_folder
    from kubestar.training.session import TrainingSession
    from kubestar.training.stopping import EXIT_STOPPED, FinalFailure, StopRequest, TrainingStopped
    from tqdm import tqdm

    try:
        resources = load_manifests(manifest)
    except ManifestError as error:
        raise click.ClickException(str(error)) from error
    runs = [r for r in resources if isinstance(r, TrainingRun)]
    if len(runs) != 1:
        raise click.ClickException(f"{manifest}: expected one TrainingRun, found {len(runs)}")
    run = runs[0]
    pools = {r.metadata.name: r for r in resources if isinstance(r, SandboxPool)}
    fleets = {r.metadata.name: r for r in resources if isinstance(r, RolloutFleet)}
    pool = pools.get(run.spec.sandbox_pool_ref.name) or SandboxPool(
        metadata={"name": run.spec.sandbox_pool_ref.name}
    )  # type: ignore[arg-type]
    fleet = fleets.get(run.spec.rollout_fleet_ref.name) or RolloutFleet(
        metadata={"name": run.spec.rollout_fleet_ref.name}
    )  # type: ignore[arg-type]

    if in_cluster:
        _train_in_cluster(run, Path(run_dir or "/var/run/kubestar"))
        return

    directory = Path(run_dir or Path("runs") / run.metadata.name)
    world = World.from_env()
    if world.rank > 0:  # a training rank started by rank 0 below: it follows rank 0's steps
        _train_rank(run, directory, world)
        return
    directory.mkdir(parents=True, exist_ok=True)
    # A second `kubestar train` of the folder is refused.
    with hold_run_folder(directory):
        if fresh:
            for entry in directory.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif not entry.name.startswith(".trainer"):  # not the lock just taken
                    entry.unlink()
        if run.spec.model.pvc_claim_name and not run.spec.model.path:
            raise click.ClickException(
                f"spec.model.pvcClaimName: a local run cannot mount the claim "
                f"{run.spec.model.pvc_claim_name!r}; set spec.model.path to the model's folder"
            )
        source = run.spec.model.path or run.spec.model.name
        click.echo(f"preparing model {source}", err=True)
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
            pool, fleet, model_dir, directory / "logs", engine_python=engine_python
        )
        click.echo(
            f"starting sandbox, {max(fleet.spec.replicas, 1)} engine(s) and the scheduler "
            f"(logs in {directory / 'logs'})",
            err=True,
        )
        # The other training ranks: this command again, with torchrun's environment. Locally
        # every worker's processes run on this machine.
        trainer = run.spec.trainer
        processes = (
            1 if "WORLD_SIZE" in os.environ else trainer.workers * trainer.processes_per_worker
        )
        rank_command = [sys.executable, "-m", "kubestar.cli.main", "train", "-f", manifest]
        rank_command += ["--run-dir", str(directory), "--log-level", log_level]
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
                search=SearchEvaluation(),
            )
            try:
                status = session.run_all()
            except TrainingStopped as stopped:
                bar.close()
                click.echo(f"{stopped}; run the same command again to resume", err=True)
                sys.exit(EXIT_STOPPED)
            except FinalFailure as failure:
                bar.close()
                _exit_final(failure, None)
            except ServiceFailed as failed:
                bar.close()
                raise click.ClickException(str(failed)) from None
        bar.close()
        report = write_report(directory)
        logging.getLogger(__name__).info("done")
        click.echo(f"{status.phase}: {status.step}/{status.total_steps} steps; report: {report}")


def _exit_final(error: FinalFailure, termination_log: str | None) -> NoReturn:
    """A failure no retry fixes: say so in one line (in a cluster also as the termination
    message, which the operator shows in TrainerReady) and exit with the code that fails the
    trainer's Job without retrying it."""
    from kubestar.api.trainer_contract import EXIT_FINAL_FAILURE

    click.echo(f"kubestar: {error}", err=True)
    if termination_log:
        try:
            Path(termination_log).write_text(f"{error.reason}: {error}\n")
        except OSError as failure:  # the error itself is printed above
            click.echo(f"kubestar: cannot write {termination_log}: {failure.strerror}", err=True)
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

    model_dir = resolve_model(run.spec.model.path or run.spec.model.name)
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
        _exit_final(failure, termination_log)
    finally:
        close_world()


def _train_in_cluster(run: TrainingRun, directory: Path) -> None:
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
        _train_worker_pod(run, directory, env)


def _train_worker_pod(run: TrainingRun, directory: Path, env: TrainerEnvironment) -> None:
    """This trainer pod's ranks, once it holds its worker's lock on the run folder."""
    from kubestar.api.trainer_contract import TERMINATION_LOG
    from kubestar.api.v1alpha1 import CallLimitsSpec
    from kubestar.engine.models import resolve_model
    from kubestar.search.evaluation import SearchEvaluation
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
        click.echo(
            f"trainer worker {env.worker_index} ({pod}): rank {world.rank} of {size}, "
            f"model {run.spec.model.path}"
        )
        if not world.main:
            _train_rank(run, directory, world, TERMINATION_LOG)
            return
        model_dir = resolve_model(run.spec.model.path or run.spec.model.name)
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
            search=SearchEvaluation(),
        )
        try:
            status = session.run_all()
        except TrainingStopped as stopped:
            # The Job's next pod resumes from the checkpoint (trainer.backoffLimit).
            click.echo(f"{stopped}; the next trainer pod resumes from it", err=True)
            sys.exit(EXIT_STOPPED)
        except FinalFailure as failure:
            _exit_final(failure, TERMINATION_LOG)
    click.echo(f"{status.phase}: {status.step}/{status.total_steps} steps")
