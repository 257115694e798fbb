"""Progress of a run: a metrics log (JSONL) and the TrainingRun status, reported as it moves.

Reporters: `FileReporter` (local runs: status.json beside the metrics) and, on a cluster,
`StatusPatcher` (the TrainingRun's status subresource, as kubestar.api.trainer_contract says).
Both receive the same TrainingRunStatus the CRD declares.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kubestar.api.conditions import ConditionType, Phase, condition, now
from kubestar.api.trainer_contract import (
    TrainerEnvironment,
    rollouts_condition,
    trainer_patch,
)
from kubestar.api.v1alpha1 import (
    API_VERSION,
    MAX_STATUS_EVALUATIONS,
    EvaluationResult,
    Progress,
    ProgressMetric,
    SearchEvaluationResult,
    StageFilterResult,
    TrainingMetrics,
    TrainingRunStatus,
)
from kubestar.common import kube
from kubestar.training.report import EVALUATION, FILTER

log = logging.getLogger(__name__)


class Reporter(Protocol):
    def report(self, status: TrainingRunStatus) -> None: ...


class FileReporter:
    def __init__(self, path: Path) -> None:
        self.path = path

    def report(self, status: TrainingRunStatus) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(status.model_dump_json(by_alias=True, indent=2))
        tmp.replace(self.path)


class StatusPatcher:
    """Reports to the TrainingRun's status subresource through kubestar's API client (in the
    trainer pod: with its service account, whose Role allows exactly that)."""

    def __init__(
        self, name: str, namespace: str, connection: kube.Connection, timeout: float = 10.0
    ) -> None:
        self.connection = connection
        self.path = kube.path(API_VERSION, "TrainingRun", namespace, name, "status")
        self.timeout = timeout

    @classmethod
    def in_cluster(cls, env: TrainerEnvironment | None = None) -> StatusPatcher:
        env = env or TrainerEnvironment.from_env()
        return cls(env.name, env.namespace, kube.in_cluster())

    def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the status; raises what the request raised (kube.REQUEST_ERRORS)."""
        return kube.call_blocking(
            self.connection, lambda client: client.merge_patch(self.path, body), self.timeout
        )

    def current(self) -> dict[str, Any]:
        """The run's status as the API server holds it now ({} while it has none)."""
        run = kube.call_blocking(
            self.connection, lambda client: client.get(self.path), self.timeout
        )
        return dict((run or {}).get("status") or {})

    def report(self, status: TrainingRunStatus) -> None:
        """Best effort: a failed patch is logged, never raised nor retried (training goes on;
        the next report carries the whole state again)."""
        try:
            self.patch(trainer_patch(status))
        except kube.REQUEST_ERRORS as error:
            log.warning("status patch failed: %s", error)


class MetricsListener(Protocol):
    """Told of each entry a MetricsLog gets, and of the whole log when it starts listening
    and when a resume truncates it (kubestar.training.telemetry's exporters)."""

    def entry(self, entry: Mapping[str, Any]) -> None: ...

    def reload(self, entries: Sequence[Mapping[str, Any]]) -> None: ...


