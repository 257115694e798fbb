"""Leader election as client-go does it, against a real API server's Leases: another holder's
lease is judged by when this replica saw it change, never by the times written in it (another
replica's clock may be off), the holder steps down within its renew deadline, and each
request gives up before that deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubestar.common import kube as k
from kubestar.operator.leader import MICRO, LeaderElector, check_timing

from e2e.local_cluster import LocalCluster


class Clock:
    """This replica's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def kube(cluster: LocalCluster) -> AsyncIterator[k.Kube]:
    admin = (cluster.directory / "pki" / "admin.token").read_text().strip()
    client = k.Kube(k.Connection(server=cluster.server, token=admin, ca_file=cluster.ca_file))
    yield client
    await client.close()


def elector(kube: k.Kube, namespace: str, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(kube, namespace, "lease", identity=identity, clock=clock)


async def renew_with_a_skewed_clock(kube: k.Kube, namespace: str, identity: str) -> None:
    """The other replica renews, writing times from a clock an hour slow."""
    url = k.path("coordination.k8s.io/v1", "Lease", namespace, "lease")
    lease = await kube.get(url)
    assert lease is not None
    stamp = (datetime.now(UTC) - timedelta(hours=1)).strftime(MICRO)
    lease["spec"].update(holderIdentity=identity, renewTime=stamp, leaseDurationSeconds=15)
    await kube.request("PUT", url, lease)


async def test_a_renewing_holder_keeps_the_lease_whatever_its_clock_says(
    kube: k.Kube, namespace: str
) -> None:
    clock = Clock()
    first = elector(kube, namespace, "first", clock)
    second = elector(kube, namespace, "second", clock)
    assert await first.try_acquire()
    await renew_with_a_skewed_clock(kube, namespace, "first")
    # Its renewTime is an hour old; judged by the written times it would look expired.
    assert not await second.try_acquire()
    for _ in range(5):  # the holder renews every few seconds: never taken over
        clock.now += 10
        await renew_with_a_skewed_clock(kube, namespace, "first")
        assert not await second.try_acquire()
    # It stops renewing: after a whole lease of no change seen, the lease is taken.
    clock.now += 14
    assert not await second.try_acquire()
    clock.now += 2
    assert await second.try_acquire()
    lease = await kube.get(k.path("coordination.k8s.io/v1", "Lease", namespace, "lease"))
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "second"
    assert lease["spec"]["leaseTransitions"] == 1
    # The first, judging by what it sees, does not take it back.
    assert not await first.try_acquire()


async def test_a_released_lease_is_taken_at_once(kube: k.Kube, namespace: str) -> None:
    clock = Clock()
    first = elector(kube, namespace, "first", clock)
    second = elector(kube, namespace, "second", clock)
    assert await first.try_acquire()
    assert not await second.try_acquire()
    await first.release()
    assert await second.try_acquire()


class Hanging:
    """A Kube whose requests never answer (an API server that stopped responding)."""

    def __init__(self) -> None:
        self.requests = 0

    async def _hang(self, *_: Any, **__: Any) -> Any:
        self.requests += 1
        await asyncio.Event().wait()

    def get(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._hang()

    def request(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._hang()


async def test_the_holder_steps_down_within_its_renew_deadline() -> None:
    hanging = Hanging()
    holder = LeaderElector(
        hanging,  # type: ignore[arg-type]
        "ns",
        lease_seconds=3,
        renew_deadline_seconds=1.0,
        retry_seconds=0.1,
        request_timeout_seconds=0.4,
    )
    lost = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(holder.hold(lost), timeout=10)
    took = loop.time() - started
    assert lost.is_set()
    # Requests gave up after the request timeout and were tried again until the deadline;
    # the holder stopped before the lease (3 s) could run out for the others.
    assert hanging.requests >= 2
    assert 0.9 <= took < 3.0, took


@pytest.mark.parametrize(
    ("lease", "deadline", "retry", "timeout", "named"),
    [
        (15, 15, 2, 5, "renew deadline (15 s) < lease (15 s)"),
        (15, 10, 10, 5, "retry (10 s) < renew deadline"),
        (15, 10, 2, 10, "request timeout (10 s) must be shorter"),
    ],
)
def test_timings_out_of_order_are_refused(
    lease: float, deadline: float, retry: float, timeout: float, named: str
) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_timing(lease, deadline, retry, timeout)
