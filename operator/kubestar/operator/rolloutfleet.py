"""RolloutFleet: reconciles the vLLM engines and the KV-aware scheduler in front of them, and
reports ready engines, each engine's KV capacity (asked of the scheduler, which reads vLLM's
`vllm:cache_config_info`), the scheduler's endpoint, the weights the engines serve, and a
Ready condition that names what is wrong (no free GPUs, image pulls, crash loops, OOM kills).
With spec.autoscaling it also sizes the fleet by the scheduler's load (kubestar.operator.
autoscaler), through the scale subresource; status.lastScale says why the size last changed.

The weights live in the scheduler's memory only; the status reports them. A restarted
scheduler serves none until the trainer, which owns them, pushes its latest again (before its
next rollout, kubestar.training.resilience.ensure_weights): the operator only reports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubestar.api.conditions import Condition, ConditionType, Reason, condition
from kubestar.api.v1alpha1 import (
    AutoscalingStatus,
    EngineStatus,
    RolloutFleetSpec,
    RolloutFleetStatus,
    ScaleEvent,
    WeightsStatus,
)
from kubestar.common import kube as k
from kubestar.operator import autoscaler, build_fleet
from kubestar.operator import conditions as cond
from kubestar.operator import objects as o
from kubestar.operator.conditions import ready_replicas
from kubestar.operator.reconciler import Context, EngineProbe, SchedulerProbe, reconcile_children
from kubestar.operator.settings import OperatorSettings

KIND = "RolloutFleet"
log = logging.getLogger(__name__)

Capacities = Mapping[str, EngineProbe]


def fleet_spec(fleet: Mapping[str, Any], settings: OperatorSettings) -> RolloutFleetSpec:
    """The fleet's spec, with the cluster's accelerator when it names none."""
    raw = dict(fleet.get("spec") or {})
    if not raw.get("accelerator"):
        raw["accelerator"] = settings.default_accelerator
    return RolloutFleetSpec.model_validate(raw)


def engine_statuses(
    pods: Sequence[Mapping[str, Any]], capacities: Capacities | None
) -> list[EngineStatus]:
    """Each engine pod, with its KV cache where the scheduler reported it (fields it did not
    report are left unset, so they are not written)."""
    engines = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        labels = pod["metadata"].get("labels") or {}
        if labels.get(o.LABEL_COMPONENT) != build_fleet.ENGINE:
            continue
        name = pod["metadata"]["name"]
        entry = EngineStatus(name=name, ready=k.pod_ready(pod))
        if capacities and name in capacities:
            probe = capacities[name]
            entry.kv_capacity_tokens, entry.kv_usage = probe.capacity_tokens, probe.kv_usage
            if probe.taken_out:
                entry.taken_out = probe.taken_out
        engines.append(entry)
    return engines


def served_weights(
    recorded: Mapping[str, Any] | None, probe: SchedulerProbe | None
) -> dict[str, Any] | None:
    """status.weights: what the scheduler serves, else what was recorded (a scheduler that
    restarted or does not answer tells nothing new)."""
    if probe is not None and probe.weights_path:
        return {"version": probe.weights_version, "path": probe.weights_path}
    return dict(recorded) if recorded else None


def fleet_status(
    fleet: Mapping[str, Any],
    spec: RolloutFleetSpec,
    engines: Sequence[Mapping[str, Any] | None],
    scheduler: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    capacities: Capacities | None,
    settings: OperatorSettings,
    weights: Mapping[str, Any] | None = None,
) -> tuple[RolloutFleetStatus, Condition]:
    """(status, Ready condition) the operator writes (pure)."""
    meta = fleet["metadata"]
    generation = meta.get("generation", 0)
    ready_engines = sum(ready_replicas(deployment) for deployment in engines)
    scheduler_ready = ready_replicas(scheduler) >= 1
    per_engine = engine_statuses(pods, capacities)
    known = [e.kv_capacity_tokens for e in per_engine if e.kv_capacity_tokens is not None]
    out = [e for e in per_engine if e.taken_out]
    all_ready = ready_engines >= spec.replicas and scheduler_ready
    if spec.replicas and all_ready and out:
        # The pods are ready, but the scheduler took engines out (a weight reload that did
        # not finish, say): the fleet serves while one of them still takes turns.
        ready = condition(
            ConditionType.READY,
            len(out) < len(per_engine),
            Reason.ENGINES_TAKEN_OUT,
            "taken out by the scheduler: " + "; ".join(f"{e.name}: {e.taken_out}" for e in out),
            generation,
        )
    else:
        serving = (
            f"{ready_engines} {spec.accelerator} engine(s) behind the {spec.scheduler.policy} "
            "scheduler"
        )
        progress = (
            f"{ready_engines}/{spec.replicas} engines ready, scheduler "
            f"{'ready' if scheduler_ready else 'not ready'}"
        )
        ready = cond.ready(
            generation, spec.replicas, serving if all_ready else None, progress, pods
        )
    status = RolloutFleetStatus(
        observed_generation=generation,
        accelerator=spec.accelerator,
        replicas=spec.replicas,
        ready_replicas=ready_engines,
        scheduler_endpoint=build_fleet.scheduler_endpoint(
            meta["name"], meta["namespace"], spec, settings
        ),
        openai_endpoint=build_fleet.openai_endpoint(
            meta["name"], meta["namespace"], spec, settings
        ),
        selector=build_fleet.engine_selector_text(meta["name"]),
        engines=per_engine,
        kv_capacity_tokens=sum(known) if known else None,
        weights=WeightsStatus.model_validate(weights) if weights else None,
    )
    return status, ready


def seen_scale(
    fleet: Mapping[str, Any], spec: RolloutFleetSpec, now: datetime
) -> ScaleEvent | None:
    """status.lastScale: a change of spec.replicas since the last status that the operator
    did not make itself (its own are recorded when made), else the one recorded."""
    status = fleet.get("status") or {}
    last = ScaleEvent.model_validate(status["lastScale"]) if status.get("lastScale") else None
    before = status.get("replicas")
    if before is None or before == spec.replicas:
        return last
    if last is not None and last.to_replicas == spec.replicas:
        return last  # the operator's own change, reported before its Deployment followed
    return ScaleEvent(
        time=autoscaler.stamp(now),
        from_replicas=int(before),
        to_replicas=spec.replicas,
        reason="SpecChanged",
        message="",  # every field set: a merge patch would keep an earlier event's
    )


async def engine_deployments(ctx: Context, fleet: Mapping[str, Any]) -> list[k.Obj]:
    """The fleet's engine Deployments as they are."""
    meta = fleet["metadata"]
    return await ctx.kube.list(
        k.path("apps/v1", "Deployment", meta["namespace"]),
        build_fleet.engine_selector_text(meta["name"]),
    )


