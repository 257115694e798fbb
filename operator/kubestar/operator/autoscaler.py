"""RolloutFleet autoscaling (spec.autoscaling): how many engines the rollout load asks for.

The rule is a HorizontalPodAutoscaler's, on the scheduler's own numbers rather than a metrics
pipeline's: replicas x value / target engines, rounded up, within minReplicas and
maxReplicas, unchanged while the value is within 10 % of the target. Engines are added at
once; they are removed only after the value stayed below the target for
scaleDownDelaySeconds, so that the lull between two steps' rollouts (the trainer training)
removes none. While engines added before are still starting nothing else changes: the queue
they are meant to serve is still there, and counting it again would add more.

`decide` is pure; the fleet's reconcile acts on it through the scale subresource (as a
HorizontalPodAutoscaler would) and keeps the time the value fell below the target in the
fleet's status, so an operator that restarts keeps counting from it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import NamedTuple

from kubestar.api.v1alpha1 import AutoscalingSpec, AutoscalingStatus
from kubestar.operator.reconciler import SchedulerProbe

# A value within this fraction of the target changes nothing (the HorizontalPodAutoscaler's
# default tolerance).
TOLERANCE = 0.1
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class Decision(NamedTuple):
    replicas: int  # spec.replicas from now on (the current value: no change)
    status: AutoscalingStatus
    message: str  # why replicas changed ("" when it did not)


def metric_value(spec: AutoscalingSpec, probe: SchedulerProbe | None, ready: int) -> float | None:
    """spec.metric's value as the scheduler reports it; None without a report."""
    if probe is None:
        return None
    if spec.metric == "queuedTurns":
        return probe.queued / max(ready, 1)
    usage = [engine.kv_usage for engine in probe.engines.values() if not engine.taken_out]
    return sum(usage) / len(usage) if usage else None


def observed(value: float | None, desired: int, below_target_since: str = "") -> AutoscalingStatus:
    # Every field set: the status is merge-patched, which keeps fields a patch leaves out.
    return AutoscalingStatus(
        value=value, desired_replicas=desired, below_target_since=below_target_since
    )


def stamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime(TIME_FORMAT)


def decide(
    spec: AutoscalingSpec,
    replicas: int,
    ready: int,
    value: float | None,
    previous: AutoscalingStatus | None,
    now: datetime,
) -> Decision:
    """The fleet's spec.replicas given the metric's `value` with `replicas` engines wanted,
    `ready` of them ready; `previous`: the status this wrote last time."""
    bounded = min(max(replicas, spec.min_replicas), spec.max_replicas)
    if bounded != replicas:
        bound = "minReplicas" if bounded > replicas else "maxReplicas"
        return Decision(bounded, observed(value, bounded), f"{bound} is {bounded}")
    if value is None or ready < replicas:
        return Decision(replicas, observed(value, replicas), "")
    desired = replicas
    ratio = value / spec.target
    if abs(ratio - 1.0) > TOLERANCE:
        desired = min(max(math.ceil(replicas * ratio), spec.min_replicas), spec.max_replicas)
    status = observed(value, desired)
    why = f"{spec.metric} {value:.3g} against the target {spec.target:g}"
    if desired > replicas:
        return Decision(desired, status, why)
    if desired == replicas:
        return Decision(replicas, status, "")
    since = previous.below_target_since if previous and previous.below_target_since else ""
    if not since:
        status.below_target_since = stamp(now)
        return Decision(replicas, status, "")
    below = now - datetime.strptime(since, TIME_FORMAT).replace(tzinfo=UTC)
    if below.total_seconds() < spec.scale_down_delay_seconds:
        status.below_target_since = since
        return Decision(replicas, status, "")
    return Decision(
        desired, status, f"{why} for {below.total_seconds():.0f} s (scaleDownDelaySeconds)"
    )
