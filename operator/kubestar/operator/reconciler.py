"""The machinery every resource shares: the reconcile ladder (validate the spec, apply the
cluster's policy, apply the children, report a conflict or failure in a condition), applying
children (server-side apply, only when their hash changed), status patches from the status
models (only when something changed), Events, and a work queue that coalesces triggers per
resource, bounds concurrency and retries with backoff.

Reconcile is level-triggered and idempotent: it reads the parent and its children and
converges. A child is applied only when its `kubestar.dev/spec-hash` differs from what the
builders produce, so an operator restart (or a periodic resync) writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

from kubestar.api.conditions import Condition, ConditionStatus, ConditionType, Reason, condition
from kubestar.common import kube as k
from kubestar.operator import conditions as cond
from kubestar.operator import metrics
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings
from pydantic import BaseModel, ValidationError

log = logging.getLogger("kubestar.operator")

FIELD_MANAGER = "kubestar-operator"
Key = tuple[str, str, str]  # kind, namespace, name


class ChildConflict(Exception):
    """A child's name is taken by an object this resource does not own."""


SpecT = TypeVar("SpecT", bound=BaseModel)
# Why a resource's spec is not admitted (or its children not applied): (reason, message).
Problem = tuple[str, str]


def validation_message(error: ValidationError) -> str:
    return "; ".join(
        f"spec.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors()
    )


def status_fields(status: BaseModel) -> dict[str, Any]:
    """The fields of a status model that were set, as the API has them (camelCase, JSON
    values; None kept, which a merge patch turns into a removal); conditions apart, since
    `Context.set_conditions` merges those."""
    return status.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"conditions"})


