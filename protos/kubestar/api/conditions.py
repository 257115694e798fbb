"""What the status of a kubestar resource says: phases, condition types and reasons, and
`condition()`, the one way the operator and the trainer build a condition.

These values are what users read in `kubectl get` and `kubectl describe` and what scripts and
alerts match on, so each is a named constant here rather than a string typed where it is
written. Reasons that Kubernetes itself reports and the operator passes on (a Job's
BackoffLimitExceeded, a kubelet's less common waiting reasons) stay plain strings; those the
operator looks for in pods are listed in `Reason`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Phase(StrEnum):
    """Where a TrainingRun is in its life (status.phase):

    Pending -> Provisioning -> (Evaluating) -> (SFT) -> Training -> (Evaluating) -> Succeeded,
    or Failed from any of them.
    """

    # Waiting for a valid spec, or for its RolloutFleet and SandboxPool to be Ready.
    PENDING = "Pending"
    # The trainer workload is being created or is starting.
    PROVISIONING = "Provisioning"
    # The trainer is evaluating the policy on held-out problems (spec.evaluation.at).
    EVALUATING = "Evaluating"
    # The trainer runs the non-reasoning SFT stage (spec.sft).
    SFT = "SFT"
    # The trainer runs the RL stages (spec.stages).
    TRAINING = "Training"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


# The phases the trainer reports itself; the operator owns Pending and Provisioning, and sets
# Succeeded or Failed from the trainer workload's outcome when the trainer could not.
TRAINER_PHASES = frozenset(
    {Phase.EVALUATING, Phase.SFT, Phase.TRAINING, Phase.SUCCEEDED, Phase.FAILED}
)
# Once a run reaches one of these, its phase never changes again.
TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """The conditions kubestar writes (status.conditions[].type)."""

    # SandboxPool, RolloutFleet: every replica is ready and the pool or fleet serves requests.
    READY = "Ready"
    # TrainingRun: the spec is valid and, once the trainer runs, unchanged since it started.
    SPEC_ACCEPTED = "SpecAccepted"
    # TrainingRun: its RolloutFleet and SandboxPool exist and are Ready.
    DEPENDENCIES_READY = "DependenciesReady"
    # TrainingRun: the trainer workload (a Job per trainer worker) is running.
    TRAINER_READY = "TrainerReady"
    # TrainingRun run locally (`kubestar train -f`): the trainer is making progress.
    PROGRESSING = "Progressing"
    # TrainingRun: the latest step trained on its rollouts; False while a step is rolled out
    # again because engine, scheduler or sandbox failures spoiled too many trajectories.
    ROLLOUTS_HEALTHY = "RolloutsHealthy"
    # TrainingRun: True when the trainer's activity (status.activity) has not moved on for
    # spec.resilience.stallSeconds; the message names it and the component it waits on.
    STALLED = "Stalled"


class Reason(StrEnum):
    """Why a condition has its status (status.conditions[].reason). The operator also posts
    an Event with this reason each time a condition's status or reason changes."""

    # Any resource.
    READY = "Ready"
    # Replicas are starting and nothing is wrong with them yet.
    PROGRESSING = "Progressing"
    # spec.replicas is 0.
    NO_REPLICAS = "NoReplicas"
    # The spec fails validation; the message names each field.
    INVALID_SPEC = "InvalidSpec"
    # An object the operator would create exists and belongs to someone else.
    CHILD_CONFLICT = "ChildConflict"
    # The API server refused an object the operator applied.
    APPLY_FAILED = "ApplyFailed"

    # What is wrong with a pod, as kubestar.operator.conditions.diagnose finds it.
    OOM_KILLED = "OOMKilled"
    CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
    IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
    ERR_IMAGE_PULL = "ErrImagePull"
    ERR_IMAGE_NEVER_PULL = "ErrImageNeverPull"
    INVALID_IMAGE_NAME = "InvalidImageName"
    CREATE_CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
    CREATE_CONTAINER_ERROR = "CreateContainerError"
    RUN_CONTAINER_ERROR = "RunContainerError"
    # No node has a free GPU of the kind the pod asks for.
    INSUFFICIENT_GPU = "InsufficientGPU"
    UNSCHEDULABLE = "Unschedulable"
    # A controller's pod was refused by the API server (a quota, an admission policy): the
    # Job's FailedCreate event, whose message says by what.
    FAILED_CREATE = "FailedCreate"
    # A container exited with a non-zero code.
    CONTAINER_ERROR = "Error"
    # The rollout scheduler took engines out of rotation although their pods are ready (a
    # weight reload that did not finish in time, say): the message names each and why.
    ENGINES_TAKEN_OUT = "EnginesTakenOut"
    # A sandbox worker cannot set up the isolation spec.isolation asks for (its termination
    # message, passed on, names the namespace, the failed system call and why).
    ISOLATION_UNAVAILABLE = "IsolationUnavailable"
    # A trainer rank or an engine given GPUs (its resources) whose torch sees fewer, or is a
    # CPU-only build or the other vendor's: the message names what it was given and what it
    # saw (kubestar.common.accelerators). A trainer's run fails at once (no retry).
    ACCELERATOR_UNAVAILABLE = "AcceleratorUnavailable"

    # TrainingRun, SpecAccepted.
    ACCEPTED = "Accepted"
    # The spec changed after the trainer started with it.
    SPEC_CHANGE_REFUSED = "SpecChangeRefused"

    # TrainingRun, DependenciesReady.
    ROLLOUT_FLEET_NOT_FOUND = "RolloutFleetNotFound"
    SANDBOX_POOL_NOT_FOUND = "SandboxPoolNotFound"
    ROLLOUT_FLEET_NOT_READY = "RolloutFleetNotReady"
    SANDBOX_POOL_NOT_READY = "SandboxPoolNotReady"

    # TrainingRun, TrainerReady.
    WAITING_FOR_DEPENDENCIES = "WaitingForDependencies"
    CREATING = "Creating"
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    # The run is over and its trainer workload is gone.
    FINISHED = "Finished"
    JOB_FAILED = "JobFailed"
    # Events' reasons: the operator created the trainer workload; it scaled a failed run's
    # unfinished trainer Jobs to no pods.
    TRAINER_CREATED = "TrainerCreated"
    TRAINER_STOPPED = "TrainerStopped"

    # TrainingRun, Progressing (written by the trainer).
    EVALUATING = "Evaluating"
    SUPERVISED_FINE_TUNING = "SupervisedFineTuning"
    TRAINING = "Training"
    COMPLETED = "Completed"
    # The trainer raised; the message names the exception.
    TRAINER_ERROR = "TrainerError"
    # The checkpoint volume is full (ENOSPC or EDQUOT while writing a checkpoint): the run
    # fails (no retry), the partial checkpoint removed; the message names the folder, its
    # volume, the space left and what to do. On a cluster the trainer states it in its
    # termination message, which the operator passes on in TrainerReady.
    CHECKPOINT_VOLUME_FULL = "CheckpointVolumeFull"

    # A stage's filter (dropSolvedKOfK) left fewer problems than one step takes.
    TOO_FEW_PROBLEMS = "TooFewProblems"

    # TrainingRun, Stalled.
    NO_PROGRESS = "NoProgress"
    MAKING_PROGRESS = "MakingProgress"

    # TrainingRun, RolloutsHealthy.
    HEALTHY = "Healthy"
    # Engine, scheduler or sandbox failures spoiled more of a step's trajectories than
    # spec.resilience.maxInfraFailureFraction allows: rolled out again, or the run failed.
    INFRASTRUCTURE_FAILURES = "InfrastructureFailures"


