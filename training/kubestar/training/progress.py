"""Progress of a run: a metrics log (JSONL) and the TrainingRun status, reported as it moves.

Reporters: `FileReporter` (local runs: status.json beside the metrics) and, on a cluster,
the status-subresource patcher of kubestar.operator's trainer contract. Both receive the same
TrainingRunStatus the CRD declares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from kubestar.api.conditions import ConditionType, Phase, condition
from kubestar.api.v1alpha1 import TrainingMetrics, TrainingRunStatus


class Reporter(Protocol):
    def report(self, status: TrainingRunStatus) -> None: ...


class FileReporter:
    def __init__(self, path: Path) -> None:
        self.path = path

    def report(self, status: TrainingRunStatus) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(status.model_dump_json(by_alias=True, indent=2))
        tmp.replace(self.path)


class MetricsLog:
    """One JSON object per step; on resume, entries after the checkpoint are dropped so that
    every step appears exactly once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, global_step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= global_step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry, default=float) + "\n")

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
