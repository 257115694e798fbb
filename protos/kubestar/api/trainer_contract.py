"""The trainer contract: what the operator gives the trainer pod, and how it reports back.

Each trainer pod (one Job per worker: `<run>-trainer` is worker 0, `<run>-trainer-N` worker
N) runs

    kubestar train -f /etc/kubestar/run.yaml --in-cluster

with this environment (names are the constants below):

| variable | value |
|---|---|
| KUBESTAR_TRAININGRUN_NAME / _NAMESPACE | the TrainingRun whose status it patches |
| KUBESTAR_RUN_CONFIG | /etc/kubestar/run.yaml: the TrainingRun manifest (spec with defaults) |
| KUBESTAR_SCHEDULER_ENDPOINT | HOST:PORT of the fleet's rollout scheduler (gRPC) |
| KUBESTAR_SANDBOX_ENDPOINT | HOST:PORT of the pool's sandbox dispatcher (gRPC) |
| KUBESTAR_SANDBOX_LIMITS | JSON of the pool's per-call limits (timeoutSeconds, memoryMib, ...) |
| KUBESTAR_CHECKPOINT_DIR | where checkpoints go (a PVC when spec.checkpoint.pvcClaimName is set; |
|   | else checkpointDir/NAMESPACE/NAME on trainer.sharedCheckpoints, mounted by the engines too) |
| KUBESTAR_CHECKPOINT_VOLUME | what holds that folder, in words (a claim's name, the shared |
|   | volume, an emptyDir): a full volume's message names it |
| KUBESTAR_TRAINER_WORKERS | spec.trainer.workers: pods in the training world |
| KUBESTAR_TRAINER_WORKER_INDEX | this pod's index, 0..workers-1; its first process is rank |
|   | index x processesPerWorker |
| KUBESTAR_TRAINER_PROCESSES | spec.trainer.processesPerWorker: training processes in this pod |
| KUBESTAR_TRAINER_RENDEZVOUS | HOST:PORT of worker 0's rendezvous (torch.distributed's store): |
|   | the headless Service `<run>-trainer`, whose only endpoint is worker 0's pod |
| KUBESTAR_TRAINER_METRICS_LISTEN | HOST:PORT where rank 0 serves Prometheus metrics (an empty |
|   | HOST: every address); empty: none |
| KUBESTAR_GPUS / _GPU_RESOURCE | the GPUs the pod's resources give it (e.g. 8, amd.com/gpu); |
|   | unset without GPUs (kubestar.common.accelerators) |

The world is workers x processesPerWorker processes in one torch.distributed process group
(kubestar.training.distributed). Worker 0's first process is rank 0: it alone rolls out (its
own Ray), reports status and writes files other than checkpoint shards. Where the cluster
has no DNS for Services, the trainer reads worker 0's pod address from its TrainingRun's
`status.rendezvousAddress`, which the operator keeps.

Its service account may `get` its own TrainingRun and `get`/`patch` that run's `status`
subresource, and `get`/`patch` the ConfigMap `<run>-metrics` (`metrics_log_name`), nothing
else (a Role limited by resourceNames). The operator makes that ConfigMap, empty; rank 0
keeps the run's metrics log in it (binaryData `METRICS_LOG_KEY`: gzipped JSON lines, every
RL step's entry, thinned when the log would outgrow a ConfigMap: the annotation
METRICS_LOG_EVERY says 1 in how many steps it keeps), so that `kubestar report --run NAME`
draws a run's report from the cluster alone. It reports with
`kubestar.training.progress.StatusPatcher`, which sends `trainer_patch(status)` to the status
subresource: a JSON merge patch of the fields the trainer owns, `phase` (Evaluating, SFT,
Training, Succeeded, Failed: kubestar.api.conditions.TRAINER_PHASES), `stage`, `step`,
`totalSteps`, `progress`, `metrics`, `lastCheckpoint`,
`rolloutRetry` (which `rollouts_condition` turns into the RolloutsHealthy condition),
`activity` (what it does and waits on; the operator's watchdog turns an activity that does
not move on into the Stalled condition), `evaluations` (the held-out evaluations, greedy and
search, rebuilt from the metrics log when a trainer resumes), `stageFilters` (what each
stage's filter kept, likewise rebuilt). The operator
owns `conditions`, `observedGeneration`, `stepSummary`, `trainer` and the phases Pending and
Provisioning; it also sets Succeeded or Failed from the Job's outcome when the trainer could
not. A report that fails is logged and dropped, never retried: training goes on, and the next
report carries the whole state again.

A trainer that fails for a reason the operator shows as it is (CheckpointVolumeFull: the
checkpoint volume is full; TooFewProblems: a stage's filter left too few problems;
AcceleratorUnavailable: torch does not see the GPUs KUBESTAR_GPUS says the pod has) writes
`Reason: message` to its termination message (TERMINATION_LOG) and exits with
EXIT_FINAL_FAILURE, which fails its Job at once (podFailurePolicy, Kubernetes 1.26 and later)
instead of retrying: a retry would meet the same failure. TrainerReady then carries the
reason and message. On older servers the operator sets the Job's backoffLimit to 0 when the
trainer reports Failed, so that its exit fails the Job too (and scales the Job to no pods
if the trainer has not exited within 60 s).

The operator (kubestar.operator.build_trainer) writes this contract and the trainer
(`kubestar train --in-cluster`) reads it; both import it from here, so neither imports the
other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kubestar.api.conditions import (
    TRAINER_PHASES,
    Condition,
    ConditionType,
    Reason,
    condition,
)
from kubestar.api.v1alpha1 import TrainingRunStatus

ENV_NAME = "KUBESTAR_TRAININGRUN_NAME"
ENV_NAMESPACE = "KUBESTAR_TRAININGRUN_NAMESPACE"
ENV_RUN_CONFIG = "KUBESTAR_RUN_CONFIG"
ENV_SCHEDULER = "KUBESTAR_SCHEDULER_ENDPOINT"
ENV_SANDBOX = "KUBESTAR_SANDBOX_ENDPOINT"
ENV_SANDBOX_LIMITS = "KUBESTAR_SANDBOX_LIMITS"
ENV_CHECKPOINT_DIR = "KUBESTAR_CHECKPOINT_DIR"
ENV_CHECKPOINT_VOLUME = "KUBESTAR_CHECKPOINT_VOLUME"
ENV_WORKERS = "KUBESTAR_TRAINER_WORKERS"
ENV_WORKER_INDEX = "KUBESTAR_TRAINER_WORKER_INDEX"
ENV_PROCESSES = "KUBESTAR_TRAINER_PROCESSES"
ENV_RENDEZVOUS = "KUBESTAR_TRAINER_RENDEZVOUS"
# The fleet's spec.weightSync, and where rank 0's WeightServer listens (HOST:PORT; an empty
# HOST is the pod's address: the trainer's on the route to its scheduler).
ENV_WEIGHT_SYNC = "KUBESTAR_WEIGHT_SYNC"
ENV_WEIGHTS_LISTEN = "KUBESTAR_WEIGHTS_LISTEN"
ENV_METRICS_LISTEN = "KUBESTAR_TRAINER_METRICS_LISTEN"

# Where the trainer container writes its termination message (the kubelet's default path).
TERMINATION_LOG = "/dev/termination-log"
# The exit code of a trainer whose checkpoint volume is full (ENOSPC's errno): its Job fails
# without retrying.
EXIT_FINAL_FAILURE = 28

# The run's metrics log in its ConfigMap (see the module's docstring).
METRICS_LOG_KEY = "metrics.jsonl.gz"
METRICS_LOG_EVERY = "kubestar.dev/metrics-log-every"


def metrics_log_name(run: str) -> str:
    """The ConfigMap that keeps a run's metrics log."""
    return f"{run}-metrics"


