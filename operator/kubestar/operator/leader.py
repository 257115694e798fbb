"""Leader election with a coordination.k8s.io/v1 Lease (as client-go's leaderelection does):
only the holder reconciles; the others wait. The holder renews every `renew_seconds`; if it
cannot renew for `lease_seconds` it stops (and its pod restarts), and another replica takes
the lease once it has expired. Writes use the Lease's resourceVersion, so two candidates never
both win."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from kubestar.common import kube as k
from kubestar.operator import metrics

log = logging.getLogger(__name__)
MICRO = "%Y-%m-%dT%H:%M:%S.%fZ"


def _now() -> datetime:
    return datetime.now(UTC)


def _parse(value: str | None) -> datetime | None:
    if not value:
        return None
    for fmt in (MICRO, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(value, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def expired(spec: dict[str, Any], now: datetime) -> bool:
    renewed = _parse(spec.get("renewTime")) or _parse(spec.get("acquireTime"))
    duration = int(spec.get("leaseDurationSeconds") or 15)
    return renewed is None or renewed + timedelta(seconds=duration) < now


class LeaderElector:
    def __init__(
        self,
        kube: k.Kube,
        namespace: str,
        name: str = "kubestar-operator",
        identity: str = "",
        lease_seconds: int = 15,
        renew_seconds: float = 5.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.retry_seconds = retry_seconds
        self.url = k.path("coordination.k8s.io/v1", "Lease", namespace, name)

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        stamp = _now().strftime(MICRO)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": acquired or stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    async def try_acquire(self) -> bool:
        """One attempt to take or renew the lease."""
        lease = await self.kube.get(self.url)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0),
            }
            try:
                await self.kube.create(body)
                return True
            except k.ApiError as error:
                if error.status == 409:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if holder != self.identity and holder and not expired(spec, _now()):
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            lease["spec"] = self._spec(transitions, spec.get("acquireTime"))
        else:
            lease["spec"] = self._spec(transitions + 1)
        try:
            await self.kube.request("PUT", self.url, lease)
            return True
        except k.ApiError as error:
            if error.status == 409:  # someone else wrote it first
                return False
            raise

    async def acquire(self) -> None:
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    log.info("became leader", extra={"fields": {"identity": self.identity}})
                    metrics.LEADER.set(1)
                    return
            except (k.ApiError, OSError) as error:
                log.warning("lease: %s", error)
            if not announced:
                log.info("waiting for the leader lease", extra={"fields": {"lease": self.name}})
                announced = True
            await asyncio.sleep(self.retry_seconds)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew until renewal fails for a whole lease period; then set `lost`."""
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                if await self.try_acquire():
                    last = asyncio.get_running_loop().time()
                    continue
                log.error("the lease was taken by another replica")
            except (k.ApiError, OSError) as error:
                log.warning("lease renewal failed: %s", error)
                if asyncio.get_running_loop().time() - last < self.lease_seconds:
                    continue
            metrics.LEADER.set(0)
            lost.set()
            return

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so that a successor need not wait."""
        try:
            lease = await self.kube.get(self.url)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                await self.kube.request("PUT", self.url, lease)
        except (k.ApiError, OSError) as error:
            log.warning("lease not released: %s", error)
        metrics.LEADER.set(0)
