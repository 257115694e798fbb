"""The trainer's telemetry: Prometheus metrics from the metrics log, and the log kept within a
ConfigMap's size."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from kubestar.training.progress import MetricsLog
from kubestar.training.telemetry import TrainerMetrics, pack_log, unpack_log


def step_entry(step: int, stage: str = "short", **extra: float) -> dict[str, Any]:
    return {
        "step": step,
        "stage": stage,
        "stage_step": step,
        "reward": step / 10,
        "accuracy": step / 20,
        "mean_response_tokens": 100.0 + step,
        "train_clip_fraction": 0.01,
        "rollout_positive_tool_error_rate": 0.25,
        "kept": 8.0,
        "spoiled": 1.0,
        "rollout_seconds": 3.0,
        "train_seconds": 2.0,
        "push_seconds": 0.5,
        "step_seconds": 5.5,
        "weights_versions": float(step - 1),
        **extra,
    }


def sample(metrics: TrainerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"run": "r", **labels})


def test_every_logged_entry_becomes_the_series_a_dashboard_reads(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    metrics = TrainerMetrics("r")
    log.listen(metrics)
    log.append({"step": 0, "stage": "sft", "loss": 0.75})
    log.append({"step": 0, "stage": "evaluation", "point": "start", "eval_accuracy": 0.25})
    log.append(step_entry(1))
    log.append(step_entry(2, rollout_attempts=3))
    log.append({"step": 2, "stage": "evaluation", "point": "end", "eval_accuracy": 0.5})

    stage = {"stage": "short"}
    assert sample(metrics, "kubestar_trainer_step", **stage) == 2
    assert sample(metrics, "kubestar_trainer_reward", **stage) == 0.2
    assert sample(metrics, "kubestar_trainer_accuracy", **stage) == 0.1
    assert sample(metrics, "kubestar_trainer_response_tokens", **stage) == 102
    assert sample(metrics, "kubestar_trainer_weights_version", **stage) == 1
    assert sample(metrics, "kubestar_trainer_positive_tool_error_rate", **stage) == 0.25
    assert sample(metrics, "kubestar_trainer_clip_fraction", **stage) == 0.01
    # A step that kept no group (every reward equal) trained nothing and clipped nothing.
    untrained = {k: v for k, v in step_entry(3).items() if k != "train_clip_fraction"}
    other = TrainerMetrics("r")
    other.entry(untrained)
    assert sample(other, "kubestar_trainer_clip_fraction", **stage) == 0
    assert sample(metrics, "kubestar_trainer_steps_total", **stage) == 2
    kept = sample(metrics, "kubestar_trainer_trajectories_total", outcome="kept", **stage)
    spoiled = sample(metrics, "kubestar_trainer_trajectories_total", outcome="spoiled", **stage)
    assert (kept, spoiled) == (16, 2)
    assert sample(metrics, "kubestar_trainer_rollout_retries_total", **stage) == 2
    parts = {
        part: sample(metrics, "kubestar_trainer_step_part_seconds", part=part, **stage)
        for part in ("rollout", "train", "push", "total")
    }
    assert parts == {"rollout": 3.0, "train": 2.0, "push": 0.5, "total": 5.5}
    assert sample(metrics, "kubestar_trainer_sft_loss") == 0.75
    start = sample(metrics, "kubestar_trainer_evaluation", point="start", metric="accuracy")
    end = sample(metrics, "kubestar_trainer_evaluation", point="end", metric="accuracy")
    assert (start, end) == (0.25, 0.5)
    assert sample(metrics, "kubestar_trainer_evaluation_step", point="end") == 2


def test_a_resumed_log_restarts_the_series_at_its_checkpoint(tmp_path: Path) -> None:
    """A trainer killed after step 3 resumes from step 2: its counters count steps 1 and 2
    once, not the replayed log twice, and the step gauge goes back to 2."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.append(step_entry(step))
    metrics = TrainerMetrics("r")
    log.listen(metrics)
    assert sample(metrics, "kubestar_trainer_steps_total", stage="short") == 3

    log.truncate_after(2)

    assert sample(metrics, "kubestar_trainer_step", stage="short") == 2
    assert sample(metrics, "kubestar_trainer_steps_total", stage="short") == 2
    log.append(step_entry(3))
    assert sample(metrics, "kubestar_trainer_steps_total", stage="short") == 3


def test_the_packed_log_fits_a_configmap_by_thinning_steps_not_evaluations() -> None:
    entries: list[dict[str, Any]] = [{"step": 0, "stage": "evaluation", "point": "start"}]
    # Noisy values: a log that gzip cannot shrink to nothing.
    entries += [step_entry(s, noise=((s * 7919) % 10007) / 10007) for s in range(1, 2001)]
    entries.append({"step": 2000, "stage": "evaluation", "point": "end"})

    whole, every = pack_log(entries)
    assert every == 1 and unpack_log(whole) == json.loads(json.dumps(entries))

    packed, every = pack_log(entries, limit=len(whole) // 3)
    assert len(packed) <= len(whole) // 3 and every > 1
    kept = unpack_log(packed)
    steps = [e["step"] for e in kept if "stage_step" in e]
    assert steps[0] == 1 and steps[-1] == 2000  # the first and the last step stay
    assert all(b - a <= every for a, b in pairwise(steps))
    assert [e["point"] for e in kept if e["stage"] == "evaluation"] == ["start", "end"]
