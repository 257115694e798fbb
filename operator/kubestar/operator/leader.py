"""Leader election with a coordination.k8s.io/v1 Lease, as client-go's leaderelection does
it: only the holder reconciles; the others wait.

Time is judged by this replica's own clock, never by the times written in the Lease (another
replica's clock may be minutes off): another holder's lease is taken over only once its
record has not changed for `lease_seconds` since this replica *observed* it change. The
holder renews every `retry_seconds` and steps down (its pod restarts) when it has not renewed
for `renew_deadline_seconds`, which is shorter than the lease, so it stops before anyone may
take over. Each request to the API server gives up after `request_timeout_seconds`, shorter
than both, so one hung request cannot outlast the deadline. Writes carry the Lease's
resourceVersion, so two candidates never both win.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubestar.common import kube as k
from kubestar.operator import metrics

log = logging.getLogger(__name__)
MICRO = "%Y-%m-%dT%H:%M:%S.%fZ"
T = TypeVar("T")


def _now() -> datetime:
    return datetime.now(UTC)


def check_timing(
    lease_seconds: float, renew_deadline: float, retry_seconds: float, request_timeout: float
) -> None:
    """client-go's rules, each broken one named: retry < renew deadline < lease, and a
    request times out before the renew deadline."""
    if not 0 < retry_seconds < renew_deadline < lease_seconds:
        raise ValueError(
            f"leader election: need 0 < retry ({retry_seconds:g} s) < renew deadline "
            f"({renew_deadline:g} s) < lease ({lease_seconds:g} s)"
        )
    if not 0 < request_timeout < renew_deadline:
        raise ValueError(
            f"leader election: the request timeout ({request_timeout:g} s) must be shorter "
            f"than the renew deadline ({renew_deadline:g} s)"
        )


class LeaderElector:
    def __init__(
        self,
        kube: k.Kube,
        namespace: str,
        name: str = "kubestar-operator",
        identity: str = "",
        lease_seconds: int = 15,
        renew_deadline_seconds: float = 10.0,
        retry_seconds: float = 2.0,
        request_timeout_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_timing(lease_seconds, renew_deadline_seconds, retry_seconds, request_timeout_seconds)
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.lease_seconds = lease_seconds
        self.renew_deadline = renew_deadline_seconds
        self.retry_seconds = retry_seconds
        self.request_timeout = request_timeout_seconds
        self.clock = clock
        self.url = k.path("coordination.k8s.io/v1", "Lease", namespace, name)
        # The lease's record as last seen, and when (by `clock`) it was seen to change.
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0

    async def _request(self, call: Awaitable[T], timeout: float | None = None) -> T:
        return await asyncio.wait_for(
            call, min(timeout or self.request_timeout, self.request_timeout)
        )

    def _observe(self, spec: dict[str, Any]) -> None:
        record = tuple(
            spec.get(key)
            for key in ("holderIdentity", "renewTime", "acquireTime", "leaseTransitions")
        )
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()

    def held_by_another(self, spec: dict[str, Any]) -> bool:
        """Another replica holds the lease and, by this replica's clock, has renewed it
        within its duration (first sight counts as a renewal, as in client-go)."""
        self._observe(spec)
        holder = spec.get("holderIdentity")
        if not holder or holder == self.identity:
            return False
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        return self.clock() < self._observed_at + duration

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        stamp = _now().strftime(MICRO)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": acquired or stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    async def try_acquire(self, timeout: float | None = None) -> bool:
        """One attempt to take or renew the lease; each request gives up after `timeout`
        (at most the request timeout)."""
        lease = await self._request(self.kube.get(self.url), timeout)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0),
            }
            try:
                await self._request(self.kube.create(body), timeout)
                return True
            except k.ApiError as error:
                if error.status == 409:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if self.held_by_another(spec):
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            lease["spec"] = self._spec(transitions, spec.get("acquireTime"))
        else:
            lease["spec"] = self._spec(transitions + 1)
        try:
            written = await self._request(self.kube.request("PUT", self.url, lease), timeout)
        except k.ApiError as error:
            if error.status == 409:  # someone else wrote it first
                return False
            raise
        self._observe((written or lease).get("spec") or {})
        return True

    async def acquire(self) -> None:
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    log.info("became leader", extra={"fields": {"identity": self.identity}})
                    metrics.LEADER.set(1)
                    return
            except (k.ApiError, OSError, TimeoutError) as error:
                log.warning("lease: %s", error or type(error).__name__)
            if not announced:
                log.info("waiting for the leader lease", extra={"fields": {"lease": self.name}})
                announced = True
            await asyncio.sleep(self.retry_seconds)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew every `retry_seconds`; set `lost` as soon as another replica holds the
        lease, or when no renewal has succeeded within `renew_deadline` (before the lease
        can run out for the others: no attempt runs past the deadline)."""
        renewed = self.clock()
        while True:
            await asyncio.sleep(self.retry_seconds)
            left = renewed + self.renew_deadline - self.clock()
            try:
                if left <= 0:
                    raise TimeoutError("no time left before the renew deadline")
                if await self.try_acquire(timeout=left):
                    renewed = self.clock()
                    continue
                log.error("the lease was taken by another replica")
            except (k.ApiError, OSError, TimeoutError) as error:
                late = self.clock() - renewed
                log.warning(
                    "lease renewal failed (%.1f s since the last renewal, deadline %g s): %s",
                    late,
                    self.renew_deadline,
                    error or type(error).__name__,
                )
                if late + self.retry_seconds < self.renew_deadline:
                    continue
            metrics.LEADER.set(0)
            lost.set()
            return

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so that a successor need not wait."""
        try:
            lease = await self._request(self.kube.get(self.url))
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                await self._request(self.kube.request("PUT", self.url, lease))
        except (k.ApiError, OSError, TimeoutError) as error:
            log.warning("lease not released: %s", error)
        metrics.LEADER.set(0)