class MetricsLog:
    """One JSON object per step; on resume, entries after the checkpoint are dropped so that
    every step appears exactly once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listeners: list[MetricsListener] = []

    def listen(self, listener: MetricsListener) -> None:
        """`listener` gets the log as it is now, then every entry appended."""
        self.listeners.append(listener)
        listener.reload(self.read())

    def truncate_after(self, global_step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= global_step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))
        entries = self.read()
        for listener in self.listeners:
            listener.reload(entries)

    def append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry, default=float) + "\n")
        for listener in self.listeners:
            listener.entry(entry)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def set_phase(status: TrainingRunStatus, phase: Phase, reason: str, message: str) -> None:
    """Move the run to `phase`, with a Progressing condition that says why (False once the
    run failed)."""
    status.phase = phase
    progressing = condition(
        ConditionType.PROGRESSING,
        phase is not Phase.FAILED,
        reason,
        message,
        status.observed_generation,
    )
    others = [c for c in status.conditions if c.type != ConditionType.PROGRESSING]
    status.conditions = [*others, progressing]


def set_rollouts_condition(status: TrainingRunStatus) -> None:
    """The RolloutsHealthy condition of a local run's status, as the operator derives it on a
    cluster from the same fields (kubestar.api.trainer_contract.rollouts_condition)."""
    rollouts = rollouts_condition(status, status.observed_generation)
    if rollouts is None:
        return
    others = [c for c in status.conditions if c.type != ConditionType.ROLLOUTS_HEALTHY]
    status.conditions = [*others, rollouts]


def duration_summary(seconds: float) -> str:
    """Seconds as people read a time left: "1h5m", "3m20s", "42s"."""
    whole = max(round(seconds), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def step_progress(
    step: int, total_steps: int, seconds_left: float | None, metrics: TrainingMetrics
) -> Progress:
    """status.progress after `step` of `total_steps`."""
    values = metrics.model_dump(by_alias=True, exclude_none=True)
    return Progress(
        percentage=min(100, 100 * step // max(total_steps, 1)),
        estimated_remaining_seconds=None if seconds_left is None else round(seconds_left),
        estimated_remaining_time_summary=(
            "" if seconds_left is None else duration_summary(seconds_left)
        ),
        metrics=[ProgressMetric(name=name, value=f"{value:.4g}") for name, value in values.items()],
        last_update_time=now(),
    )


def status_metrics(metrics: dict[str, float]) -> TrainingMetrics:
    return TrainingMetrics(
        reward=metrics.get("reward"),
        accuracy=metrics.get("accuracy"),
        tool_calls_per_trajectory=metrics.get("tool_calls_per_trajectory"),
        tool_error_rate=metrics.get("tool_error_rate"),
        positive_tool_error_rate=metrics.get("positive_tool_error_rate"),
        mean_response_tokens=metrics.get("mean_response_tokens"),
        tokens_per_second=metrics.get("tokens_per_second"),
        step_seconds=metrics.get("step_seconds"),
    )


def evaluation_result(entry: dict[str, Any]) -> EvaluationResult:
    """status.evaluations' entry for an evaluation's metrics entry (stage `evaluation`: the
    sampled figures, and the search's under `search_*` keys when it ran)."""
    search = None
    if entry.get("search_mode"):
        search = SearchEvaluationResult(
            mode=str(entry["search_mode"]),
            accuracy=float(entry.get("search_accuracy") or 0.0),
            answered=float(entry.get("search_answered") or 0.0),
            generated_tokens_per_problem=float(
                entry.get("search_generated_tokens_per_problem") or 0.0
            ),
            seconds=float(entry.get("search_seconds") or 0.0),
        )
    return EvaluationResult(
        point=entry.get("point", "end"),
        step=int(entry.get("step") or 0),
        problems=int(entry.get("problems") or 0),
        samples=int(entry.get("eval_samples") or 1),
        temperature=float(entry.get("eval_temperature") or 0.0),
        accuracy=float(entry.get("eval_accuracy") or 0.0),
        pass_at_k=float(entry.get("eval_pass_at_k") or entry.get("eval_accuracy") or 0.0),
        generated_tokens_per_problem=float(entry.get("generated_tokens_per_problem") or 0.0),
        seconds=float(entry.get("seconds") or 0.0),
        search=search,
    )


def record_evaluation(status: TrainingRunStatus, result: EvaluationResult) -> None:
    """Add an evaluation to status.evaluations, keeping the first and the newest ones
    (MAX_STATUS_EVALUATIONS in all): the first is what training is measured against."""
    evaluations = [*status.evaluations, result]
    if len(evaluations) > MAX_STATUS_EVALUATIONS:
        evaluations = [evaluations[0], *evaluations[-(MAX_STATUS_EVALUATIONS - 1) :]]
    status.evaluations = evaluations


def evaluations_from_log(entries: list[dict[str, Any]]) -> list[EvaluationResult]:
    """status.evaluations rebuilt from a metrics log (a resumed trainer's status starts
    empty; its log holds every evaluation up to the checkpoint)."""
    status = TrainingRunStatus()
    for entry in entries:
        if entry.get("stage") == EVALUATION:
            record_evaluation(status, evaluation_result(entry))
    return status.evaluations


def record_stage_filter(status: TrainingRunStatus, result: StageFilterResult) -> None:
    """Add a stage filter's result to status.stageFilters (a stage filtered again after a
    restart replaces its entry)."""
    others = [entry for entry in status.stage_filters if entry.stage != result.stage]
    status.stage_filters = [*others, result]


def stage_filter_entry(step: int, result: StageFilterResult) -> dict[str, Any]:
    """The metrics log's entry for a stage filter's result, at RL step `step`."""
    return {
        "step": step,
        "stage": FILTER,
        "filtered_stage": result.stage,
        "k": result.k,
        "evaluated": result.evaluated,
        "kept": result.kept,
    }


def stage_filters_from_log(entries: list[dict[str, Any]]) -> list[StageFilterResult]:
    """status.stageFilters rebuilt from a metrics log (entries of stage `filter`)."""
    status = TrainingRunStatus()
    for entry in entries:
        if entry.get("stage") == FILTER:
            result = StageFilterResult(
                stage=str(entry["filtered_stage"]),
                k=int(entry["k"]),
                evaluated=int(entry["evaluated"]),
                kept=int(entry["kept"]),
            )
            record_stage_filter(status, result)
    return status.stage_filters
