"""A training run from start to end: SFT, the RL stages, checkpoints, evaluation.

    [resume from the newest checkpoint, push its weights to the engines]
    SFT (if asked and not done)                    -> push weights, checkpoint
    for each stage: select its problems (filter), maybe reset the optimizer
        for each step: rollouts (Ray actor) -> GRPO-RoC update -> push weights
                       -> metrics log + status -> checkpoint every N steps
    evaluation on held-out problems (greedy; and search, with evaluation.search) -> report

Every problem a step trains on is fixed by (stage, step) alone, so a run resumed from a
checkpoint neither repeats nor skips a step. The same code runs on one machine (local Ray,
services as local processes) and in the trainer Job of a cluster (services behind endpoints).

A sharded trainer runs one session per rank. Rank 0 drives: rollouts, evaluation, metrics,
status and the files; the other ranks follow the same stages and steps and take part in every
collective (the update, gathering weights for the engines, writing a checkpoint's shards).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubestar.api.conditions import Phase, Reason, now
from kubestar.api.errors import KubestarError
from kubestar.api.v1alpha1 import (
    Activity,
    AlgorithmSpec,
    CallLimitsSpec,
    CheckpointSpec,
    DatasetSpec,
    Progress,
    RolloutRetry,
    SftSpec,
    StageFilterResult,
    StageSpec,
    TrainingMetrics,
    TrainingRun,
    TrainingRunSpec,
    TrainingRunStatus,
)
from kubestar.engine.weight_sync import WeightServer
from kubestar.training import checkpoint
from kubestar.training.checkpoint import RunState
from kubestar.training.datasets import Problem, file_problems, load_problems, mixed_problems
from kubestar.training.distributed import SINGLE, ShardingConfig, World, all_reduce
from kubestar.training.endpoints import Endpoints
from kubestar.training.generators import Sampling
from kubestar.training.pipeline import (
    RolloutsAhead,
    idle_seconds,
    stale_trajectories,
    staleness_metrics,
)
from kubestar.training.policy import OptimizerConfig, Policy
from kubestar.training.progress import (
    MetricsListener,
    MetricsLog,
    Reporter,
    evaluation_result,
    evaluations_from_log,
    record_evaluation,
    record_stage_filter,
    set_phase,
    set_rollouts_condition,
    stage_filter_entry,
    stage_filters_from_log,
    status_metrics,
    step_progress,
)
from kubestar.training.resilience import InfrastructureFailure, rollout_step
from kubestar.training.stopping import FinalFailure, StopRequest, TrainingStopped
from kubestar.training.trainer import AlgorithmConfig, GrpoTrainer
from kubestar.training.trajectory import Trajectory

if TYPE_CHECKING:
    from kubestar.training.workers import SearchEvaluator

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str, int, int, dict[str, float]], None]


def algorithm_config(spec: AlgorithmSpec) -> AlgorithmConfig:
    """The trainer's settings from the TrainingRun's spec.algorithm."""
    return AlgorithmConfig(
        name=spec.name,
        group_size=spec.group_size,
        oversample_factor=spec.rollouts_oversample_factor,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        positive_selection=spec.positive_selection or AlgorithmConfig.positive_selection,
        updates_per_step=spec.updates_per_step,
        tis_cap=spec.tis_cap,
    )


@dataclass(frozen=True)
class PolicySettings:
    """How the trainer builds its Policy from the TrainingRun's spec (besides the model
    folder and the world)."""

    optimizer: OptimizerConfig
    device: str
    micro_batch_size: int
    sharding: ShardingConfig
    precision: str
    max_tokens_per_micro_batch: int | None = None  # when set, wins over micro_batch_size


def policy_settings(spec: TrainingRunSpec) -> PolicySettings:
    """The Policy's settings: the RL learning rate, spec.trainer's device, micro-batches (rows
    or tokens), activation checkpointing and precision."""
    trainer = spec.trainer
    return PolicySettings(
        optimizer=OptimizerConfig(learning_rate=spec.algorithm.learning_rate),
        device=trainer.device,
        micro_batch_size=trainer.micro_batch_size,
        sharding=ShardingConfig(activation_checkpointing=trainer.activation_checkpointing),
        precision=trainer.precision,
        max_tokens_per_micro_batch=trainer.max_tokens_per_micro_batch,
    )


def total_steps(spec: TrainingRunSpec) -> int:
    """RL steps of the whole run: the stages' steps added."""
    return sum(stage.steps for stage in spec.stages)


