"""TrainingRun: waits for its RolloutFleet and SandboxPool to be Ready, then starts the
trainer (one Job per worker and the headless Service where the workers meet, see
kubestar.operator.build_trainer). The trainer patches stage, step, metrics, checkpoint and
time left into the status (see kubestar.api.trainer_contract); the operator owns the
conditions and the phases Pending and Provisioning, fails the run when a trainer Job fails,
and refuses (with a condition) spec changes once the trainer runs: the trainer read its spec
when it started.

    Pending -> Provisioning -> (SFT) -> Training -> Succeeded | Failed

A reconcile observes (the run's ConfigMap, Jobs and pods), admits (the spec validated,
frozen once the trainer runs, checked against the cluster's policy, its children applied),
decides (pure: phase, conditions, whether to start) and acts (stops a failed run's Jobs,
starts the trainer, writes the status).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml
from kubestar.api.conditions import (
    TERMINAL_PHASES,
    TRAINER_PHASES,
    Condition,
    ConditionStatus,
    ConditionType,
    Phase,
    Reason,
    condition,
)
from kubestar.api.trainer_contract import rollouts_condition
from kubestar.api.v1alpha1 import (
    GROUP,
    VERSION,
    Activity,
    RolloutRetry,
    SandboxPoolSpec,
    TrainingRunSpec,
    TrainingRunStatus,
)
from kubestar.common import kube as k
from kubestar.operator import build_trainer, metrics, rolloutfleet
from kubestar.operator import conditions as cond
from kubestar.operator import objects as o
from kubestar.operator.reconciler import ChildConflict, Context, Problem, validation_message
from kubestar.operator.settings import OperatorSettings
from pydantic import ValidationError

KIND = "TrainingRun"
ObjT = TypeVar("ObjT", bound=Mapping[str, Any])


def diff_paths(old: Any, new: Any, prefix: str = "spec") -> list[str]:
    """Paths where two JSON values differ (lists compared element by element)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += diff_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out += diff_paths(a, b, f"{prefix}[{i}]")
        return out
    return [] if old == new else [prefix]