CONFIG_DIR = "/etc/kubestar"
RUN_CONFIG = f"{CONFIG_DIR}/run.yaml"

TRAINER_FIELDS = (
    "phase",
    "stage",
    "step",
    "totalSteps",
    "progress",
    "metrics",
    "lastCheckpoint",
    "rolloutRetry",
    "activity",
    "evaluations",
    "stageFilters",
)


@dataclass(frozen=True)
class TrainerEnvironment:
    name: str
    namespace: str
    run_config: str
    scheduler_endpoint: str
    sandbox_endpoint: str
    sandbox_limits: dict[str, Any]
    checkpoint_dir: str
    checkpoint_volume: str = ""  # e.g. "PersistentVolumeClaim run-checkpoints"
    workers: int = 1
    worker_index: int = 0
    processes: int = 1
    rendezvous: str = ""  # HOST:PORT; empty with one process in all
    weight_sync: str = "broadcast"
    weights_listen: str = "127.0.0.1:0"  # an empty HOST: the pod's address
    metrics_listen: str = ""  # HOST:PORT of rank 0's Prometheus metrics; empty: none

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TrainerEnvironment:
        values = dict(os.environ if env is None else env)
        return cls(
            name=values[ENV_NAME],
            namespace=values.get(ENV_NAMESPACE, "default"),
            run_config=values.get(ENV_RUN_CONFIG, RUN_CONFIG),
            scheduler_endpoint=values.get(ENV_SCHEDULER, ""),
            sandbox_endpoint=values.get(ENV_SANDBOX, ""),
            sandbox_limits=json.loads(values.get(ENV_SANDBOX_LIMITS) or "{}"),
            checkpoint_dir=values.get(ENV_CHECKPOINT_DIR, ""),
            checkpoint_volume=values.get(ENV_CHECKPOINT_VOLUME, ""),
            workers=int(values.get(ENV_WORKERS, "1")),
            worker_index=int(values.get(ENV_WORKER_INDEX, "0")),
            processes=int(values.get(ENV_PROCESSES, "1")),
            rendezvous=values.get(ENV_RENDEZVOUS, ""),
            weight_sync=values.get(ENV_WEIGHT_SYNC, "broadcast"),
            weights_listen=values.get(ENV_WEIGHTS_LISTEN, "127.0.0.1:0"),
            metrics_listen=values.get(ENV_METRICS_LISTEN, ""),
        )


def rollouts_condition(status: TrainingRunStatus, generation: int = 0) -> Condition | None:
    """RolloutsHealthy from what the trainer reports: False while a step is rolled out again
    (or the run failed) for infrastructure failures, True once a step trained; None before."""
    retry = status.rollout_retry
    if retry is not None:
        return condition(
            ConditionType.ROLLOUTS_HEALTHY,
            False,
            Reason.INFRASTRUCTURE_FAILURES,
            retry.message,
            generation,
        )
    if status.step > 0:
        return condition(
            ConditionType.ROLLOUTS_HEALTHY,
            True,
            Reason.HEALTHY,
            "the latest step trained on its rollouts",
            generation,
        )
    return None


def trainer_patch(status: TrainingRunStatus) -> dict[str, Any]:
    """The merge patch body for a status: only the fields the trainer owns."""
    data = status.model_dump(mode="json", by_alias=True)
    body = {key: data[key] for key in TRAINER_FIELDS}
    if body["phase"] not in TRAINER_PHASES:
        del body["phase"]
    return {"status": body}