def sft_stage(spec: TrainingRunSpec) -> SftSpec | None:
    """The SFT stage the run asks for: spec.sft when set and enabled, else None."""
    sft = spec.sft
    return sft if sft is not None and sft.enabled else None


@dataclass(frozen=True)
class RolloutRequest:
    """What the trainer asks the rollout worker for: `samples` trajectories per problem, each
    of at most `max_turns` turns and `max_tokens` generated tokens, sampled with `sampling`."""

    samples: int
    max_turns: int
    max_tokens: int
    sampling: Sampling

    def arguments(self) -> tuple[int, int, int, Sampling]:
        """The arguments after the problems, in RolloutWorker.rollout's order."""
        return self.samples, self.max_turns, self.max_tokens, self.sampling


def training_rollouts(spec: TrainingRunSpec, stage: StageSpec, samples: int) -> RolloutRequest:
    """A stage's rollouts (its steps' and its filter's): spec.algorithm's turns and sampling,
    the stage's response budget."""
    algorithm = spec.algorithm
    return RolloutRequest(
        samples=samples,
        max_turns=algorithm.max_turns,
        max_tokens=stage.max_response_tokens,
        sampling=Sampling(temperature=algorithm.temperature, top_p=algorithm.top_p),
    )


def evaluation_rollouts(spec: TrainingRunSpec) -> RolloutRequest:
    """The held-out evaluation's rollouts: evaluation.samples per problem at
    evaluation.temperature (top-p 1), the largest stage's response budget."""
    evaluation = spec.evaluation
    return RolloutRequest(
        samples=evaluation.samples,
        max_turns=spec.algorithm.max_turns,
        max_tokens=max(stage.max_response_tokens for stage in spec.stages),
        sampling=Sampling(temperature=evaluation.temperature, top_p=1.0),
    )


def checkpoint_due(
    spec: CheckpointSpec, stage: StageSpec, global_step: int, stage_step: int
) -> bool:
    """Whether the step just done is checkpointed: every checkpoint.everySteps steps (over
    all stages) and at the end of each stage."""
    return global_step % spec.every_steps == 0 or stage_step == stage.steps


def load_dataset(spec: DatasetSpec) -> list[Problem]:
    if spec.generator:
        return load_problems(spec.generator, spec.size, spec.seed)
    if spec.mix:
        return mixed_problems([(e.generator, e.weight) for e in spec.mix], spec.size, spec.seed)
    assert spec.path is not None
    return file_problems(spec.path, spec.format, limit=spec.size)


class TooFewProblems(KubestarError, FinalFailure):
    """A stage's filter left fewer problems than one of its steps takes."""

    reason = Reason.TOO_FEW_PROBLEMS


def step_problems(problems: list[Problem], stage: StageSpec, step: int) -> list[Problem]:
    """The problems of step `step`: consecutive slices of a per-epoch shuffle."""
    per_step = stage.problems_per_step
    chosen: list[Problem] = []
    position = step * per_step
    orders: dict[int, list[int]] = {}
    while len(chosen) < per_step:
        epoch, offset = divmod(position, len(problems))
        if epoch not in orders:
            orders[epoch] = shuffled_order(len(problems), stage, epoch)
        chosen.append(problems[orders[epoch][offset]])
        position += 1
    return chosen


def shuffled_order(size: int, stage: StageSpec, epoch: int) -> list[int]:
    """The order a stage draws its `size` problems in on pass `epoch`, seeded by the stage's
    dataset.seed and name."""
    order = list(range(size))
    random.Random(f"{stage.dataset.seed}/{stage.name}/{epoch}").shuffle(order)
    return order


def solved_counts(trajectories: list[Trajectory]) -> dict[str, int]:
    """Right answers per problem id."""
    counts: dict[str, int] = {}
    for trajectory in trajectories:
        right = int((trajectory.reward or 0.0) > 0)
        counts[trajectory.problem_id] = counts.get(trajectory.problem_id, 0) + right
    return counts


