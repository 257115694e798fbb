"""Engines discovered in Kubernetes: the ready pods that match a label selector.

Polls the API server every `interval` seconds with the official `kubernetes` client (only
needed when discovery is switched on: `pip install kubernetes`). A pod that turns ready is
added as an engine named after the pod (`http://<pod IP>:<port>`); one that is deleted or
stops being ready is removed, and its turns in flight go to the other engines. Engines given
statically are never touched.

Tested here with recorded pod objects only (`engines_from_pods`); the test against a real API
server comes with the operator's end-to-end tests (e2e/), where a RolloutFleet runs engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubestar.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def engines_from_pods(pods: Iterable[Mapping[str, Any]], port: int) -> dict[str, str]:
    """Engine name -> URL for the ready pods (pods as the API serializes them: camelCase)."""
    engines: dict[str, str] = {}
    for pod in pods:
        if _ready(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            engines[pod["metadata"]["name"]] = f"http://{host}:{port}"
    return engines


class KubernetesDiscovery:
    def __init__(
        self,
        scheduler: Scheduler,
        selector: str,
        namespace: str = "default",
        port: int = 8000,
        interval: float = 5.0,
    ) -> None:
        self.scheduler = scheduler
        self.selector = selector
        self.namespace = namespace
        self.port = port
        self.interval = interval
        self.known: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._api: Any = None

    def _list_pods(self) -> list[dict[str, Any]]:
        """Blocking: runs in a thread."""
        if self._api is None:
            # Imported only when discovery runs; typed as Any (the client ships no types).
            config: Any = importlib.import_module("kubernetes.config")
            client: Any = importlib.import_module("kubernetes.client")
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CoreV1Api()
        pods = self._api.list_namespaced_pod(self.namespace, label_selector=self.selector)
        serialized: dict[str, Any] = self._api.api_client.sanitize_for_serialization(pods)
        items: list[dict[str, Any]] = serialized.get("items") or []
        return items

    def engines(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Engine name -> URL for a pod list."""
        return engines_from_pods(pods, self.port)

    async def sync(self) -> None:
        """One round: add the pods that became ready, remove the ones that went away."""
        wanted = self.engines(await asyncio.to_thread(self._list_pods))
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
