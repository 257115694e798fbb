"""Kubernetes discovery on pod objects as the API serializes them (no API server here: the
end-to-end test against a real cluster comes with the operator's e2e tests)."""

from __future__ import annotations

from typing import Any

from kubestar.scheduler.discovery import KubernetesDiscovery, engines_from_pods
from kubestar.scheduler.scheduler import Scheduler, SchedulerConfig

from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine


def pod(name: str, ip: str, ready: bool = True, phase: str = "Running", **meta: Any) -> Any:
    return {
        "metadata": {"name": name, **meta},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_ready_running_pods_become_engines() -> None:
    pods = [
        pod("engine-0", "10.0.0.5"),
        pod("engine-1", "10.0.0.6", ready=False),
        pod("engine-2", "10.0.0.7", phase="Pending"),
        pod("engine-3", "10.0.0.8", deletionTimestamp="2025-01-01T00:00:00Z"),
        pod("engine-4", "fd00::4"),
        {"metadata": {"name": "no-status"}},
    ]
    assert engines_from_pods(pods, 8000) == {
        "engine-0": "http://10.0.0.5:8000",
        "engine-4": "http://[fd00::4]:8000",
    }


class LocalDiscovery(KubernetesDiscovery):
    """Pods listed by the test; their IPs routed to fake engines on 127.0.0.1."""

    def __init__(self, scheduler: Scheduler, ports: dict[str, int]) -> None:
        super().__init__(scheduler, "app=engine", port=8000)
        self.ports = ports
        self.listed: list[dict[str, Any]] = []

    def _list_pods(self) -> list[dict[str, Any]]:
        return self.listed

    def engines(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        return {
            name: f"http://127.0.0.1:{self.ports[url.split('//')[1].split(':')[0]]}"
            for name, url in super().engines(pods).items()
        }


async def test_sync_adds_and_removes_engines_as_pods_come_and_go() -> None:
    fakes = [await FakeEngine().start(), await FakeEngine().start()]
    scheduler = Scheduler([("static", fakes[0].url)], fast_config())
    await scheduler.start()
    discovery = LocalDiscovery(scheduler, {"10.0.0.1": fakes[0].port, "10.0.0.2": fakes[1].port})
    try:
        discovery.listed = [pod("engine-0", "10.0.0.1"), pod("engine-1", "10.0.0.2", ready=False)]
        await discovery.sync()
        assert [(e.name, e.healthy) for e in scheduler.engines()] == [
            ("static", True),
            ("engine-0", True),
        ]
        discovery.listed = [pod("engine-1", "10.0.0.2")]
        await discovery.sync()
        assert [e.name for e in scheduler.engines()] == ["static", "engine-1"]
        discovery.listed = []
        await discovery.sync()
        assert [e.name for e in scheduler.engines()] == ["static"]  # static engines stay
    finally:
        await scheduler.stop()
        for fake in fakes:
            await fake.stop()


def test_discovery_needs_no_kubernetes_client_until_used() -> None:
    scheduler = Scheduler([], SchedulerConfig())
    discovery = KubernetesDiscovery(scheduler, "app=engine")
    assert discovery.known == {} and discovery._api is None