def filter_unsolved(
    problems: list[Problem],
    stage: StageSpec,
    k: int,
    solved: Callable[[list[Problem]], dict[str, int]],
) -> tuple[list[Problem], int]:
    """The problems `solved` (k samples each: right answers per id) finds solved fewer than
    k times, and how many were evaluated. Problems are evaluated in the order the stage draws
    them (a filter that stops early keeps a sample of the dataset, not its head), a chunk at a
    time, until the stage's steps x problemsPerStep are kept."""
    needed = stage.steps * stage.problems_per_step
    chunk = max(stage.problems_per_step, 8)
    ordered = [problems[i] for i in shuffled_order(len(problems), stage, epoch=0)]
    kept: list[Problem] = []
    evaluated = 0
    for start in range(0, len(ordered), chunk):
        candidates = ordered[start : start + chunk]
        evaluated += len(candidates)
        counts = solved(candidates)
        kept += [p for p in candidates if counts.get(p.id, 0) < k]
        if len(kept) >= needed:
            break
    return kept, evaluated


def check_enough_problems(stage: StageSpec, result: StageFilterResult) -> None:
    """Raises TooFewProblems when the stage's filter kept fewer problems than a step takes."""
    if result.kept < stage.problems_per_step:
        raise TooFewProblems(
            f"stage {stage.name}: filter.dropSolvedKOfK {result.k} kept {result.kept} of "
            f"{result.evaluated} problems, fewer than problemsPerStep "
            f"{stage.problems_per_step}: the policy solves the rest every time; raise k, give "
            "the stage a larger dataset, or lower problemsPerStep"
        )


