"""SandboxPool: reconciles the pool's workers, dispatcher and Services, and reports
readyReplicas, capacity (ready workers x executors per pod), the dispatcher's endpoint, the
isolation the workers run with, and a Ready condition that names what is wrong with any pod
(image pulls, crash loops, OOM kills, scheduling, a worker that cannot isolate its calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.api.conditions import Condition, ConditionType, Reason, condition
from kubestar.api.v1alpha1 import SandboxPoolSpec
from kubestar.common import kube as k
from kubestar.operator import build_sandbox
from kubestar.operator import conditions as cond
from kubestar.operator.reconciler import ChildConflict, Context
from kubestar.operator.settings import OperatorSettings
from pydantic import ValidationError

KIND = "SandboxPool"


def validation_message(error: ValidationError) -> str:
    return "; ".join(
        f"spec.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors()
    )


def ready_replicas(obj: Mapping[str, Any] | None) -> int:
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


def pool_status(
    pool: Mapping[str, Any],
    spec: SandboxPoolSpec,
    workers: Mapping[str, Any] | None,
    dispatcher: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    settings: OperatorSettings,
) -> tuple[dict[str, Any], Condition]:
    """(status fields, Ready condition) the operator writes (pure)."""
    meta = pool["metadata"]
    generation = meta.get("generation", 0)
    ready_workers = ready_replicas(workers)
    ready_dispatchers = ready_replicas(dispatcher)
    reason, message = cond.summarize(cond.diagnose(pods))
    if spec.replicas == 0:
        ready = condition(
            ConditionType.READY, False, Reason.NO_REPLICAS, "spec.replicas is 0", generation
        )
    elif ready_workers >= spec.replicas and ready_dispatchers >= 1:
        unisolated = (
            "; isolation Disabled: calls are not isolated (development only)"
            if spec.isolation == "Disabled"
            else ""
        )
        ready = condition(
            ConditionType.READY,
            True,
            Reason.READY,
            f"{ready_workers} worker(s) with {spec.executors_per_pod} executors each{unisolated}",
            generation,
        )
    elif reason:
        ready = condition(ConditionType.READY, False, reason, message, generation)
    else:
        ready = condition(
            ConditionType.READY,
            False,
            Reason.PROGRESSING,
            f"{ready_workers}/{spec.replicas} workers ready, dispatcher "
            f"{'ready' if ready_dispatchers else 'not ready'}",
            generation,
        )
    status = {
        "observedGeneration": generation,
        "replicas": spec.replicas,
        "readyReplicas": ready_workers,
        "capacity": ready_workers * spec.executors_per_pod if ready_dispatchers else 0,
        "endpoint": build_sandbox.endpoint(meta["name"], meta["namespace"], spec, settings),
        "httpEndpoint": build_sandbox.http_endpoint(
            meta["name"], meta["namespace"], spec, settings
        ),
        "isolation": spec.isolation,
    }
    return status, ready


async def reconcile(ctx: Context, pool: dict[str, Any]) -> None:
    generation = pool["metadata"].get("generation", 0)
    try:
        spec = SandboxPoolSpec.model_validate(pool.get("spec") or {})
    except ValidationError as error:
        invalid = condition(
            ConditionType.READY, False, Reason.INVALID_SPEC, validation_message(error), generation
        )
        await ctx.set_conditions(pool, [invalid], {"observedGeneration": generation})
        return
    settings = ctx.settings
    refused = (
        settings.refusal("spec.image", image=spec.image)
        or settings.refusal("spec.runtimeClassName", runtime_class=spec.runtime_class_name or "")
        or settings.refusal("spec.isolation", isolation=spec.isolation)
    )
    if refused:
        invalid = condition(ConditionType.READY, False, Reason.INVALID_SPEC, refused, generation)
        await ctx.set_conditions(pool, [invalid], {"observedGeneration": generation})
        return
    desired = build_sandbox.children(pool, spec, ctx.settings)
    try:
        await ctx.apply_all(pool, desired)
    except ChildConflict as error:
        await ctx.set_conditions(
            pool,
            [condition(ConditionType.READY, False, Reason.CHILD_CONFLICT, str(error), generation)],
        )
        return
    except k.ApiError as error:  # reported, then retried with backoff
        await ctx.set_conditions(
            pool,
            [
                condition(
                    ConditionType.READY, False, Reason.APPLY_FAILED, error.message[:500], generation
                )
            ],
        )
        raise
    workers, dispatcher, pods = await asyncio.gather(
        ctx.live(build_sandbox.worker_statefulset(pool, spec, ctx.settings)),
        ctx.live(build_sandbox.dispatcher_deployment(pool, spec, ctx.settings)),
        ctx.pods(pool),
    )
    status, ready = pool_status(pool, spec, workers, dispatcher, pods, ctx.settings)
    await ctx.set_conditions(pool, [ready], status)
