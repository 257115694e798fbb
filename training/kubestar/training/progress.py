"""Progress of a run: a metrics log (JSONL) and the TrainingRun status, reported as it moves.

Reporters: `FileReporter` (local runs: status.json beside the metrics) and, on a cluster,
the status-subresource patcher of kubestar.operator's trainer contract. Both receive the same
TrainingRunStatus the CRD declares.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from kubestar.api.v1alpha1 import Condition, TrainingMetrics, TrainingRunStatus


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


def condition(
    type_: str, status: bool, reason: str, message: str = "", generation: int = 0
) -> Condition:
    return Condition(
        type=type_,
        status="True" if status else "False",
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