class TrainingSession:
    def __init__(
        self,
        run: TrainingRun,
        endpoints: Endpoints,
        run_dir: Path,
        model_dir: Path,
        reporter: Reporter,
        progress: ProgressCallback | None = None,
        reward_workers: int = 2,
        call_limits: CallLimitsSpec | None = None,
        world: World = SINGLE,
        stop: StopRequest | None = None,
        services_ready: Callable[[], None] | None = None,
        telemetry: Sequence[MetricsListener] = (),
        search: SearchEvaluator | None = None,
    ) -> None:
        """`call_limits`: the SandboxPool's per-call limits, applied to every tool call.
        `world`: this process's rank in a sharded trainer. `stop`: set when the process is
        asked to stop (SIGTERM): the session checkpoints the step in progress and raises
        TrainingStopped. `services_ready`: returns once the endpoints serve (services
        still starting, as a local run's do while the model loads); called before their
        first use. `telemetry`: rank 0's listeners to the metrics log (Prometheus metrics,
        the log's copy in the cluster: kubestar.training.telemetry). `search`: the
        test-time search of spec.evaluation.search (kubestar.search.evaluation's
        SearchEvaluation); a run cannot ask for that search without one."""
        self.run = run
        self.world = world
        self.stop = stop or StopRequest()
        self.call_limits = call_limits or CallLimitsSpec()
        self.spec = run.spec
        self.endpoints = endpoints
        self.services_ready = services_ready or (lambda: None)
        self.search = search
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.reporter = reporter
        self.progress = progress
        self.reward_workers = reward_workers
        self.checkpoints = Path(self.spec.checkpoint.path or run_dir / "checkpoints")
        self.weights_dir = run_dir / "weights"
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        if world.main:
            for listener in telemetry:
                self.metrics.listen(listener)
        self.status = TrainingRunStatus(
            total_steps=total_steps(self.spec),
            observed_generation=int(run.metadata.model_extra.get("generation", 0) or 0)
            if run.metadata.model_extra
            else 0,
        )
        self.started = time.monotonic()
        self._steps_timed: list[float] = []
        # The weights the engines should serve (folder, version), once pushed.
        self._weights: tuple[str, int] | None = None
        # The tries the latest push took, and how often the weights were pushed again to a
        # scheduler that had lost them in this step's rollouts: in each step's metrics.
        self._push_attempts = 0
        self._pushed_again = 0
        # (start, end) of collected rollouts whose end may fall in a later step's window:
        # what kept the engines busy (engine_idle_seconds).
        self._busy: list[tuple[float, float]] = []
        self.resumed_from: Path | None = None  # the checkpoint this run resumed from
        # Rank 0's server of the weights to the engines (endpoints.weight_sync "broadcast").
        self._weight_server: WeightServer | None = None

    # -- orchestration ----------------------------------------------------------------------
    def run_all(self) -> TrainingRunStatus:
        import ray
        from kubestar.training.workers import RolloutWorker

        settings = policy_settings(self.spec)
        policy = Policy(
            self.model_dir,
            settings.optimizer,
            device=settings.device,
            micro_batch_size=settings.micro_batch_size,
            world=self.world,
            sharding=settings.sharding,
            precision=settings.precision,
            max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
        )
        if not self.world.main:
            self._run(policy, None)  # follows rank 0's steps; rollouts are rank 0's
            return self.status
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            address = self.spec.trainer.ray_address or None
            ray.init(
                address=address,
                # A local instance talks over loopback only. (Ray 2.60 still listens on all
                # interfaces for its own gRPC servers; no setting of its changes that.)
                _node_ip_address=None if address else "127.0.0.1",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=None if address else max(2, os.cpu_count() or 2),
            )
            self.stop.reclaim()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.services_ready()
        worker: Any = (
            ray.remote(RolloutWorker)
            # A worker lost to a crash (or Ray's memory monitor) is restarted and its call
            # retried: a rollout batch is redone whole, never half-counted.
            .options(num_cpus=0, max_restarts=3, max_task_retries=3)
            .remote(
                self.endpoints.scheduler,
                self.endpoints.sandbox,
                str(self.model_dir),
                self.reward_workers,
                self.call_limits,
                self.search,
            )
        )
        if self.endpoints.weight_sync == "broadcast":
            self._weight_server = WeightServer(*self.endpoints.weight_server_address())
        try:
            self._run(policy, worker)
        except TrainingStopped:
            raise  # not a failure: the run goes on where it stopped
        except InfrastructureFailure as error:
            # Raised in the Ray worker, it arrives wrapped with its traceback: its own words.
            message = str(getattr(error, "cause", None) or error)
            self._set_phase(Phase.FAILED, Reason.INFRASTRUCTURE_FAILURES, message)
            raise
        except TooFewProblems as error:
            self._set_phase(Phase.FAILED, Reason.TOO_FEW_PROBLEMS, str(error))
            raise
        except Exception as error:
            # The checkpoint volume filled up (in a save, or writing the weights on it).
            full = checkpoint.volume_full(error, self.checkpoints, self.spec.checkpoint.keep)
            if full is not None:
                self._set_phase(Phase.FAILED, Reason.CHECKPOINT_VOLUME_FULL, str(full))
                if full is not error:
                    raise full from error
                raise
            self._set_phase(Phase.FAILED, Reason.TRAINER_ERROR, f"{type(error).__name__}: {error}")
            raise
        finally:
            ray.get(worker.close.remote())
            ray.kill(worker)
            if self._weight_server is not None:
                self._weight_server.close()
        return self.status

    def _run(self, policy: Policy, worker: Any) -> None:

        main = self.world.main
        search = self.spec.evaluation.search
        if main and search is not None and self.spec.evaluation.dataset is not None:
            if self.search is None:
                raise ValueError(
                    "spec.evaluation.search: this trainer was started without test-time "
                    "search (TrainingSession's `search`)"
                )
            self.search.check(search, self.model_dir)  # before training, not at the first one
        state = self._resume(policy, worker)
        fresh = self.resumed_from is None
        if fresh and "start" in self.spec.evaluation.at:
            self._evaluate(worker, "start")
        seed = zlib.crc32(self.run.metadata.name.encode())  # stable across processes
        trainer = GrpoTrainer(policy, self._algorithm(), pad_id=0, seed=seed)
        if state.rng_state is not None:
            trainer.rng.setstate(state.rng_state)

        sft = sft_stage(self.spec)
        if sft is not None and not state.sft_done:
            self._set_phase(
                Phase.SFT, Reason.SUPERVISED_FINE_TUNING, "non-reasoning SFT on the tool format"
            )
            from kubestar.training.rollout import RolloutConfig
            from kubestar.training.sft import run_sft
            from kubestar.training.workers import call_limits_config

            # The examples' tool calls run under the pool's limits, as the RL rollouts' do.
            source = (
                f"the SFT file {sft.dataset.path}"
                if sft.dataset is not None
                else f"the sandbox {self.endpoints.sandbox}"
            )
            self._doing("supervised fine-tuning", source)
            sft_metrics = run_sft(
                policy,
                self.model_dir,
                sft,
                self.endpoints.sandbox,
                seed=0,
                progress=self.progress,
                config=RolloutConfig(**call_limits_config(self.call_limits)),
            )
            if main:
                self.metrics.append({"step": 0, "stage": "sft", **sft_metrics})
            pushed = self._push_weights(policy, worker, version=0)
            state.sft_done = True
            self._checkpoint(policy, state, trainer, weights=pushed)
            if "sft" in self.spec.evaluation.at:
                self._evaluate(worker, "sft")

        self._set_phase(Phase.TRAINING, Reason.TRAINING, "GRPO-RoC stages")
        for index in range(state.stage_index, len(self.spec.stages)):
            stage = self.spec.stages[index]
            if index != state.stage_index:
                state.stage_index, state.stage_step = index, 0
            problems = self._stage_problems(stage, state, worker) if main else []
            if state.stage_step == 0 and stage.reset_optimizer and index > 0:
                policy.reset_optimizer()
            self.status.stage = stage.name
            if main:
                fields = {
                    "stage": stage.name,
                    "max_response_tokens": stage.max_response_tokens,
                    "steps": stage.steps,
                    "problems": len(problems),
                }
                log.info("stage", extra={"fields": fields})
            staleness = self.spec.algorithm.max_staleness
            request = training_rollouts(self.spec, stage, trainer.config.rollouts_per_problem)
            # Rollouts of the next `staleness` steps run while this one trains (pipeline.py).
            ahead = RolloutsAhead(
                depth=staleness,
                steps=stage.steps,
                start=partial(self._start_rollout, worker, stage, problems, request),
                collect=self._collect_rollout,
            )
            for step in range(state.stage_step, stage.steps):
                started = time.monotonic()
                trajectories: list[Trajectory] = []
                dropped: list[Trajectory] = []
                attempts = 1
                self._pushed_again = 0
                if main:
                    attempt = partial(self._take_rollout, ahead, step)
                    trajectories, stats, attempts = rollout_step(
                        attempt, self.spec.resilience, state.global_step + 1, self._retrying
                    )
                    self.status.rollout_retry = None
                    if staleness:
                        trajectories, dropped = stale_trajectories(
                            trajectories, state.global_step, staleness
                        )
                rollout_seconds = time.monotonic() - started
                self._doing(f"updating the policy on step {state.global_step + 1}", "the trainer")
                metrics = trainer.update(trajectories)  # sharded: rank 0's trajectories
                trained = time.monotonic()
                state.global_step += 1
                state.stage_step = step + 1
                pushed = self._push_weights(policy, worker, version=state.global_step)
                if main:
                    versions = [v for t in trajectories for v in t.weights_versions]
                    done = time.monotonic()
                    busy = self._busy + [(a.started, done) for a in ahead.launched.values()]
                    metrics.update(
                        staleness_metrics(trajectories, state.global_step - 1),
                        stale_dropped=float(len(dropped)),
                        # The trainer waits on the step's rollouts; the engines idle
                        # while no rollout is under way (all of training, in step).
                        trainer_idle_seconds=rollout_seconds,
                        engine_idle_seconds=idle_seconds((started, done), busy),
                    )
                    self._busy = [(a, b) for a, b in self._busy if b > done]
                    metrics.update(
                        step_seconds=done - started,
                        rollout_seconds=rollout_seconds,
                        train_seconds=trained - started - rollout_seconds,
                        push_seconds=done - trained,
                        max_response_tokens=float(stage.max_response_tokens),
                        tokens_per_second=stats.tokens_per_s,
                        world_size=float(self.world.size),  # training processes
                        rollout_attempts=float(attempts),
                        # A scheduler restart: the push after this step's update tried
                        # again, or this step's rollouts pushed the weights again first.
                        weights_push_attempts=float(self._push_attempts),
                        weights_pushed_again=float(self._pushed_again),
                        # The newest and the oldest weights the step's rollouts sampled
                        # from: the oldest is the previous step's unless an engine served
                        # stale weights.
                        weights_versions=float(max(versions, default=0)),
                        oldest_weights_version=float(min(versions, default=0)),
                    )
                    self._record_step(stage, state, metrics)
                if self._periodic_evaluation(state.global_step):
                    # Before the checkpoint: a resume from the previous one evaluates again.
                    self._evaluate(worker, "step")
                # Asked to stop (any rank's SIGTERM): this step is checkpointed, then no more.
                stopping = all_reduce(float(self.stop.requested), self.world, policy.device) > 0
                due = checkpoint_due(
                    self.spec.checkpoint, stage, state.global_step, state.stage_step
                )
                if due or stopping:
                    self._checkpoint(policy, state, trainer, weights=pushed)
                if stopping:
                    raise TrainingStopped(state.global_step, self.status.last_checkpoint)
        if "end" in self.spec.evaluation.at:
            self._evaluate(worker, "end")
        self._set_phase(Phase.SUCCEEDED, Reason.COMPLETED, f"{self.status.total_steps} steps done")

    # -- pieces ----------------------------------------------------------------------------
    def _periodic_evaluation(self, global_step: int) -> bool:
        """Whether evaluation.everySteps asks for one after this step (the last step's is
        the end evaluation, when that is asked for)."""
        every = self.spec.evaluation.every_steps
        if every is None or global_step % every:
            return False
        return not (global_step == self.status.total_steps and "end" in self.spec.evaluation.at)

    def _algorithm(self) -> AlgorithmConfig:
        return algorithm_config(self.spec.algorithm)

    def _resume(self, policy: Policy, worker: Any) -> RunState:
        # A restarted trainer's status keeps the step the run had reached while the
        # checkpoints are verified, rather than going back to 0.
        if self.world.main:
            self._show_logged_step(self.metrics.read())
        # The newest checkpoint that verifies; bad ones are set aside (every rank agrees).
        self._doing("verifying checkpoints", f"the volume at {self.checkpoints}")
        latest = checkpoint.newest_good(self.checkpoints, self.world)
        self.resumed_from = latest
        if latest is None:
            if self.world.main:
                self._show_logged_step([])  # starting over
            return RunState()
        state = checkpoint.load(latest, policy)  # sharded: rank 0 reads, every shard loads
        if not self.world.main:
            return state
        # A warning: after the first start, a resume means the trainer was restarted.
        log.warning(
            "resuming from %s (step %d)",
            latest,
            state.global_step,
            extra={"fields": {"checkpoint": str(latest), "global_step": state.global_step}},
        )
        self.metrics.truncate_after(state.global_step)
        self._show_logged_step(self.metrics.read(), state.global_step)
        self.status.evaluations = evaluations_from_log(self.metrics.read())
        self.status.stage_filters = stage_filters_from_log(self.metrics.read())
        self.status.last_checkpoint = str(latest)
        self._push_weights(policy, worker, version=state.global_step, folder=latest / "weights")
        return state

    def _stage_problems(self, stage: StageSpec, state: RunState, worker: Any) -> list[Problem]:
        problems = load_dataset(stage.dataset)
        by_id = {p.id: p for p in problems}
        if stage.name in state.stage_problems:  # filtered before a restart: keep that choice
            return [by_id[i] for i in state.stage_problems[stage.name] if i in by_id]
        k = stage.filter.drop_solved_k_of_k if stage.filter else None
        if k:
            problems = self._drop_solved(problems, stage, k, worker)
        state.stage_problems[stage.name] = [p.id for p in problems]
        return problems

    def _drop_solved(
        self, problems: list[Problem], stage: StageSpec, k: int, worker: Any
    ) -> list[Problem]:
        """Keep problems the current policy does not solve k of k (filter_unsolved), and say
        what was kept in the log and status.stageFilters."""
        import ray

        self._doing(f"filtering the problems of {stage.name}", self._rollout_components())

        request = training_rollouts(self.spec, stage, k)

        def solved(candidates: list[Problem]) -> dict[str, int]:
            trajectories, _ = ray.get(worker.rollout.remote(candidates, *request.arguments()))
            return solved_counts(trajectories)

        kept, evaluated = filter_unsolved(problems, stage, k, solved)
        result = StageFilterResult(stage=stage.name, k=k, evaluated=evaluated, kept=len(kept))
        self.metrics.append(stage_filter_entry(self.status.step, result))
        record_stage_filter(self.status, result)
        self.reporter.report(self.status)
        log.info("stage filter", extra={"fields": result.model_dump()})
        check_enough_problems(stage, result)
        return kept

    def _push_weights(
        self, policy: Policy, worker: Any, version: int, folder: Path | None = None
    ) -> Path:
        """Write the policy's weights (unless `folder` holds them already) and have every
        engine load them, from the folder or broadcast by the weight server; returns the
        folder, which a checkpoint of this step reuses."""
        import ray

        self._doing(
            f"pushing weights v{version}", f"the rollout scheduler {self.endpoints.scheduler}"
        )
        if folder is None:
            folder = policy.save_weights(self.weights_dir / f"v{version:06d}")  # collective
        if not self.world.main:
            return folder
        source = str(folder)
        if self._weight_server is not None:
            self._weight_server.publish(folder, version)
            source = self._weight_server.source
        pushed = ray.get(worker.update_weights.remote(source, version, self.spec.resilience))
        self._push_attempts = int(pushed.get("attempts", 1))
        self._weights = (source, version)
        # Engines have loaded it: older weight folders are no longer needed.
        for old in self.weights_dir.glob("v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        return folder

    def _checkpoint(
        self, policy: Policy, state: RunState, trainer: GrpoTrainer, weights: Path
    ) -> None:
        """`weights`: this step's folder, already pushed: linked, not gathered again."""
        self._doing(f"checkpointing step {state.global_step}", f"the volume at {self.checkpoints}")
        state.rng_state = trainer.rng.getstate()
        keep = self.spec.checkpoint.keep
        path = checkpoint.save(self.checkpoints, policy, state, keep, weights=weights)
        if not self.world.main:
            return
        self.status.last_checkpoint = str(path)
        self.reporter.report(self.status)

    def _record_step(self, stage: StageSpec, state: RunState, metrics: dict[str, float]) -> None:
        self.metrics.append(
            {
                "step": state.global_step,
                "stage": stage.name,
                "stage_step": state.stage_step,
                "time": round(time.time(), 3),  # when the step was done (Unix seconds)
                **metrics,
            }
        )
        self._steps_timed.append(metrics["step_seconds"])
        self._show_step(state.global_step, metrics)
        self.reporter.report(self.status)
        if self.progress:
            self.progress(stage.name, state.global_step, self.status.total_steps, metrics)

    def _show_step(self, step: int, metrics: dict[str, float]) -> None:
        """The status after step `step`: its metrics and the progress (the time left from
        the last five steps)."""
        recent = self._steps_timed[-5:]
        left = self.status.total_steps - step
        self.status.step = step
        self.status.metrics = status_metrics(metrics)
        self.status.progress = step_progress(
            step,
            self.status.total_steps,
            left * sum(recent) / len(recent) if recent else None,
            self.status.metrics,
        )
        set_rollouts_condition(self.status)

    def _show_logged_step(self, entries: list[dict[str, Any]], step: int | None = None) -> None:
        """The status at step `step` (default: the newest) of a metrics log's RL steps; step
        0 when there are none."""
        logged = [e for e in entries if "stage_step" in e]  # RL steps (_record_step's)
        if step is None:
            step = int(logged[-1]["step"]) if logged else 0
        logged = [e for e in logged if e["step"] <= step]
        self._steps_timed = [float(e["step_seconds"]) for e in logged]
        if not step:
            self.status.step = 0
            self.status.metrics = TrainingMetrics()
            self.status.progress = Progress()
            return
        entry = logged[-1] if logged and logged[-1]["step"] == step else {}
        if entry:
            self.status.stage = str(entry["stage"])
        numbers = {k: float(v) for k, v in entry.items() if isinstance(v, int | float)}
        self._show_step(step, numbers)

    def _evaluate(self, worker: Any, point: str) -> None:
        """Sampled agent-loop rollouts on the held-out problems (avg@k, pass@k), then, with
        evaluation.search, the same problems solved by test-time search; `point` says when
        (start, sft, step, end). Written to metrics.jsonl (the search's figures as
        `search_*`), evaluation-POINT.json (the search's trees to
        evaluation-POINT-search.jsonl) and status.evaluations."""
        import ray

        evaluation = self.spec.evaluation
        if evaluation.dataset is None or not self.world.main:
            return
        self._set_phase(Phase.EVALUATING, Reason.EVALUATING, f"held-out problems ({point})")
        self._doing(f"evaluating ({point})", self._rollout_components())
        problems = load_dataset(evaluation.dataset)
        request = evaluation_rollouts(self.spec)
        max_tokens = request.max_tokens
        started = time.monotonic()
        trajectories, stats = ray.get(worker.rollout.remote(problems, *request.arguments()))
        summary: dict[str, Any] = dict(evaluation_summary(trajectories))
        summary["problems"] = len(problems)
        summary["eval_samples"] = evaluation.samples
        summary["eval_temperature"] = evaluation.temperature
        summary["eval_pass_at_k"] = stats.pass_at_samples
        summary["generated_tokens_per_problem"] = sum(t.model_tokens for t in trajectories) / max(
            len(problems), 1
        )
        summary["seconds"] = round(time.monotonic() - started, 3)
        families = accuracy_by_family(problems, trajectories)
        if len(families) > 1:
            summary["families"] = families
        name = f"step-{self.status.step:06d}" if point == "step" else point
        if evaluation.search is not None:
            self._doing(
                f"searching the held-out problems ({point}, {evaluation.search.mode})",
                self._rollout_components(),
            )
            figures, trees = ray.get(worker.search.remote(problems, evaluation.search, max_tokens))
            summary.update(figures)
            with (self.run_dir / f"evaluation-{name}-search.jsonl").open("w") as out:
                out.writelines(json.dumps(tree) + "\n" for tree in trees)
        entry = {"step": self.status.step, "stage": "evaluation", "point": point, **summary}
        self.metrics.append(entry)
        (self.run_dir / f"evaluation-{name}.json").write_text(
            json.dumps(
                {
                    "summary": summary,
                    "trajectories": [t.to_dict(tokens=False) for t in trajectories],
                },
                indent=2,
                default=str,
            )
        )
        record_evaluation(self.status, evaluation_result(entry))
        self.reporter.report(self.status)

    def _start_rollout(
        self,
        worker: Any,
        stage: StageSpec,
        problems: list[Problem],
        request: RolloutRequest,
        step: int,
    ) -> Any:
        """Start the rollouts of the stage's step `step` on the Ray worker: its ref. First
        the scheduler is checked to serve the latest weights (a restart loses them)."""
        import ray

        problems = step_problems(problems, stage, step)
        if self._weights is not None:
            path, version = self._weights
            if ray.get(worker.ensure_weights.remote(path, version, self.spec.resilience)):
                self._pushed_again += 1
        return worker.rollout.remote(problems, *request.arguments())

    def _collect_rollout(self, ref: Any) -> tuple[list[Trajectory], Any]:
        import ray

        trajectories, stats = ray.get(ref)
        return trajectories, stats

    def _take_rollout(
        self, ahead: RolloutsAhead[Any, tuple[list[Trajectory], Any]], step: int
    ) -> tuple[list[Trajectory], Any]:
        """One attempt at a step's rollouts: the first takes those started for it (ahead,
        or now); one after a failure rolls them out again now."""
        self._doing(f"rolling out step {self.status.step + 1}", self._rollout_components())
        taken = ahead.again(step) if step in ahead.taken else ahead.take(step)
        (trajectories, stats), began = taken
        self._busy.append((began, began + stats.wall_s))
        return trajectories, stats

    def _rollout_components(self) -> str:
        return (
            f"the rollout scheduler {self.endpoints.scheduler} and the sandbox "
            f"{self.endpoints.sandbox}"
        )

    def _doing(self, what: str, waiting_on: str) -> None:
        """Say what the trainer does now: the operator's watchdog sees whether it moves on."""
        if not self.world.main:
            return
        self.status.activity = Activity(what=what, waiting_on=waiting_on, since=now())
        self.reporter.report(self.status)

    def _retrying(self, retry: RolloutRetry) -> None:
        """A step's rollout is thrown away for infrastructure failures: say so in status."""
        self.status.rollout_retry = retry
        set_rollouts_condition(self.status)
        self.reporter.report(self.status)

    def _set_phase(self, phase: Phase, reason: Reason, message: str) -> None:
        if not self.world.main:
            return
        set_phase(self.status, phase, reason, message)
        self.reporter.report(self.status)


def accuracy_by_family(problems: list[Problem], trajectories: list[Trajectory]) -> dict[str, float]:
    """Mean reward per problem source (the generator, or the mix entry, that made it)."""
    source = {problem.id: problem.source for problem in problems}
    rewards: dict[str, list[float]] = {}
    for trajectory in trajectories:
        family = source.get(trajectory.problem_id, "")
        rewards.setdefault(family, []).append(trajectory.reward or 0.0)
    return {family: sum(values) / len(values) for family, values in sorted(rewards.items())}


def evaluation_summary(trajectories: list[Trajectory]) -> dict[str, float]:
    from kubestar.training.trainer import rollout_metrics

    summary = rollout_metrics(trajectories)
    summary["eval_accuracy"] = summary.pop("accuracy")
    return summary
