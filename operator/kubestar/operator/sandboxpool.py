"""SandboxPool: reconciles the pool's workers, dispatcher and Services, and reports
readyReplicas, capacity (ready workers x executors per pod), the dispatcher's endpoint, the
isolation the workers run with, and a Ready condition that names what is wrong with any pod
(image pulls, crash loops, OOM kills, scheduling, a worker that cannot isolate its calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.api.conditions import Condition
from kubestar.api.v1alpha1 import SandboxPoolSpec, SandboxPoolStatus
from kubestar.operator import build_sandbox
from kubestar.operator import conditions as cond
from kubestar.operator.conditions import ready_replicas
from kubestar.operator.reconciler import Context, reconcile_children
from kubestar.operator.settings import OperatorSettings

KIND = "SandboxPool"


def pool_status(
    pool: Mapping[str, Any],
    spec: SandboxPoolSpec,
    workers: Mapping[str, Any] | None,
    dispatcher: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    settings: OperatorSettings,
) -> tuple[SandboxPoolStatus, Condition]:
    """(status, Ready condition) the operator writes (pure)."""
    meta = pool["metadata"]
    generation = meta.get("generation", 0)
    ready_workers = ready_replicas(workers)
    ready_dispatchers = ready_replicas(dispatcher)
    serving = None
    if ready_workers >= spec.replicas and ready_dispatchers >= 1:
        unisolated = (
            "; isolation Disabled: calls are not isolated (development only)"
            if spec.isolation == "Disabled"
            else ""
        )
        serving = f"{ready_workers} worker(s) with {spec.executors_per_pod} executors each"
        serving += unisolated
    progress = (
        f"{ready_workers}/{spec.replicas} workers ready, dispatcher "
        f"{'ready' if ready_dispatchers else 'not ready'}"
    )
    ready = cond.ready(generation, spec.replicas, serving, progress, pods)
    status = SandboxPoolStatus(
        observed_generation=generation,
        replicas=spec.replicas,
        ready_replicas=ready_workers,
        capacity=ready_workers * spec.executors_per_pod if ready_dispatchers else 0,
        endpoint=build_sandbox.endpoint(meta["name"], meta["namespace"], spec, settings),
        http_endpoint=build_sandbox.http_endpoint(meta["name"], meta["namespace"], spec, settings),
        isolation=spec.isolation,
    )
    return status, ready


def refusal(spec: SandboxPoolSpec, settings: OperatorSettings) -> str | None:
    """Why the cluster's policy refuses the pool (its image, runtime class, isolation)."""
    return (
        settings.refusal("spec.image", image=spec.image)
        or settings.refusal("spec.runtimeClassName", runtime_class=spec.runtime_class_name or "")
        or settings.refusal("spec.isolation", isolation=spec.isolation)
    )


async def reconcile(ctx: Context, pool: dict[str, Any]) -> None:
    settings = ctx.settings
    spec = await reconcile_children(
        ctx,
        pool,
        SandboxPoolStatus,
        lambda: SandboxPoolSpec.model_validate(pool.get("spec") or {}),
        lambda spec: refusal(spec, settings),
        lambda spec: build_sandbox.children(pool, spec, settings),
    )
    if spec is None:
        return
    workers, dispatcher, pods = await asyncio.gather(
        ctx.live(build_sandbox.worker_statefulset(pool, spec, settings)),
        ctx.live(build_sandbox.dispatcher_deployment(pool, spec, settings)),
        ctx.pods(pool),
    )
    status, ready = pool_status(pool, spec, workers, dispatcher, pods, settings)
    await ctx.set_conditions(pool, [ready], status)
