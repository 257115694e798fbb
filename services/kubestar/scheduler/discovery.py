"""Engines discovered in Kubernetes: the ready pods that match a label selector.

Lists the pods every `interval` seconds with kubestar's API client (kubestar.common.kube),
connected as `kube.connect()` says: a kubeconfig when $KUBECONFIG names one, else the pod's
service account. A pod that turns ready is added as an engine named after the pod
(`http://<pod IP>:<port>`, the port its container names `http`, else the one given: on a
node's network each engine has its own); one that is deleted (as soon as it is terminating,
while it still serves) or stops being ready is removed, and its turns in flight go to the
other engines. Engines given statically are never touched.

Tested with recorded pod objects and a stand-in API server (tests/scheduler); against a real
API server with the operator's end-to-end tests (e2e/), where a RolloutFleet runs engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kubestar.common import kube

if TYPE_CHECKING:
    from kubestar.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return kube.pod_ready(pod)


def http_port(pod: Mapping[str, Any], default: int) -> int:
    """The port the pod's containers name `http`, else `default`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def engines_from_pods(pods: Iterable[Mapping[str, Any]], port: int) -> dict[str, str]:
    """Engine name -> URL for the ready pods (pods as the API serializes them: camelCase),
    on each pod's `http` port, else on `port`."""
    engines: dict[str, str] = {}
    for pod in pods:
        if _ready(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            engines[pod["metadata"]["name"]] = f"http://{host}:{http_port(pod, port)}"
    return engines


class KubernetesDiscovery:
    def __init__(
        self,
        scheduler: Scheduler,
        selector: str,
        namespace: str = "default",
        port: int = 8000,
        interval: float = 5.0,
        client: kube.Kube | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.selector = selector
        self.namespace = namespace
        self.port = port
        self.interval = interval
        self.known: dict[str, str] = {}
        # Connected on the first list when not given (no credentials needed until then);
        # closed by stop().
        self.client = client
        self._task: asyncio.Task[None] | None = None

    async def list_pods(self) -> list[kube.Obj]:
        """The pods that match the selector, as the API serializes them."""
        if self.client is None:
            self.client = kube.Kube(kube.connect())
        return await self.client.list(kube.path("v1", "Pod", self.namespace), self.selector)

    def engines(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Engine name -> URL for a pod list."""
        return engines_from_pods(pods, self.port)

    async def sync(self) -> None:
        """One round: add the pods that became ready, remove the ones that went away."""
        wanted = self.engines(await self.list_pods())
        for name in [n for n in self.known if self.known[n] != wanted.get(n)]:
            del self.known[name]
            with contextlib.suppress(KeyError):
                await self.scheduler.remove_engine(name)
        for name, url in wanted.items():
            if name not in self.known:
                self.known[name] = url
                await self.scheduler.add_engine(name, url)

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # API server unreachable, RBAC, ...: try again later
                log.warning(
                    "engine discovery failed",
                    extra={"fields": {"selector": self.selector, "error": repr(error)[:500]}},
                )
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubernetes discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