class Condition(BaseModel):
    """One observation of the resource's state, as metav1.Condition: a type, a status, and a
    reason and message that say why."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    type: ConditionType = Field(
        description="What the condition is about: Ready (SandboxPool, RolloutFleet); "
        "SpecAccepted, DependenciesReady, TrainerReady, Progressing, RolloutsHealthy or "
        "Stalled (TrainingRun)."
    )
    status: ConditionStatus = Field(
        description="True, False or Unknown: whether the condition holds."
    )
    reason: str = Field(
        description="Why the condition has its status, in CamelCase, e.g. Ready, Progressing, "
        "ImagePullBackOff, OOMKilled, InsufficientGPU, RolloutFleetNotReady."
    )
    message: str = Field(
        "",
        description="What a person needs to know, e.g. which pod and container is failing, "
        "the image that cannot be pulled, or the field that is invalid.",
    )
    last_transition_time: str = Field(
        "",
        description="When the status last changed (RFC 3339, UTC). A new reason or message "
        "with the same status keeps it.",
    )
    observed_generation: int = Field(
        0, description="The metadata.generation of the spec this condition was computed from."
    )


def now() -> str:
    """The current time as conditions write it (RFC 3339, UTC, whole seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: ConditionType,
    status: bool | ConditionStatus,
    reason: str,
    message: str = "",
    generation: int = 0,
) -> Condition:
    """A condition stamped with the current time. `reason` is a `Reason`, or a reason
    Kubernetes reported that is passed on as it is."""
    if isinstance(status, bool):
        status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=now(),
    )