async def reconcile(ctx: Context, fleet: dict[str, Any]) -> None:
    meta = fleet["metadata"]
    settings = ctx.settings
    # Listed once: on the host's network, engines beyond spec.replicas keep their
    # Deployments (at 0); their ready pods make the status (a change of them is a new event).
    engines = await engine_deployments(ctx, fleet)
    existing = build_fleet.engine_count(engines) if settings.network.host_network else 0
    spec = await reconcile_children(
        ctx,
        fleet,
        RolloutFleetStatus,
        lambda: fleet_spec(fleet, settings),
        lambda spec: build_fleet.spec_problem(spec, settings),
        lambda spec: build_fleet.children(fleet, spec, settings, existing),
    )
    if spec is None:
        return
    scheduler, pods = await asyncio.gather(
        ctx.live(build_fleet.scheduler_deployment(fleet, spec, settings)),
        ctx.pods(fleet),
    )
    probe = None
    recorded = (fleet.get("status") or {}).get("weights")
    if settings.probe_schedulers and ready_replicas(scheduler) >= 1:
        endpoint = build_fleet.scheduler_endpoint(meta["name"], meta["namespace"], spec, settings)
        try:
            probe = await ctx.probe(endpoint, meta["namespace"])
        except Exception as error:  # the scheduler may be starting: report without capacity
            log.info("scheduler %s not answering: %s", endpoint, error)
    weights = served_weights(recorded, probe)
    capacities = probe.engines if probe else None
    status, ready = fleet_status(
        fleet, spec, engines, scheduler, pods, capacities, settings, weights
    )
    now = datetime.now(UTC)
    status.last_scale = seen_scale(fleet, spec, now)
    status.autoscaling = None
    if spec.autoscaling is not None:
        previous = (fleet.get("status") or {}).get("autoscaling")
        decision = autoscaler.decide(
            spec.autoscaling,
            spec.replicas,
            status.ready_replicas,
            autoscaler.metric_value(spec.autoscaling, probe, status.ready_replicas),
            AutoscalingStatus.model_validate(previous) if previous else None,
            now,
        )
        status.autoscaling = decision.status
        if decision.replicas != spec.replicas:
            # As a HorizontalPodAutoscaler does: the change is the spec's, so the next
            # reconcile (the watch sees it) sizes the engines' Deployment.
            await ctx.kube.merge_patch(
                k.path_of(fleet, "scale"), {"spec": {"replicas": decision.replicas}}
            )
            log.info(
                "%s/%s: %d -> %d engines: %s",
                meta["namespace"],
                meta["name"],
                spec.replicas,
                decision.replicas,
                decision.message,
            )
            status.replicas = decision.replicas
            status.last_scale = ScaleEvent(
                time=autoscaler.stamp(now),
                from_replicas=spec.replicas,
                to_replicas=decision.replicas,
                reason="Autoscaled",
                message=decision.message,
            )
    await ctx.set_conditions(fleet, [ready], status)