def _union(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two fieldsV1 trees (nested sets of field paths) as one."""
    merged = dict(a)
    for name, value in b.items():
        merged[name] = _union(merged.get(name) or {}, value) if value else merged.get(name, {})
    return merged


def fields_owned_by_applier(live: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """`live`'s managedFields with what the operator's create (a POST) owns handed to its
    applies, or None when there is nothing to hand over.

    A create is recorded as an "Update" by FIELD_MANAGER, an apply as an "Apply": the API
    server keeps them apart, and an apply that leaves a field out removes it only where the
    applier owns it. Without the hand-over a field the operator once set and no longer wants
    (a capability, a flag's value) would stay on the child for ever.
    """
    entries = list(live["metadata"].get("managedFields") or [])
    created = [
        e for e in entries if e.get("manager") == FIELD_MANAGER and e.get("operation") == "Update"
    ]
    if not created:
        return None
    applied = [
        e for e in entries if e.get("manager") == FIELD_MANAGER and e.get("operation") == "Apply"
    ]
    fields: dict[str, Any] = {}
    for entry in [*created, *applied]:
        fields = _union(fields, entry.get("fieldsV1") or {})
    owner = {
        "manager": FIELD_MANAGER,
        "operation": "Apply",
        "apiVersion": (applied or created)[0].get("apiVersion", live.get("apiVersion")),
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }
    others = [e for e in entries if e.get("manager") != FIELD_MANAGER]
    return [*others, owner]


@dataclass
class Applied:
    obj: o.Obj
    action: str  # created, updated, unchanged, conflict, kept
    message: str = ""


class EngineProbe(NamedTuple):
    """One engine as the fleet's scheduler sees it."""

    capacity_tokens: int
    kv_usage: float
    # Why the scheduler takes no turns to it (its last failure); "" while it takes turns.
    taken_out: str = ""


class SchedulerProbe(NamedTuple):
    """What a fleet's scheduler says of itself (GetSchedulerStatus)."""

    engines: dict[str, EngineProbe]
    weights_version: int
    # The folder its engines' weights came from; "" while they serve their own.
    weights_path: str
    # Turns waiting for KV room on an engine (what spec.autoscaling's queuedTurns counts).
    queued: int = 0


# Scheduler probe: (endpoint, the fleet's namespace, whose token it takes) -> what the
# scheduler says, or None.
Probe = Callable[[str, str], Awaitable[SchedulerProbe | None]]


async def no_probe(endpoint: str, namespace: str) -> SchedulerProbe | None:
    return None


@dataclass
class Context:
    kube: k.Kube
    settings: OperatorSettings
    probe: Probe = no_probe
    # (kind, namespace, name) -> hash last applied (skips a GET when unchanged).
    applied: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # The resourceVersion of each resource after our own last status patch: the watch event
    # that reports it needs no reconcile (it shows what this reconcile just computed).
    written: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # Children known to exist (created or seen by this process): updated, never POSTed.
    exists: set[tuple[str, str, str]] = field(default_factory=set)
    # (namespace, name) -> the TrainingRun phase last seen (an Event per transition).
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    # (namespace, name) -> a TrainingRun's activity as last seen, and when it was first seen
    # (this process's monotonic clock): the watchdog's memory.
    activities: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    # (namespace, name) -> when a failed TrainingRun's trainer was first seen still running
    # (monotonic): it is given time to exit and state why (trainingrun.trainer_exiting).
    exiting: dict[tuple[str, str], float] = field(default_factory=dict)
    _server_version: tuple[int, int] | None = None

    async def server_version(self) -> tuple[int, int]:
        """The API server's (major, minor), asked once."""
        if self._server_version is None:
            answer = await self.kube.request("GET", "/version")
            minor = "".join(c for c in str(answer.get("minor", "0")) if c.isdigit()) or "0"
            self._server_version = (int(answer.get("major", "1")), int(minor))
        return self._server_version

    def forget_child(self, kind: str, namespace: str, name: str) -> None:
        self.applied.pop((kind, namespace, name), None)
        self.exists.discard((kind, namespace, name))

    async def apply(
        self, owner: Mapping[str, Any], desired: o.Obj, *, immutable: bool = False
    ) -> Applied:
        """Create or update one child. `immutable`: never update (a Job's pod template)."""
        meta = desired["metadata"]
        key = (desired["kind"], meta["namespace"], meta["name"])
        want = meta["annotations"][o.ANNOTATION_HASH]
        if self.applied.get(key) == want:
            metrics.CHILD_APPLIES.labels(desired["kind"], "unchanged").inc()
            return Applied(desired, "unchanged")
        url = k.path_of(desired)
        if key not in self.exists and not owner.get("status"):
            # A resource never reconciled yet has no children: create without reading first
            # (one round trip). A create, not an apply: an apply would merge into an object of
            # the same name that someone else made (and so adopt it); a create of one that
            # exists fails (409) and falls through to the ownership check below.
            collection = k.path(desired["apiVersion"], desired["kind"], meta["namespace"])
            try:
                created = await self.kube.request(
                    "POST", collection, desired, params={"fieldManager": FIELD_MANAGER}
                )
            except k.ApiError as error:
                if error.status != 409:
                    raise
            else:
                self.applied[key] = want
                self.exists.add(key)
                metrics.CHILD_APPLIES.labels(desired["kind"], "created").inc()
                return Applied(created, "created")
        live = await self.kube.get(url)
        if live is not None:
            self.exists.add(key)
            owners = live["metadata"].get("ownerReferences") or []
            uid = owner["metadata"]["uid"]
            if not any(ref.get("uid") == uid for ref in owners):
                metrics.CHILD_APPLIES.labels(desired["kind"], "conflict").inc()
                raise ChildConflict(
                    f"{desired['kind']} {meta['name']} exists and is not owned by "
                    f"{owner['kind']} {owner['metadata']['name']}"
                )
            have = (live["metadata"].get("annotations") or {}).get(o.ANNOTATION_HASH)
            if have == want or immutable:
                self.applied[key] = want if have == want else self.applied.get(key, "")
                action = "unchanged" if have == want else "kept"
                metrics.CHILD_APPLIES.labels(desired["kind"], action).inc()
                return Applied(live, action)
            managed = fields_owned_by_applier(live)
            if managed is not None:
                await self.kube.request(
                    "PATCH",
                    url,
                    [
                        {
                            "op": "test",
                            "path": "/metadata/resourceVersion",
                            "value": live["metadata"]["resourceVersion"],
                        },
                        {"op": "replace", "path": "/metadata/managedFields", "value": managed},
                    ],
                    content_type="application/json-patch+json",
                )
        result = await self.kube.request(
            "PATCH",
            url,
            desired,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        action = "created" if live is None else "updated"
        self.applied[key] = want
        self.exists.add(key)
        metrics.CHILD_APPLIES.labels(desired["kind"], action).inc()
        return Applied(result, action)

    async def apply_all(
        self, owner: Mapping[str, Any], desired: Iterable[o.Obj]
    ) -> dict[str, Applied]:
        """Apply children concurrently; returns them by "Kind/name"."""
        items = list(desired)
        results = await asyncio.gather(*(self.apply(owner, item) for item in items))
        return {
            f"{i['kind']}/{i['metadata']['name']}": r for i, r in zip(items, results, strict=True)
        }

    async def live(self, desired: Mapping[str, Any]) -> o.Obj | None:
        """The child as it is now (its status), or None."""
        return await self.kube.get(k.path_of(desired))

    async def set_conditions(
        self,
        owner: Mapping[str, Any],
        updates: list[Condition],
        status: BaseModel | None = None,
    ) -> None:
        """Patch conditions (and the fields set in `status`, a model of the resource's
        status); an Event per transition."""
        before = (owner.get("status") or {}).get("conditions")
        fields = status_fields(status) if status is not None else {}
        patch = {**fields, "conditions": cond.merge(before, updates)}
        if await self.patch_status(owner, patch):
            await self.condition_events(owner, before, patch["conditions"])

    async def apply_children(
        self,
        owner: Mapping[str, Any],
        children: Iterable[o.Obj],
        immutable: Iterable[o.Obj] = (),
    ) -> Problem | None:
        """Apply the children (and create the `immutable` ones, never updated after); a
        ChildConflict comes back as the problem, an API error is raised."""
        try:
            await self.apply_all(owner, children)
            for child in immutable:
                await self.apply(owner, child, immutable=True)
        except ChildConflict as error:
            return Reason.CHILD_CONFLICT, str(error)
        return None

    async def pods(self, owner: Mapping[str, Any]) -> list[o.Obj]:
        meta = owner["metadata"]
        selector = (
            f"{o.LABEL_INSTANCE}={o.label_value(meta['name'])},{o.LABEL_OWNER_KIND}={owner['kind']}"
        )
        return await self.kube.list(k.path("v1", "Pod", meta["namespace"]), selector)

    async def refusals(self, namespace: str, kind: str, names: Iterable[str]) -> dict[str, str]:
        """name -> the message of the newest FailedCreate event of each child `kind` named
        (its controller could not create a pod: a quota, an admission policy)."""
        found: dict[str, tuple[str, str]] = {}
        for name in names:
            selector = f"involvedObject.kind={kind},involvedObject.name={name},reason=FailedCreate"
            events = await self.kube.list(k.path("v1", "Event", namespace), field_selector=selector)
            for event in events:
                when = event.get("lastTimestamp") or event.get("eventTime") or ""
                if name not in found or when > found[name][0]:
                    found[name] = (when, str(event.get("message", "")))
        return {name: message for name, (_, message) in found.items()}

    async def patch_status(self, owner: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
        """Merge-patch the fields in `status` that differ from the live status."""
        live = owner.get("status") or {}
        changed = {key: value for key, value in status.items() if live.get(key) != value}
        if not changed:
            return False
        result = await self.kube.merge_patch(k.path_of(owner, "status"), {"status": changed})
        metrics.STATUS_PATCHES.labels(owner["kind"]).inc()
        meta = owner["metadata"]
        self.written[(owner["kind"], meta["namespace"], meta["name"])] = result.get(
            "metadata", {}
        ).get("resourceVersion", "")
        return True

    async def event(
        self, owner: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        """Post a Kubernetes Event about `owner` (best effort)."""
        meta = owner["metadata"]
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{time.time_ns():x}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": FIELD_MANAGER},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": FIELD_MANAGER,
        }
        try:
            await self.kube.create(body)
            metrics.EVENTS.labels(owner["kind"], type_).inc()
        except (k.ApiError, OSError) as error:
            log.warning("event not posted: %s", error)

    async def condition_events(
        self,
        owner: Mapping[str, Any],
        before: list[Mapping[str, Any]] | None,
        after: list[dict[str, Any]],
    ) -> None:
        for item in cond.transitions(before, after):
            warning = (
                item["status"] == ConditionStatus.FALSE and item["reason"] not in cond.QUIET_REASONS
            )
            message = f"{item['type']}={item['status']}"
            if item.get("message"):
                message += f": {item['message']}"
            await self.event(owner, item["reason"], message, "Warning" if warning else "Normal")


async def reconcile_children(
    ctx: Context,
    owner: Mapping[str, Any],
    status: type[BaseModel],
    spec: Callable[[], SpecT],
    policy: Callable[[SpecT], str | None],
    children: Callable[[SpecT], list[o.Obj]],
) -> SpecT | None:
    """The ladder of a resource whose Ready condition says what stopped it: validate the
    spec (`spec()`, which raises ValidationError), the cluster's policy (`policy`: why it is
    refused, or None), apply the `children`; the spec once they are applied, else None with
    Ready False written (InvalidSpec with `status`'s observedGeneration, ChildConflict). An
    API error is written (ApplyFailed), then raised: the queue retries with backoff."""
    generation = owner["metadata"].get("generation", 0)
    try:
        parsed = spec()
    except ValidationError as error:
        refused: str | None = validation_message(error)
    else:
        refused = policy(parsed)
    if refused:
        invalid = condition(ConditionType.READY, False, Reason.INVALID_SPEC, refused, generation)
        await ctx.set_conditions(owner, [invalid], status(observed_generation=generation))
        return None
    try:
        problem = await ctx.apply_children(owner, children(parsed))
    except k.ApiError as error:
        failed = condition(
            ConditionType.READY, False, Reason.APPLY_FAILED, error.message[:500], generation
        )
        await ctx.set_conditions(owner, [failed])
        raise
    if problem is not None:
        await ctx.set_conditions(
            owner, [condition(ConditionType.READY, False, *problem, generation)]
        )
        return None
    return parsed


Reconcile = Callable[[Context, o.Obj], Awaitable[None]]


@dataclass
class _State:
    dirty: bool = False
    running: bool = False
    failures: int = 0
    retry: asyncio.TimerHandle | None = None
    scheduled: asyncio.TimerHandle | None = None


class WorkQueue:
    """Per-resource coalescing: a trigger while a reconcile runs makes it run once more."""

    def __init__(
        self,
        context: Context,
        reconcilers: Mapping[str, Reconcile],
        api_versions: Mapping[str, str],
        concurrency: int = 16,
    ) -> None:
        self.context = context
        self.reconcilers = reconcilers
        self.api_versions = api_versions
        self.known: set[Key] = set()
        self._states: dict[Key, _State] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._limit = asyncio.Semaphore(concurrency)
        self.errors = 0
        self.completed = 0

    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        """Reconcile `key` now, or after `delay` seconds: triggers that come in bursts (a
        child's status changing several times) are coalesced into one reconcile."""
        state = self._states.setdefault(key, _State())
        state.dirty = True
        if state.running or state.scheduled is not None:
            return
        if delay > 0:
            state.scheduled = asyncio.get_running_loop().call_later(delay, self._start, key)
            return
        self._start(key)

    def _start(self, key: Key) -> None:
        state = self._states.setdefault(key, _State())
        state.scheduled = None
        if state.running:
            return
        state.running = True
        metrics.QUEUE_DEPTH.inc()
        task = asyncio.create_task(self._drain(key, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, key: Key) -> None:
        self.known.discard(key)
        state = self._states.get(key)
        if state and state.retry:
            state.retry.cancel()
        if state and state.scheduled:
            state.scheduled.cancel()
            state.scheduled = None
        if state and not state.running:
            self._states.pop(key, None)

    async def _drain(self, key: Key, state: _State) -> None:
        try:
            while state.dirty:
                state.dirty = False
                async with self._limit:
                    ok = await self._run(key)
                if ok:
                    state.failures = 0
                else:
                    state.failures += 1
                    delay = min(60.0, 0.5 * 2 ** (state.failures - 1))
                    if state.retry:
                        state.retry.cancel()
                    state.retry = asyncio.get_running_loop().call_later(delay, self.enqueue, key)
        finally:
            state.running = False
            metrics.QUEUE_DEPTH.dec()

    async def _run(self, key: Key) -> bool:
        kind, namespace, name = key
        started = time.perf_counter()
        metrics.IN_FLIGHT.inc()
        try:
            body = await self.context.kube.get(
                k.path(self.api_versions[kind], kind, namespace, name)
            )
            if body is None:  # deleted: owner references clean up after it
                self.forget(key)
                return True
            body.setdefault("kind", kind)
            body.setdefault("apiVersion", self.api_versions[kind])
            await self.reconcilers[kind](self.context, body)
            metrics.RECONCILES.labels(kind, "ok").inc()
            self.completed += 1
            return True
        except asyncio.CancelledError:
            raise
        except Exception as error:  # retried with backoff
            self.errors += 1
            metrics.RECONCILES.labels(kind, "error").inc()
            log.warning(
                "reconcile failed, will retry",
                exc_info=not isinstance(error, k.ApiError | ChildConflict),
                extra={
                    "fields": {
                        "kind": kind,
                        "namespace": namespace,
                        "name": name,
                        "error": str(error),
                    }
                },
            )
            return False
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)

    def idle(self) -> bool:
        return not any(s.running or s.scheduled for s in self._states.values())

    async def resync_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for key in list(self.known):
                self.enqueue(key)

    async def close(self) -> None:
        for state in self._states.values():
            for timer in (state.retry, state.scheduled):
                if timer:
                    timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
