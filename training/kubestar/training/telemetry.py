"""What a run's rank 0 tells the world besides its status: Prometheus metrics, and the run's
metrics log kept in a ConfigMap so that `kubestar report --run` works without the volume.

Both listen to the run's `MetricsLog` (kubestar.training.progress): every entry the log gets
(an RL step, SFT, an evaluation, a stage filter) reaches them, and a resumed log is replayed
to them, so a restarted trainer's gauges start where the run was.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.api.errors import KubestarError
from kubestar.api.trainer_contract import (
    METRICS_LOG_EVERY,
    METRICS_LOG_KEY,
    TrainerEnvironment,
    metrics_log_name,
)
from kubestar.api.v1alpha1 import API_VERSION
from kubestar.common import kube
from kubestar.common.net import CannotListen, start_metrics_server
from kubestar.training.progress import MetricsListener
from kubestar.training.report import EVALUATION, FILTER, SFT
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

PREFIX = "kubestar_trainer"
# A ConfigMap holds at most 1 MiB; what is left is for its metadata.
MAX_LOG_BYTES = 900 * 1024


# RL step entry key -> (gauge name, help). Gauges hold the newest step's value.
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "reward": ("reward", "Mean reward of the step's rollouts"),
    "accuracy": ("accuracy", "Share of the step's rollouts with a correct answer"),
    "tool_calls_per_trajectory": ("tool_calls_per_trajectory", "Tool calls per trajectory"),
    "tool_error_rate": ("tool_error_rate", "Share of tool calls that failed"),
    "rollout_positive_tool_error_rate": (
        "positive_tool_error_rate",
        "Share of tool calls that failed, in the step's correct rollouts (0 without any)",
    ),
    "mean_response_tokens": ("response_tokens", "Mean response tokens per trajectory"),
    "train_clip_fraction": (
        "clip_fraction",
        "Share of trained tokens whose ratio was clipped (0 when RoC kept no group to train on)",
    ),
    "tokens_per_second": ("tokens_per_second", "Rollout tokens generated per second"),
    "weights_versions": ("weights_version", "Newest weights version the rollouts sampled"),
    "staleness_max": (
        "staleness",
        "Most weights versions a trained token lagged the weights it trained (algorithm."
        "maxStaleness bounds it)",
    ),
    "off_policy_token_fraction": (
        "off_policy_token_fraction",
        "Share of trained tokens sampled from older weights (corrected by importance sampling)",
    ),
    "train_tis_truncated_fraction": (
        "tis_truncated_fraction",
        "Share of trained tokens whose importance weight was truncated at algorithm.tisCap",
    ),
    "engine_idle_seconds": (
        "engine_idle_seconds",
        "Seconds of the newest step in which no rollout was under way",
    ),
    "trainer_idle_seconds": (
        "trainer_idle_seconds",
        "Seconds of the newest step the trainer waited on its rollouts",
    ),
}
# Seconds of a step by part: entry key -> the `part` label.
STEP_PARTS = {
    "rollout_seconds": "rollout",
    "train_seconds": "train",
    "push_seconds": "push",
    "step_seconds": "total",
}
# Evaluation entry key -> the `metric` label of kubestar_trainer_evaluation.
EVALUATION_METRICS = {
    "eval_accuracy": "accuracy",
    "eval_pass_at_k": "pass_at_k",
    "search_accuracy": "search_accuracy",
}


class TrainerMetrics:
    """The trainer's Prometheus metrics, labelled by run and stage (a registry of its own)."""

    def __init__(self, run: str, registry: CollectorRegistry | None = None) -> None:
        self.run = run
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step = Gauge(f"{PREFIX}_step", "Global step last done", ["run", "stage"], registry=r)
        self.stage_step = Gauge(
            f"{PREFIX}_stage_step", "Step last done within its stage", ["run", "stage"], registry=r
        )
        self.gauges = {
            key: Gauge(f"{PREFIX}_{name}", text, ["run", "stage"], registry=r)
            for key, (name, text) in STEP_GAUGES.items()
        }
        self.step_seconds = Gauge(
            f"{PREFIX}_step_part_seconds",
            "Seconds the newest step spent by part (rollout, train, push, total)",
            ["run", "stage", "part"],
            registry=r,
        )
        self.steps = Counter(f"{PREFIX}_steps", "RL steps done", ["run", "stage"], registry=r)
        self.trajectories = Counter(
            f"{PREFIX}_trajectories",
            "Trajectories rolled out, by outcome: kept for the update, or spoiled (lost to a "
            "failure of the infrastructure)",
            ["run", "stage", "outcome"],
            registry=r,
        )
        self.rollout_retries = Counter(
            f"{PREFIX}_rollout_retries",
            "A step's rollouts started again after the infrastructure failed them",
            ["run", "stage"],
            registry=r,
        )
        self.evaluation = Gauge(
            f"{PREFIX}_evaluation",
            "Held-out evaluation results, by point (start, sft, step, end) and metric",
            ["run", "point", "metric"],
            registry=r,
        )
        self.evaluation_step = Gauge(
            f"{PREFIX}_evaluation_step",
            "The step after which the newest evaluation at a point ran",
            ["run", "point"],
            registry=r,
        )
        self.sft_loss = Gauge(f"{PREFIX}_sft_loss", "Final loss of SFT", ["run"], registry=r)

    def entry(self, entry: Mapping[str, Any]) -> None:
        stage = str(entry.get("stage", ""))
        if stage == EVALUATION:
            self._evaluation(entry)
        elif stage == SFT:
            if isinstance(entry.get("loss"), int | float):
                self.sft_loss.labels(self.run).set(float(entry["loss"]))
        elif stage != FILTER and "stage_step" in entry:
            self._step(stage, entry)

    def reload(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """The log as it is now (a resumed one: the steps up to its checkpoint)."""
        metrics: list[Gauge | Counter] = [self.step, self.stage_step, *self.gauges.values()]
        metrics += [self.step_seconds, self.steps, self.trajectories, self.rollout_retries]
        metrics += [self.evaluation, self.evaluation_step]
        for metric in metrics:
            metric.clear()
        for entry in entries:
            self.entry(entry)

    def _step(self, stage: str, entry: Mapping[str, Any]) -> None:
        labels = (self.run, stage)
        self.step.labels(*labels).set(float(entry["step"]))
        self.stage_step.labels(*labels).set(float(entry["stage_step"]))
        # A step that kept no group trained nothing, and clipped nothing.
        entry = {"train_clip_fraction": 0.0, **entry}
        for key, gauge in self.gauges.items():
            if isinstance(entry.get(key), int | float):
                gauge.labels(*labels).set(float(entry[key]))
        for key, part in STEP_PARTS.items():
            if isinstance(entry.get(key), int | float):
                self.step_seconds.labels(*labels, part).set(float(entry[key]))
        self.steps.labels(*labels).inc()
        self.rollout_retries.labels(*labels).inc(
            max(float(entry.get("rollout_attempts", 1)) - 1, 0)
        )
        for outcome in ("kept", "spoiled"):
            self.trajectories.labels(*labels, outcome).inc(float(entry.get(outcome) or 0.0))

    def _evaluation(self, entry: Mapping[str, Any]) -> None:
        point = str(entry.get("point", "end"))
        self.evaluation_step.labels(self.run, point).set(float(entry.get("step") or 0))
        for key, metric in EVALUATION_METRICS.items():
            if isinstance(entry.get(key), int | float):
                self.evaluation.labels(self.run, point, metric).set(float(entry[key]))


def pack_log(entries: Sequence[Mapping[str, Any]], limit: int = MAX_LOG_BYTES) -> tuple[str, int]:
    """The log as base64 of gzipped JSON lines, within `limit` bytes, and the thinning it
    took: 1 keeps every RL step; k keeps every k-th (and the last). Other entries (SFT,
    evaluations, filters) are always kept."""
    every = 1
    while True:
        kept = _thin(entries, every)
        packed = base64.b64encode(gzip.compress(_lines(kept).encode(), mtime=0)).decode()
        if len(packed) <= limit or every > len(entries):
            return packed, every
        every *= 2


def unpack_log(packed: str) -> list[dict[str, Any]]:
    text = gzip.decompress(base64.b64decode(packed)).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _lines(entries: Sequence[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(entry, default=float) + "\n" for entry in entries)


def _thin(entries: Sequence[Mapping[str, Any]], every: int) -> list[Mapping[str, Any]]:
    steps = [i for i, e in enumerate(entries) if "stage_step" in e]
    dropped = {i for n, i in enumerate(steps) if n % every and i != steps[-1]}
    return [e for i, e in enumerate(entries) if i not in dropped]


class MetricsLogMirror:
    """Keeps the run's metrics log in its ConfigMap (binaryData, gzipped), best effort: a
    failed patch is logged and the next entry carries the whole log again."""

    def __init__(
        self, name: str, namespace: str, connection: kube.Connection, timeout: float = 10.0
    ) -> None:
        self.connection = connection
        self.path = kube.path("v1", "ConfigMap", namespace, metrics_log_name(name))
        self.timeout = timeout
        self.entries: list[Mapping[str, Any]] = []

    def entry(self, entry: Mapping[str, Any]) -> None:
        self.entries.append(entry)
        self._publish()

    def reload(self, entries: Sequence[Mapping[str, Any]]) -> None:
        self.entries = list(entries)
        self._publish()

    def _publish(self) -> None:
        packed, every = pack_log(self.entries)
        body = {
            "metadata": {"annotations": {METRICS_LOG_EVERY: str(every)}},
            "binaryData": {METRICS_LOG_KEY: packed},
        }
        try:
            kube.call_blocking(
                self.connection,
                lambda client: client.merge_patch(self.path, body),
                self.timeout,
            )
        except kube.REQUEST_ERRORS as error:
            log.warning("metrics log not kept in %s: %s", self.path, error)


def trainer_pod_listeners(env: TrainerEnvironment) -> list[MetricsListener]:
    """Rank 0's listeners in a trainer pod: the ConfigMap's copy of the log, and Prometheus
    metrics on env.metrics_listen when set. A metrics port that is taken (pods that share
    the host's network) costs the metrics, not the run: it is logged."""
    listeners: list[MetricsListener] = [
        MetricsLogMirror(env.name, env.namespace, kube.in_cluster())
    ]
    if env.metrics_listen:
        host, _, port = env.metrics_listen.rpartition(":")
        exporter = TrainerMetrics(env.name)
        try:
            start_metrics_server(int(port), host or "0.0.0.0", exporter.registry)
        except CannotListen as error:
            log.error("no Prometheus metrics: %s", error)
        else:
            listeners.append(exporter)
    return listeners


class RunUnreadable(KubestarError):
    """`kubestar report --run` names a TrainingRun the cluster does not have, or that the
    caller may not read."""


def fetch_run(
    connection: kube.Connection, name: str, namespace: str, timeout: float = 30.0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run's metrics log (from its ConfigMap) and status, read from the cluster."""
    run_path = kube.path(API_VERSION, "TrainingRun", namespace, name)
    log_path = kube.path("v1", "ConfigMap", namespace, metrics_log_name(name))

    async def both(client: kube.Kube) -> tuple[kube.Obj | None, kube.Obj | None]:
        return await client.get(run_path), await client.get(log_path)

    try:
        run, log_map = kube.call_blocking(connection, both, timeout)
    except kube.ApiError as error:
        raise RunUnreadable(f"--run {name}: {error}") from None
    if run is None:
        raise RunUnreadable(f"--run {name}: no TrainingRun {name} in namespace {namespace}")
    packed = ((log_map or {}).get("binaryData") or {}).get(METRICS_LOG_KEY)
    entries = unpack_log(packed) if packed else []
    return entries, dict(run.get("status") or {})