def accepted_spec(config_map: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The spec the trainer was started with (run.yaml in the run's ConfigMap)."""
    if not config_map:
        return None
    text = (config_map.get("data") or {}).get("run.yaml")
    if not text:
        return None
    document = yaml.safe_load(text) or {}
    spec: dict[str, Any] | None = document.get("spec")
    return spec


def _ready(obj: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return cond.find((obj or {}).get("status", {}).get("conditions"), ConditionType.READY)


def dependencies(
    spec: TrainingRunSpec,
    namespace: str,
    fleet: Mapping[str, Any] | None,
    pool: Mapping[str, Any] | None,
    generation: int,
) -> tuple[Condition, bool]:
    """(DependenciesReady condition, whether both exist)."""
    missing = []
    if fleet is None:
        missing.append(
            (Reason.ROLLOUT_FLEET_NOT_FOUND, f"RolloutFleet {spec.rollout_fleet_ref.name}")
        )
    if pool is None:
        missing.append((Reason.SANDBOX_POOL_NOT_FOUND, f"SandboxPool {spec.sandbox_pool_ref.name}"))
    if missing:
        message = " and ".join(what for _, what in missing) + f" not found in {namespace}"
        deps = condition(
            ConditionType.DEPENDENCIES_READY, False, missing[0][0], message, generation
        )
        return deps, False
    waiting = []
    for kind, reason, obj in (
        ("RolloutFleet", Reason.ROLLOUT_FLEET_NOT_READY, fleet),
        ("SandboxPool", Reason.SANDBOX_POOL_NOT_READY, pool),
    ):
        ready = _ready(obj)
        if ready is None or ready.get("status") != ConditionStatus.TRUE:
            detail = f"{ready['reason']}: {ready.get('message', '')}" if ready else "no status yet"
            waiting.append(
                (
                    reason,
                    f"{kind} {obj['metadata']['name'] if obj else '?'} is not "
                    f"ready ({detail.rstrip(': ')})",
                )
            )
    if waiting:
        return (
            condition(
                ConditionType.DEPENDENCIES_READY,
                False,
                waiting[0][0],
                "; ".join(message for _, message in waiting),
                generation,
            ),
            True,
        )
    message = (
        f"RolloutFleet {spec.rollout_fleet_ref.name} and SandboxPool "
        f"{spec.sandbox_pool_ref.name} are ready"
    )
    return condition(
        ConditionType.DEPENDENCIES_READY, True, Reason.READY, message, generation
    ), True


@dataclass
class Outcome:
    """What the trainer workload says: running, succeeded, failed (with why)."""

    state: str  # absent, starting, running, succeeded, failed
    reason: str = ""
    message: str = ""


def job_outcome(job: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> Outcome:
    if job is None:
        return Outcome("absent")
    status = job.get("status") or {}
    problems = cond.diagnose(pods)
    reason, message = cond.summarize(problems)
    for item in status.get("conditions") or []:
        if item.get("status") != ConditionStatus.TRUE:
            continue
        if item.get("type") == "Complete":
            return Outcome("succeeded", Reason.SUCCEEDED, "the trainer Job completed")
        if item.get("type") == "Failed":
            job_reason = item.get("reason") or Reason.JOB_FAILED
            detail = message or item.get("message", "")
            return Outcome(
                "failed",
                reason or job_reason,
                f"trainer Job failed ({job_reason}): {detail}".rstrip(": "),
            )
    if status.get("succeeded"):
        return Outcome("succeeded", Reason.SUCCEEDED, "the trainer Job completed")
    if reason in cond.FINAL_REASONS:
        # What a retry cannot fix (a full volume stays full): the run fails now, also where
        # the Job itself would retry (no podFailurePolicy before Kubernetes 1.26).
        return Outcome("failed", reason, f"trainer pod failed: {message}")
    if reason:
        return Outcome("starting", reason, message)
    if any(k.pod_ready(pod) for pod in pods):
        return Outcome("running", Reason.RUNNING, "the trainer pod is running")
    return Outcome("starting", Reason.STARTING, "the trainer pod is starting")


def workers_outcome(
    jobs: Sequence[Mapping[str, Any] | None],
    pods: Sequence[Mapping[str, Any]],
    refused: Mapping[str, str] | None = None,
) -> Outcome:
    """The trainer's outcome from its workers' Jobs (worker 0 first): failed when one
    failed, succeeded when all completed, running when all run. `refused`: Job name -> why
    the API server refused its pod (a FailedCreate event), for Jobs that have no pod."""
    if all(job is None for job in jobs):
        return Outcome("absent")
    outcomes: list[Outcome] = []
    for worker, job in enumerate(jobs):
        if job is None:  # created a moment ago, or deleted by hand (then it stays starting)
            outcomes.append(Outcome("starting", Reason.STARTING, "creating the trainer's Jobs"))
            continue
        uid = job["metadata"].get("uid", "")
        own_pods = [pod for pod in pods if own(pod, uid)]
        outcome = job_outcome(job, own_pods)
        why = (refused or {}).get(job["metadata"].get("name", ""))
        if why and not own_pods and outcome.state == "starting":
            outcome = Outcome("starting", Reason.FAILED_CREATE, f"the pod was refused: {why}")
        if len(jobs) > 1 and outcome.message:
            outcome.message = f"worker {worker}: {outcome.message}"
        outcomes.append(outcome)
    for state in ("failed", "starting"):
        for outcome in outcomes:
            if outcome.state == state:
                return outcome
    if all(outcome.state == "succeeded" for outcome in outcomes):
        return outcomes[0]
    if len(jobs) == 1:
        return outcomes[0]
    running = sum(outcome.state == "running" for outcome in outcomes)
    return Outcome("running", Reason.RUNNING, f"{running} of {len(jobs)} trainer pods running")


@dataclass
class Decision:
    phase: Phase
    conditions: list[Condition] = field(default_factory=list)
    start: bool = False


def decide(
    phase_now: str,
    generation: int,
    spec_problem: tuple[str, str] | None,
    deps: Condition | None,
    deps_exist: bool,
    outcome: Outcome,
) -> Decision:
    """The phase, conditions and whether to start the trainer (pure).

    spec_problem: (reason, message) for an invalid spec or a refused change.
    """
    accepted = ConditionType.SPEC_ACCEPTED
    conditions: list[Condition] = []
    if spec_problem:
        conditions.append(condition(accepted, False, *spec_problem, generation))
    else:
        conditions.append(condition(accepted, True, Reason.ACCEPTED, "", generation))
    if deps is not None:
        conditions.append(deps)
    deps_ready = deps is not None and deps.status == ConditionStatus.TRUE
    # An invalid spec, or a child of the run's name that is not the run's (a service account
    # the trainer would run as, say): the trainer does not start.
    invalid = (
        spec_problem is not None
        and spec_problem[0] in (Reason.INVALID_SPEC, Reason.CHILD_CONFLICT)
        and (outcome.state == "absent")
    )

    # Terminal phases stick, and the trainer's own phases are kept while its workload lives
    # (membership is checked before Phase(phase_now), so that cannot fail).
    phase: Phase
    if phase_now in TERMINAL_PHASES:
        phase = Phase(phase_now)
    elif outcome.state == "succeeded":
        phase = Phase.SUCCEEDED
    elif outcome.state == "failed":
        phase = Phase.FAILED
    elif phase_now in TRAINER_PHASES and outcome.state != "absent":
        phase = Phase(phase_now)
    elif outcome.state != "absent":
        phase = Phase.PROVISIONING
    elif invalid or not deps_exist:
        phase = Phase.PENDING
    else:
        phase = Phase.PROVISIONING

    start = (
        outcome.state == "absent" and phase not in TERMINAL_PHASES and deps_ready and not invalid
    )
    trainer_ready = ConditionType.TRAINER_READY
    if outcome.state == "absent":
        if phase in TERMINAL_PHASES:
            trainer = condition(
                trainer_ready, False, Reason.FINISHED, "the run is over", generation
            )
        elif start:
            trainer = condition(
                trainer_ready, False, Reason.CREATING, "creating the trainer", generation
            )
        else:
            trainer = condition(
                trainer_ready,
                False,
                Reason.WAITING_FOR_DEPENDENCIES,
                "the trainer starts when the fleet and pool are ready",
                generation,
            )
    elif phase in TERMINAL_PHASES and outcome.state in ("starting", "running"):
        # The trainer reported the end itself and its pod is exiting (or was stopped): the
        # pod's termination message, once it has one, says why (the branch below).
        trainer = condition(trainer_ready, False, Reason.FINISHED, "the run is over", generation)
    else:
        trainer = condition(
            trainer_ready, outcome.state == "running", outcome.reason, outcome.message, generation
        )
    conditions.append(trainer)
    return Decision(phase, conditions, start)


def own(obj: ObjT | None, owner_uid: str) -> ObjT | None:
    """The object if `owner_uid` is among its owners, else None."""
    if obj is None:
        return None
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return obj if any(ref.get("uid") == owner_uid for ref in refs) else None


def reported_status(run: Mapping[str, Any]) -> TrainingRunStatus:
    """What the trainer reported that the operator's conditions read (the rest of the live
    status is the operator's own)."""
    live = run.get("status") or {}
    retry = live.get("rolloutRetry")
    activity = live.get("activity")
    return TrainingRunStatus(
        step=int(live.get("step") or 0),
        rollout_retry=RolloutRetry.model_validate(retry) if retry else None,
        activity=Activity.model_validate(activity) if activity else None,
    )


def stalled_condition(
    activity: Activity, unchanged_seconds: float, stall_seconds: float, generation: int
) -> Condition:
    """Stalled, from how long the trainer's activity has not moved on (pure)."""
    doing = activity.what + (f", waiting on {activity.waiting_on}" if activity.waiting_on else "")
    if unchanged_seconds > stall_seconds:
        return condition(
            ConditionType.STALLED,
            True,
            Reason.NO_PROGRESS,
            f"no progress for {unchanged_seconds:.0f} s (spec.resilience.stallSeconds is "
            f"{stall_seconds:g}): {doing}",
            generation,
        )
    return condition(ConditionType.STALLED, False, Reason.MAKING_PROGRESS, doing, generation)


def watchdog(
    ctx: Context,
    run: Mapping[str, Any],
    phase: Phase,
    reported: TrainingRunStatus,
    spec: TrainingRunSpec,
    generation: int,
) -> Condition | None:
    """The Stalled condition while the trainer works. Time is this operator's own: how long
    it has seen the same activity (the trainer's clock may be off), so a restarted operator
    starts counting again."""
    meta = run["metadata"]
    key = (meta["namespace"], meta["name"])
    activity = reported.activity
    if activity is None or phase not in TRAINER_PHASES or phase in TERMINAL_PHASES:
        ctx.activities.pop(key, None)
        return None
    seen = activity.model_dump_json()
    now = time.monotonic()
    first = ctx.activities.get(key)
    if first is None or first[0] != seen:
        ctx.activities[key] = first = (seen, now)
    return stalled_condition(activity, now - first[1], spec.resilience.stall_seconds, generation)


def step_summary(status: Mapping[str, Any]) -> str:
    total = status.get("totalSteps") or 0
    return f"{status.get('step') or 0}/{total}" if total else ""


# --- reconcile: observe, admit, decide (pure), act ---------------------------------------


@dataclass
class Observed:
    """What the cluster says of the run's trainer. Children of an earlier run of the same
    name (deleted, not yet garbage-collected) are not this run's and are left out: their
    outcome must not end this run."""

    # The spec the trainer was started with (run.yaml in the run's ConfigMap), else None.
    accepted: dict[str, Any] | None
    job_names: list[str]
    # The run's own Jobs, worker 0 first (None where there is none).
    jobs: list[o.Obj | None]
    pods: list[o.Obj] = field(default_factory=list)
    # Job name -> why the API server refused its pod, for Jobs that have no pod.
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def started(self) -> bool:
        return any(job is not None for job in self.jobs)


@dataclass
class Admission:
    """The spec the run goes on with, and the problem with the one asked for: invalid,
    refused by the cluster's policy, a change refused once the trainer runs, or a child of
    the run's name that is not the run's. `spec` is None when there is nothing to go on with
    (an invalid spec, never started)."""

    spec: TrainingRunSpec | None
    problem: Problem | None = None


async def reconcile(ctx: Context, run: dict[str, Any]) -> None:
    parsed = parse(run)
    observed = await observe(ctx, run, parsed)
    admission = await admit(ctx, run, parsed, observed)
    if admission.spec is None:
        generation = run["metadata"].get("generation", 0)
        decision = decide(
            phase_of(run), generation, admission.problem, None, False, Outcome("absent")
        )
        await write(ctx, run, decision, run_status(run, decision.phase))
        return
    fleet, pool = await observe_dependencies(ctx, run, admission.spec)
    decision = decide_run(run, admission, observed, fleet, pool)
    await act(ctx, run, admission.spec, observed, fleet, pool, decision)


def parse(run: Mapping[str, Any]) -> TrainingRunSpec | Problem:
    """The run's spec, or why it is invalid."""
    try:
        return TrainingRunSpec.model_validate(run.get("spec") or {})
    except ValidationError as error:
        return Reason.INVALID_SPEC, validation_message(error)


def phase_of(run: Mapping[str, Any]) -> str:
    return str((run.get("status") or {}).get("phase") or Phase.PENDING)


async def observe(
    ctx: Context, run: Mapping[str, Any], parsed: TrainingRunSpec | Problem
) -> Observed:
    """The run's ConfigMap (the spec its trainer started with), its Jobs, their pods and why
    any Job has none."""
    meta = run["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid", "")
    config = own(
        await ctx.kube.get(k.path("v1", "ConfigMap", namespace, build_trainer.config_name(name))),
        uid,
    )
    accepted = accepted_spec(config)
    if accepted is not None:
        workers = int((accepted.get("trainer") or {}).get("workers", 1))
    else:
        workers = parsed.trainer.workers if isinstance(parsed, TrainingRunSpec) else 1
    job_names = [build_trainer.worker_name(name, worker) for worker in range(workers)]
    found = await asyncio.gather(
        *(ctx.kube.get(k.path("batch/v1", "Job", namespace, job)) for job in job_names)
    )
    observed = Observed(accepted, job_names, [own(job, uid) for job in found])
    if observed.started:
        observed.pods = await ctx.pods(run)
        podless = [
            job["metadata"]["name"]
            for job in observed.jobs
            if job is not None
            and not any(own(pod, job["metadata"].get("uid", "")) for pod in observed.pods)
        ]
        if podless:
            observed.refused = await ctx.refusals(namespace, "Job", podless)
    return observed


def admitted_spec(
    parsed: TrainingRunSpec | Problem, observed: Observed, settings: OperatorSettings
) -> Admission:
    """Which spec the run goes on with (pure). Once the trainer runs, its spec is the one in
    run.yaml: an invalid spec or a change is refused and the accepted spec kept."""
    accepted = observed.accepted if observed.started else None
    if not isinstance(parsed, TrainingRunSpec):
        if accepted is None:
            return Admission(None, parsed)
        reason, message = parsed
        kept = f"{message} (the trainer keeps the spec it started with)"
        return Admission(TrainingRunSpec.model_validate(accepted), (reason, kept))
    if accepted is not None:
        current = parsed.model_dump(mode="json", by_alias=True)
        if accepted == current:
            return Admission(parsed)
        changed = diff_paths(accepted, current)
        return Admission(
            TrainingRunSpec.model_validate(accepted),
            (
                Reason.SPEC_CHANGE_REFUSED,
                f"the trainer is running with the spec it started with; cannot change "
                f"{', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''} "
                "(revert the change, or create a new TrainingRun)",
            ),
        )
    if not observed.started and (refused := build_trainer.spec_problem(parsed, settings)):
        return Admission(parsed, (Reason.INVALID_SPEC, refused))
    return Admission(parsed)


def run_children(
    run: Mapping[str, Any], spec: TrainingRunSpec, settings: OperatorSettings
) -> list[o.Obj]:
    """The children the run has before its trainer: the trainer's spec, its identity, its
    metrics' Service and ConfigMap, its token, its network policies (the checkpoint claim
    apart: never updated)."""
    return [
        build_trainer.config_map(run, spec),
        *build_trainer.rbac(run),
        *build_trainer.telemetry(run, settings),
        *build_trainer.auth(run, settings),
        *build_trainer.network_policies(run, spec, settings),
    ]


async def admit(
    ctx: Context, run: Mapping[str, Any], parsed: TrainingRunSpec | Problem, observed: Observed
) -> Admission:
    """The ladder validate -> policy -> apply -> conflict of kubestar.operator.reconciler,
    the problem going to the SpecAccepted condition (`decide`) rather than Ready: the spec
    admitted (admitted_spec), then its children applied (a conflict is the problem now)."""
    admission = admitted_spec(parsed, observed, ctx.settings)
    if admission.spec is None:
        return admission
    claim = build_trainer.checkpoint_claim(run, admission.spec, ctx.settings)
    # Never updated: a claim's size and class are fixed once bound.
    conflict = await ctx.apply_children(
        run,
        run_children(run, admission.spec, ctx.settings),
        immutable=[claim] if claim is not None else [],
    )
    if conflict is not None:
        admission.problem = conflict
    return admission


async def observe_dependencies(
    ctx: Context, run: Mapping[str, Any], spec: TrainingRunSpec
) -> tuple[o.Obj | None, o.Obj | None]:
    """The run's RolloutFleet and SandboxPool, or None where absent."""
    namespace = run["metadata"]["namespace"]
    api_version = f"{GROUP}/{VERSION}"
    fleet, pool = await asyncio.gather(
        ctx.kube.get(k.path(api_version, "RolloutFleet", namespace, spec.rollout_fleet_ref.name)),
        ctx.kube.get(k.path(api_version, "SandboxPool", namespace, spec.sandbox_pool_ref.name)),
    )
    return fleet, pool


def decide_run(
    run: Mapping[str, Any],
    admission: Admission,
    observed: Observed,
    fleet: Mapping[str, Any] | None,
    pool: Mapping[str, Any] | None,
) -> Decision:
    """The phase, conditions and whether to start the trainer, from what was observed and
    admitted (pure): `decide`, with the trainer's RolloutsHealthy."""
    assert admission.spec is not None
    meta = run["metadata"]
    generation = meta.get("generation", 0)
    deps, deps_exist = dependencies(admission.spec, meta["namespace"], fleet, pool, generation)
    outcome = workers_outcome(observed.jobs, observed.pods, observed.refused)
    decision = decide(phase_of(run), generation, admission.problem, deps, deps_exist, outcome)
    rollouts = rollouts_condition(reported_status(run), generation)
    if rollouts is not None:
        decision.conditions.append(rollouts)
    return decision


def run_status(
    run: Mapping[str, Any],
    phase: Phase,
    spec: TrainingRunSpec | None = None,
    observed: Observed | None = None,
    started: bool = False,
) -> TrainingRunStatus:
    """What the operator writes of the status (pure): the phase and, once the trainer was
    created (`observed.started`, or `started` just now), its Jobs, its world size and, while
    worker 0's pod lives, the rendezvous address."""
    status = TrainingRunStatus(
        phase=phase,
        observed_generation=run["metadata"].get("generation", 0),
        step_summary=step_summary(run.get("status") or {}),
    )
    if spec is None or observed is None or not (started or observed.started):
        return status
    status.trainer = ",".join(f"Job/{job}" for job in observed.job_names)
    status.world_size = build_trainer.world_size(spec)
    worker_0 = observed.jobs[0]
    if worker_0 is not None and status.world_size > 1:
        uid = worker_0["metadata"].get("uid", "")
        status.rendezvous_address = build_trainer.rendezvous_pod_address(
            [pod for pod in observed.pods if own(pod, uid)]
        )
    return status


async def act(
    ctx: Context,
    run: dict[str, Any],
    spec: TrainingRunSpec,
    observed: Observed,
    fleet: Mapping[str, Any] | None,
    pool: Mapping[str, Any] | None,
    decision: Decision,
) -> None:
    """Stop a failed run's Jobs, watch for a stall, start the trainer when `decision` says
    so, and write the status."""
    generation = run["metadata"].get("generation", 0)
    if decision.phase == Phase.FAILED:
        jobs = [job for job in observed.jobs if job is not None]
        if trainer_exiting(ctx, run, observed):
            await stop_retries(ctx, jobs)
        else:
            await stop_jobs(ctx, run, jobs)
    stalled = watchdog(ctx, run, decision.phase, reported_status(run), spec, generation)
    if stalled is not None:
        decision.conditions.append(stalled)
    if not (decision.start and fleet is not None and pool is not None):
        await write(ctx, run, decision, run_status(run, decision.phase, spec, observed))
        return
    workloads = await trainer_workloads(ctx, run, spec, fleet, pool)
    try:
        await create_trainer(ctx, run, workloads)
    except (k.ApiError, ChildConflict) as error:
        conflict = isinstance(error, ChildConflict)
        reason = Reason.CHILD_CONFLICT if conflict else Reason.APPLY_FAILED
        message = error.message if isinstance(error, k.ApiError) else str(error)
        failed = condition(ConditionType.TRAINER_READY, False, reason, message[:500], generation)
        decision.conditions = [
            failed if c.type == ConditionType.TRAINER_READY else c for c in decision.conditions
        ]
        await write(ctx, run, decision, run_status(run, decision.phase, spec, observed))
        if conflict:
            return
        raise
    decision.phase = Phase.PROVISIONING
    await write(ctx, run, decision, run_status(run, decision.phase, spec, observed, started=True))


async def trainer_workloads(
    ctx: Context,
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: Mapping[str, Any],
    pool: Mapping[str, Any],
) -> list[o.Obj]:
    """The trainer: a Job per worker, after the headless Service where they meet."""
    settings = ctx.settings
    fleet_spec = rolloutfleet.fleet_spec(fleet, settings)
    pool_spec = SandboxPoolSpec.model_validate(pool.get("spec") or {})
    version = await ctx.server_version()
    workloads = build_trainer.jobs(run, spec, fleet_spec, pool_spec, settings, version)
    if build_trainer.world_size(spec) > 1:
        workloads.insert(0, build_trainer.rendezvous_service(run, settings))
    return workloads


async def create_trainer(ctx: Context, run: Mapping[str, Any], workloads: list[o.Obj]) -> None:
    """Create the trainer's workloads (never updated after), an Event for each created."""
    for workload in workloads:
        applied = await ctx.apply(run, workload, immutable=True)
        if applied.action == "created":
            await ctx.event(
                run,
                Reason.TRAINER_CREATED,
                f"created {workload['kind']} {workload['metadata']['name']}",
            )


def finished(job: Mapping[str, Any]) -> bool:
    return any(
        item.get("type") in ("Complete", "Failed") and item.get("status") == ConditionStatus.TRUE
        for item in (job.get("status") or {}).get("conditions") or []
    )


# How long a trainer that reported the run Failed itself is given to exit on its own. It states
# why in its termination message as it exits; scaling its Job first would kill it before that
# (meanwhile its Job is told not to retry: stop_retries).
TRAINER_EXIT_GRACE_SECONDS = 60.0


def trainer_exiting(ctx: Context, run: Mapping[str, Any], observed: Observed) -> bool:
    """Whether a failed run's trainer is still exiting on its own: no pod has failed yet, one
    still runs, and the operator first saw that less than TRAINER_EXIT_GRACE_SECONDS ago
    (its own clock: a restarted operator waits again)."""
    meta = run["metadata"]
    key = (meta["namespace"], meta["name"])
    outcome = workers_outcome(observed.jobs, observed.pods, observed.refused)
    running = any((pod.get("status") or {}).get("phase") == "Running" for pod in observed.pods)
    if outcome.state == "failed" or not running:
        ctx.exiting.pop(key, None)
        return False
    now = time.monotonic()
    first = ctx.exiting.setdefault(key, now)
    return now - first < TRAINER_EXIT_GRACE_SECONDS


async def stop_retries(ctx: Context, jobs: Sequence[Mapping[str, Any]]) -> None:
    """A failed run's trainer Jobs fail at their pods' exit instead of retrying (backoffLimit
    0), leaving the exiting trainer be (podFailurePolicy does this on Kubernetes 1.26+)."""
    for job in jobs:
        if finished(job) or (job.get("spec") or {}).get("backoffLimit") == 0:
            continue
        meta = job["metadata"]
        await ctx.kube.merge_patch(
            k.path("batch/v1", "Job", meta["namespace"], meta["name"]),
            {"spec": {"backoffLimit": 0}},
        )


async def stop_jobs(
    ctx: Context, run: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]]
) -> None:
    """A failed run's trainer Jobs that still run or retry are scaled to no pods (their
    other workers would wait for the failed one; a retry would fail the same way). Scaled,
    not deleted: the pods' logs and the Jobs' history stay for `kubectl describe`."""
    for job in jobs:
        if finished(job) or (job.get("spec") or {}).get("parallelism") == 0:
            continue
        meta = job["metadata"]
        await ctx.kube.merge_patch(
            k.path("batch/v1", "Job", meta["namespace"], meta["name"]), {"spec": {"parallelism": 0}}
        )
        await ctx.event(
            run,
            Reason.TRAINER_STOPPED,
            f"scaled Job {meta['name']} to no pods: the run failed",
        )


async def write(
    ctx: Context, run: dict[str, Any], decision: Decision, status: TrainingRunStatus
) -> None:
    """The status and the decision's conditions; an Event and a metric per phase change."""
    meta = run["metadata"]
    before = (run.get("status") or {}).get("phase")
    await ctx.set_conditions(run, decision.conditions, status)
    key = (meta["namespace"], meta["name"])
    seen = ctx.phases.get(key, before)
    if decision.phase != seen:
        metrics.TRANSITIONS.labels(decision.phase).inc()
        warning = decision.phase == Phase.FAILED
        await ctx.event(
            run,
            decision.phase,
            f"phase {seen or 'none'} -> {decision.phase}",
            "Warning" if warning else "Normal",
        )
    ctx.phases[key] = decision.phase
