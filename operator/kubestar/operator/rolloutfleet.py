"""RolloutFleet: reconciles the vLLM engines and the KV-aware scheduler in front of them, and
reports ready engines, each engine's KV capacity (asked of the scheduler, which reads vLLM's
`vllm:cache_config_info`), the scheduler's endpoint, the weights the engines serve, and a
Ready condition that names what is wrong (no free GPUs, image pulls, crash loops, OOM kills).

The weights live in the scheduler's memory only; the status reports them. A restarted
scheduler serves none until the trainer, which owns them, pushes its latest again (before its
next rollout, kubestar.training.resilience.ensure_weights): the operator only reports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.api.conditions import Condition, ConditionType, Reason, condition
from kubestar.api.v1alpha1 import RolloutFleetSpec
from kubestar.common import kube as k
from kubestar.operator import build_fleet
from kubestar.operator import conditions as cond
from kubestar.operator import objects as o
from kubestar.operator.reconciler import ChildConflict, Context, EngineProbe, SchedulerProbe
from kubestar.operator.sandboxpool import ready_replicas, validation_message
from kubestar.operator.settings import OperatorSettings
from pydantic import ValidationError

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
) -> list[dict[str, Any]]:
    engines = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        labels = pod["metadata"].get("labels") or {}
        if labels.get(o.LABEL_COMPONENT) != build_fleet.ENGINE:
            continue
        name = pod["metadata"]["name"]
        entry: dict[str, Any] = {"name": name, "ready": k.pod_ready(pod)}
        if capacities and name in capacities:
            probe = capacities[name]
            entry["kvCapacityTokens"], entry["kvUsage"] = probe.capacity_tokens, probe.kv_usage
            if probe.taken_out:
                entry["takenOut"] = probe.taken_out
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
    engines: Mapping[str, Any] | None,
    scheduler: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    capacities: Capacities | None,
    settings: OperatorSettings,
    weights: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], Condition]:
    """(status fields, Ready condition) the operator writes (pure)."""
    meta = fleet["metadata"]
    generation = meta.get("generation", 0)
    ready_engines = ready_replicas(engines)
    scheduler_ready = ready_replicas(scheduler) >= 1
    per_engine = engine_statuses(pods, capacities)
    known = [e["kvCapacityTokens"] for e in per_engine if e.get("kvCapacityTokens") is not None]
    reason, message = cond.summarize(cond.diagnose(pods))
    out = [e for e in per_engine if e.get("takenOut")]
    if spec.replicas == 0:
        ready = condition(
            ConditionType.READY, False, Reason.NO_REPLICAS, "spec.replicas is 0", generation
        )
    elif ready_engines >= spec.replicas and scheduler_ready and out:
        # The pods are ready, but the scheduler took engines out (a weight reload that did
        # not finish, say): the fleet serves while one of them still takes turns.
        ready = condition(
            ConditionType.READY,
            len(out) < len(per_engine),
            Reason.ENGINES_TAKEN_OUT,
            "taken out by the scheduler: "
            + "; ".join(f"{e['name']}: {e['takenOut']}" for e in out),
            generation,
        )
    elif ready_engines >= spec.replicas and scheduler_ready:
        ready = condition(
            ConditionType.READY,
            True,
            Reason.READY,
            f"{ready_engines} {spec.accelerator} engine(s) behind the {spec.scheduler.policy} "
            "scheduler",
            generation,
        )
    elif reason:
        ready = condition(ConditionType.READY, False, reason, message, generation)
    else:
        ready = condition(
            ConditionType.READY,
            False,
            Reason.PROGRESSING,
            f"{ready_engines}/{spec.replicas} engines ready, scheduler "
            f"{'ready' if scheduler_ready else 'not ready'}",
            generation,
        )
    status = {
        "observedGeneration": generation,
        "accelerator": spec.accelerator,
        "replicas": spec.replicas,
        "readyReplicas": ready_engines,
        "schedulerEndpoint": build_fleet.scheduler_endpoint(
            meta["name"], meta["namespace"], spec, settings
        ),
        "openaiEndpoint": build_fleet.openai_endpoint(
            meta["name"], meta["namespace"], spec, settings
        ),
        "engines": per_engine,
        "kvCapacityTokens": sum(known) if known else None,
        "weights": dict(weights) if weights else None,
    }
    return status, ready


async def reconcile(ctx: Context, fleet: dict[str, Any]) -> None:
    meta = fleet["metadata"]
    generation = meta.get("generation", 0)
    try:
        spec = fleet_spec(fleet, ctx.settings)
    except ValidationError as error:
        invalid = condition(
            ConditionType.READY, False, Reason.INVALID_SPEC, validation_message(error), generation
        )
        await ctx.set_conditions(fleet, [invalid], {"observedGeneration": generation})
        return
    refused = build_fleet.spec_problem(spec, ctx.settings)
    if refused:
        invalid = condition(ConditionType.READY, False, Reason.INVALID_SPEC, refused, generation)
        await ctx.set_conditions(fleet, [invalid], {"observedGeneration": generation})
        return
    try:
        await ctx.apply_all(fleet, build_fleet.children(fleet, spec, ctx.settings))
    except ChildConflict as error:
        await ctx.set_conditions(
            fleet,
            [condition(ConditionType.READY, False, Reason.CHILD_CONFLICT, str(error), generation)],
        )
        return
    except k.ApiError as error:  # reported, then retried with backoff
        await ctx.set_conditions(
            fleet,
            [
                condition(
                    ConditionType.READY, False, Reason.APPLY_FAILED, error.message[:500], generation
                )
            ],
        )
        raise
    engines, scheduler, pods = await asyncio.gather(
        ctx.live(build_fleet.engine_deployment(fleet, spec, ctx.settings)),
        ctx.live(build_fleet.scheduler_deployment(fleet, spec, ctx.settings)),
        ctx.pods(fleet),
    )
    probe = None
    recorded = (fleet.get("status") or {}).get("weights")
    if ctx.settings.probe_schedulers and ready_replicas(scheduler) >= 1:
        endpoint = build_fleet.scheduler_endpoint(
            meta["name"], meta["namespace"], spec, ctx.settings
        )
        try:
            probe = await ctx.probe(endpoint, meta["namespace"])
        except Exception as error:  # the scheduler may be starting: report without capacity
            log.info("scheduler %s not answering: %s", endpoint, error)
    weights = served_weights(recorded, probe)
    capacities = probe.engines if probe else None
    status, ready = fleet_status(
        fleet, spec, engines, scheduler, pods, capacities, ctx.settings, weights
    )
    await ctx.set_conditions(fleet, [ready], status)
