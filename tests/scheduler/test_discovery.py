"""Kubernetes discovery on pod objects as the API serializes them, listed from a stand-in API
server through kubestar's client (the test against a real cluster comes with the operator's
e2e tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubestar.common import kube
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.discovery import KubernetesDiscovery, engines_from_pods
from kubestar.scheduler.scheduler import Scheduler

from tests.common.fake_api_server import Certificate, FakeApiServer, in_cluster
from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine

PODS = "/api/v1/namespaces/team/pods"


def pod(
    name: str,
    ip: str,
    ready: bool = True,
    phase: str = "Running",
    http_port: int | None = None,
    **meta: Any,
) -> Any:
    ports = [{"name": "metrics", "containerPort": 9100}]
    if http_port is not None:
        ports.append({"name": "http", "containerPort": http_port})
    return {
        "metadata": {"name": name, **meta},
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
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


async def test_engines_on_one_node_are_reached_on_the_ports_their_pods_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node's network every engine pod has the node's address and a port of its own
    (the operator's engine i serves on engine.port + i): each is reached on its own."""
    fakes = [await FakeEngine().start(), await FakeEngine().start()]
    scheduler = Scheduler([], fast_config())
    await scheduler.start()
    with FakeApiServer(Certificate.create(tmp_path)) as server:
        in_cluster(monkeypatch, tmp_path, server, token="scheduler-token")
        discovery = KubernetesDiscovery(scheduler, "app=engine", namespace="team", port=1)
        pods = [pod(f"engine-{i}", "127.0.0.1", http_port=f.port) for i, f in enumerate(fakes)]
        server.answer("GET", PODS, {"kind": "PodList", "items": pods})
        try:
            await discovery.sync()
            assert discovery.known == {
                f"engine-{i}": f"http://127.0.0.1:{fake.port}" for i, fake in enumerate(fakes)
            }
            assert [(e.name, e.healthy) for e in scheduler.engines()] == [
                ("engine-0", True),
                ("engine-1", True),
            ]
        finally:
            await discovery.stop()
            await scheduler.stop()
            for fake in fakes:
                await fake.stop()


class LocalDiscovery(KubernetesDiscovery):
    """Pods listed by the API server; their IPs routed to fake engines on 127.0.0.1."""

    def __init__(self, scheduler: Scheduler, ports: dict[str, int]) -> None:
        super().__init__(scheduler, "app=engine", namespace="team", port=8000, interval=5.0)
        self.ports = ports

    def engines(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        return {
            name: f"http://127.0.0.1:{self.ports[url.split('//')[1].split(':')[0]]}"
            for name, url in super().engines(pods).items()
        }


async def test_sync_adds_and_removes_engines_as_pods_come_and_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = [await FakeEngine().start(), await FakeEngine().start()]
    scheduler = Scheduler([("static", fakes[0].url)], fast_config())
    await scheduler.start()
    with FakeApiServer(Certificate.create(tmp_path)) as server:
        # The scheduler pod's own credentials: its service account, the API server's address.
        in_cluster(monkeypatch, tmp_path, server, token="scheduler-token")
        discovery = LocalDiscovery(
            scheduler, {"10.0.0.1": fakes[0].port, "10.0.0.2": fakes[1].port}
        )

        def listed(*pods: dict[str, Any]) -> None:
            server.answer("GET", PODS, {"kind": "PodList", "items": list(pods)})

        try:
            listed(pod("engine-0", "10.0.0.1"), pod("engine-1", "10.0.0.2", ready=False))
            await discovery.sync()
            assert [(e.name, e.healthy) for e in scheduler.engines()] == [
                ("static", True),
                ("engine-0", True),
            ]
            listed(pod("engine-1", "10.0.0.2"))
            await discovery.sync()
            assert [e.name for e in scheduler.engines()] == ["static", "engine-1"]
            listed()
            await discovery.sync()
            assert [e.name for e in scheduler.engines()] == ["static"]  # static engines stay
        finally:
            await discovery.stop()
            await scheduler.stop()
            for fake in fakes:
                await fake.stop()
        assert [(r.method, r.path, r.query) for r in server.requests] == [
            ("GET", PODS, {"labelSelector": "app=engine"})
        ] * 3
        assert {r.headers["Authorization"] for r in server.requests} == {"Bearer scheduler-token"}


async def test_a_refused_list_changes_no_engine() -> None:
    scheduler = Scheduler([], SchedulerConfig())
    with FakeApiServer() as server:
        server.answer("GET", PODS, {"reason": "Forbidden", "message": "no"}, status=403)
        client = kube.Kube(kube.Connection(server=server.url, token="t"))
        discovery = KubernetesDiscovery(scheduler, "app=engine", namespace="team", client=client)
        with pytest.raises(kube.ApiError, match="403"):
            await discovery.sync()
        await discovery.stop()
    assert discovery.known == {} and scheduler.engines() == []


def test_discovery_needs_no_credentials_until_it_lists() -> None:
    scheduler = Scheduler([], SchedulerConfig())
    discovery = KubernetesDiscovery(scheduler, "app=engine")
    assert discovery.known == {} and discovery.client is None
