"""kopf wiring: which watch events trigger which reconcile, and the operator process
(`kubestar operator run`): leader election, metrics, kopf.

Every resource is reconciled level-triggered through one work queue:

- a SandboxPool, RolloutFleet or TrainingRun event reconciles that resource; a fleet or
  pool event also reconciles the TrainingRuns that reference it;
- an event of a child the operator owns (Deployment, StatefulSet, Job, Service,
  ConfigMap, Pod; watched with a server-side label selector) reconciles its owner; a deleted
  child is re-created by that reconcile;
- every `resync_seconds` everything is reconciled again.

kopf's change-detection handlers (and their annotations and finalizers) are not used: owner
references are enough for cleanup, so no finalizer is ever added.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubestar.api.v1alpha1 import API_VERSION, GROUP, VERSION
from kubestar.common import kube as k
from kubestar.common.auth import namespace_token
from kubestar.operator import metrics, rolloutfleet, sandboxpool, trainingrun
from kubestar.operator import objects as o
from kubestar.operator.reconciler import (
    Context,
    EngineProbe,
    Key,
    Reconcile,
    SchedulerProbe,
    WorkQueue,
    no_probe,
)
from kubestar.operator.settings import OperatorSettings

log = logging.getLogger("kubestar.operator")

RECONCILERS: dict[str, Reconcile] = {
    sandboxpool.KIND: sandboxpool.reconcile,
    rolloutfleet.KIND: rolloutfleet.reconcile,
    trainingrun.KIND: trainingrun.reconcile,
}
API_VERSIONS = {kind: API_VERSION for kind in RECONCILERS}
PLURALS = {
    "SandboxPool": "sandboxpools",
    "RolloutFleet": "rolloutfleets",
    "TrainingRun": "trainingruns",
}
# Children watched (group, version, plural) for fast reaction; others converge on resync.
CHILDREN = [
    ("apps", "v1", "deployments"),
    ("apps", "v1", "statefulsets"),
    ("batch", "v1", "jobs"),
    ("", "v1", "pods"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("networking.k8s.io", "v1", "networkpolicies"),
]
MANAGED_SELECTOR = f"{o.LABEL_MANAGED_BY}={o.MANAGED_BY}"
# Children's events (and a fleet's or pool's for its runs) wait this long, so that a burst
# of them makes one reconcile; a resource's own events are handled at once.
CHILD_DELAY = 0.2


def kopf_login(connection: k.Connection) -> kopf.ConnectionInfo:
    """kopf's watches log in with the credentials of the operator's own client."""
    token = connection.bearer()
    return kopf.ConnectionInfo(
        server=connection.server,
        ca_path=connection.ca_file or None,
        insecure=connection.insecure or None,
        scheme="Bearer" if token else None,
        token=token or None,
        certificate_path=connection.cert_file or None,
        private_key_path=connection.key_file or None,
        default_namespace=connection.namespace,
    )


def _token_of(namespace: str, token: str) -> str:
    """The namespace's token (its services refuse any other), from the installation's."""
    return namespace_token(token, namespace) if token else ""


async def scheduler_probe(endpoint: str, namespace: str, token: str = "") -> SchedulerProbe | None:
    """Per-engine KV capacity, why an engine was taken out, and the weights served, from the
    fleet's scheduler (GetSchedulerStatus), asked with its namespace's token."""
    from kubestar.scheduler.client import SchedulerClient

    client = SchedulerClient(endpoint, timeout=2.0, token=_token_of(namespace, token))
    try:
        status = await client.status()
    finally:
        await client.close()
    engines = {
        e.name: EngineProbe(int(e.capacity_tokens), float(e.kv_usage), e.error)
        for e in status.engines
    }
    return SchedulerProbe(
        engines, int(status.weights_version), status.weights_path, int(status.queued)
    )


@dataclass
class Runtime:
    """The operator's state: the queue, and indexes built from watch events."""

    settings: OperatorSettings
    connection: k.Connection
    context: Context
    queue: WorkQueue = field(init=False)
    # (kind, namespace, label value) -> parent name (pods carry label values).
    names: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # (namespace, kind, name) of a fleet or pool -> TrainingRuns that reference it.
    dependents: dict[tuple[str, str, str], set[str]] = field(default_factory=dict)
    refs: dict[tuple[str, str], list[tuple[str, str, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.queue = WorkQueue(self.context, RECONCILERS, API_VERSIONS)

    @classmethod
    def create(
        cls, settings: OperatorSettings, connection: k.Connection, probe: bool = True
    ) -> Runtime:
        asked = functools.partial(scheduler_probe, token=settings.auth.token)
        context = Context(k.Kube(connection), settings, asked if probe else no_probe)
        return cls(settings, connection, context)

    # --- events ------------------------------------------------------------------------

    def parent_event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        namespace, name = meta.get("namespace", "default"), meta["name"]
        key: Key = (kind, namespace, name)
        if event_type == "DELETED":
            self.queue.forget(key)
            self.context.written.pop(key, None)
            self.names.pop((kind, namespace, o.label_value(name)), None)
            if kind == trainingrun.KIND:
                self._index_run(namespace, name, None)
                self.context.phases.pop((namespace, name), None)
        else:
            self.queue.known.add(key)
            self.names[(kind, namespace, o.label_value(name))] = name
            if kind == trainingrun.KIND:
                self._index_run(namespace, name, body.get("spec") or {})
            ours = self.context.written.get(key)
            if not ours or ours != meta.get("resourceVersion"):
                self.queue.enqueue(key)
        metrics.RESOURCES.labels(kind).set(sum(1 for key in self.queue.known if key[0] == kind))
        if kind != trainingrun.KIND:
            for run in self.dependents.get((namespace, kind, name), set()):
                self.queue.enqueue((trainingrun.KIND, namespace, run), CHILD_DELAY)
        else:
            # A run's progress (a step, so new weights) refreshes its fleet's status.weights,
            # which a restarted scheduler is given back.
            for ref_namespace, ref_kind, ref_name in self.refs.get((namespace, name), []):
                if ref_kind == rolloutfleet.KIND:
                    self.queue.enqueue((ref_kind, ref_namespace, ref_name), CHILD_DELAY)

    def _index_run(self, namespace: str, name: str, spec: Mapping[str, Any] | None) -> None:
        for ref in self.refs.pop((namespace, name), []):
            self.dependents.get(ref, set()).discard(name)
        if spec is None:
            return
        refs = []
        for kind, field_name in (
            ("RolloutFleet", "rolloutFleetRef"),
            ("SandboxPool", "sandboxPoolRef"),
        ):
            target = (spec.get(field_name) or {}).get("name")
            if target:
                ref = (namespace, kind, target)
                self.dependents.setdefault(ref, set()).add(name)
                refs.append(ref)
        self.refs[(namespace, name)] = refs

    def child_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        namespace = meta.get("namespace", "default")
        kind = body.get("kind", "")
        if event_type == "DELETED":
            self.context.forget_child(kind, namespace, meta["name"])
        else:
            self.context.exists.add((kind, namespace, meta["name"]))
        owner = None
        for ref in meta.get("ownerReferences") or []:
            if ref.get("controller") and ref.get("kind") in RECONCILERS:
                owner = (ref["kind"], namespace, ref["name"])
        if owner is None:  # pods: owned by a ReplicaSet/StatefulSet/Job; use the labels
            labels = meta.get("labels") or {}
            owner_kind = labels.get(o.LABEL_OWNER_KIND, "")
            name = self.names.get((owner_kind, namespace, labels.get(o.LABEL_INSTANCE, "")))
            if name:
                owner = (owner_kind, namespace, name)
        if owner is not None and owner in self.queue.known:
            self.queue.enqueue(owner, CHILD_DELAY)

    def resync(self) -> None:
        self.context.applied.clear()
        for key in list(self.queue.known):
            self.queue.enqueue(key)

    # --- kopf ----------------------------------------------------------------------------

    def registry(self) -> kopf.OperatorRegistry:
        registry = kopf.OperatorRegistry()
        runtime = self

        @kopf.on.startup(registry=registry)
        async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.posting.enabled = False  # the reconcilers post their own Events
            settings.peering.standalone = True  # leader election is ours (a Lease)
            settings.watching.server_timeout = 300
            settings.watching.client_timeout = 330
            settings.watching.connect_timeout = 10
            settings.networking.request_timeout = 30
            for group, version, plural in CHILDREN:
                settings.watching.label_selectors[group or version, plural] = MANAGED_SELECTOR

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf_login(runtime.connection)

        def parent(kind: str) -> None:
            @kopf.on.event(GROUP, VERSION, PLURALS[kind], registry=registry, id=kind.lower())
            async def handler(type: str | None, body: kopf.Body, **_: Any) -> None:
                runtime.parent_event(kind, type, _plain(body))

        for kind in RECONCILERS:
            parent(kind)

        def child(group: str, version: str, plural: str) -> None:
            @kopf.on.event(
                group=group,
                version=version,
                plural=plural,
                registry=registry,
                labels={o.LABEL_MANAGED_BY: o.MANAGED_BY},
                id=f"child-{plural}",
            )
            async def handler(type: str | None, body: kopf.Body, **_: Any) -> None:
                runtime.child_event(type, _plain(body))

        for group, version, plural in CHILDREN:
            child(group, version, plural)
        return registry

    async def run(
        self,
        stop_flag: asyncio.Event,
        ready_flag: asyncio.Event | None = None,
        liveness_endpoint: str | None = None,
    ) -> None:
        """Run kopf and the resync loop until `stop_flag` is set."""
        namespaces = self.settings.namespaces
        resync = asyncio.create_task(self._resync_forever())
        try:
            await kopf.operator(
                registry=self.registry(),
                clusterwide=self.settings.cluster_wide,
                namespaces=namespaces,
                standalone=True,
                stop_flag=stop_flag,
                ready_flag=ready_flag,
                liveness_endpoint=liveness_endpoint,
            )
        finally:
            resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await resync
            await self.queue.close()
            await self.context.kube.close()

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            self.resync()


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {
        "apiVersion": body.get("apiVersion", ""),
        "kind": body.get("kind", ""),
        "metadata": dict(body.get("metadata", {})),
        "spec": dict(body.get("spec", {})) if "spec" in body else {},
    }
