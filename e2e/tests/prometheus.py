"""A real Prometheus for the suite (Debian's): it scrapes kubestar's pods, found through the
cluster's API by their prometheus.io annotations, every 5 s from the suite's start to its
end; the tests query it over HTTP."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubestar.common import kube

SCRAPE_SECONDS = 5
# The annotations a Prometheus without the Prometheus operator finds pods by.
SCRAPE, PORT, PATH = (f"prometheus.io/{key}" for key in ("scrape", "port", "path"))
COMPONENT = "app.kubernetes.io/component"


def scrape_config(targets: Path) -> dict[str, Any]:
    """Scrape what `targets` (file discovery, kept by PodDiscovery) lists, every SCRAPE_SECONDS."""
    return {
        "global": {
            "scrape_interval": f"{SCRAPE_SECONDS}s",
            "scrape_timeout": f"{SCRAPE_SECONDS}s",
        },
        "scrape_configs": [
            {
                "job_name": "kubestar-pods",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "5s"}],
            }
        ],
    }


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """File-discovery groups for the running pods annotated prometheus.io/scrape: their pod
    address and annotated port and path, labelled with namespace, pod and component (what
    the annotation-based Kubernetes discovery of Prometheus's own example configuration
    makes of them)."""
    groups = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        annotations = meta.get("annotations") or {}
        if annotations.get(SCRAPE) != "true" or status.get("phase") != "Running":
            continue
        if not status.get("podIP") or not annotations.get(PORT):
            continue
        labels = {
            "__metrics_path__": annotations.get(PATH, "/metrics"),
            "namespace": meta["namespace"],
            "pod": meta["name"],
            "component": (meta.get("labels") or {}).get(COMPONENT, ""),
        }
        groups.append({"targets": [f"{status['podIP']}:{annotations[PORT]}"], "labels": labels})
    return groups


class PodDiscovery(threading.Thread):
    """Keeps Prometheus's target file in step with the annotated pods of `namespaces`,
    read through the cluster's API every SCRAPE_SECONDS. (Debian's Prometheus is built
    without its Kubernetes discovery; this does what that would, by the same annotations.)"""

    def __init__(self, kubeconfig: str, namespaces: list[str], targets: Path) -> None:
        super().__init__(name="pod-discovery", daemon=True)
        self.connection = kube.from_kubeconfig(kubeconfig)
        self.namespaces = namespaces
        self.targets = targets
        self.halt = threading.Event()

    def discover(self) -> None:
        async def pods(client: kube.Kube) -> list[dict[str, Any]]:
            found = []
            for namespace in self.namespaces:
                found += await client.list(kube.path("v1", "Pod", namespace))
            return found

        groups = pod_targets(kube.call_blocking(self.connection, pods))
        scratch = self.targets.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups, indent=1))
        scratch.replace(self.targets)

    def run(self) -> None:
        while not self.halt.wait(SCRAPE_SECONDS):
            try:
                self.discover()
            except kube.REQUEST_ERRORS:
                continue  # the API server restarting, say: the next round finds them


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Prometheus:
    """One Prometheus process, on 127.0.0.1, its data and log under `folder`."""

    folder: Path
    process: subprocess.Popen[bytes] | None = None
    discovery: PodDiscovery | None = None
    url: str = ""
    started: float = 0.0

    def start(self, kubeconfig: str, namespaces: list[str]) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise AssertionError("no prometheus on PATH: e2e/local/install.sh installs Debian's")
        self.folder.mkdir(parents=True, exist_ok=True)
        targets = self.folder / "targets.json"
        self.discovery = PodDiscovery(kubeconfig, namespaces, targets)
        self.discovery.discover()
        self.discovery.start()
        config = self.folder / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(targets)))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (self.folder / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.started = time.time()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited; see {self.folder / 'prometheus.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"prometheus not ready in 60 s; see {self.folder / 'prometheus.log'}")

    def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.halt.set()
            self.discovery.join(timeout=30)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _get(self, path: str, **params: str | float) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as answer:
            body = json.load(answer)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query_range(
        self, expression: str, start: float, end: float | None = None
    ) -> list[dict[str, Any]]:
        """Each series of `expression` between `start` and `end` (now): its labels under
        `metric`, its [time, "value"] pairs under `values`."""
        end = end or time.time()
        step = max(SCRAPE_SECONDS, (end - start) / 10_000)
        data = self._get("/api/v1/query_range", query=expression, start=start, end=end, step=step)
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])


def values(series: dict[str, Any]) -> list[float]:
    return [float(value) for _, value in series["values"]]
