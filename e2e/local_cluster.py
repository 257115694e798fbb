"""A real local control plane (e2e/local) driven from Python, and small clients for it: what
the operator tests (tests/operator) and the operator benchmark (bench/operator_bench.py) run
against.

`LocalCluster.start()` builds the binaries if needed (e2e/local/install.sh: minutes, once per
machine; cached under ~/.cache/kubestar) and starts etcd, kube-apiserver and
kube-controller-manager on free 127.0.0.1 ports; `stop()` stops them by PID. There is no
kubelet: pods are created but never run, so `FakeKubelet` writes pod statuses (ready, image
pull back-off, OOM killed, ...) the way a kubelet would report them.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubestar.common.net import free_port

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kubestar"
E2E = ROOT / "e2e" / "local"
INSTALL_TIMEOUT = float(os.environ.get("KUBESTAR_K8S_INSTALL_TIMEOUT", "2400"))


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1
) -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError) as error:
            last = error
        if last and not isinstance(last, Exception):
            return last  # type: ignore[no-any-return]
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{status}: {body.get('message', body)}")


class Api:
    """A synchronous API client for tests (urllib; a bearer token)."""

    def __init__(self, server: str, token: str, ca_file: str) -> None:
        self.server = server
        self.token = token
        self.context = ssl.create_default_context(cafile=ca_file)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": content_type,
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=30) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"message": raw.decode(errors="replace")}
            raise ApiError(error.code, payload) from None
        result: dict[str, Any] = json.loads(text) if text else {}
        return result

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        result = self.request("GET", path + query)
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str) -> None:
        try:
            self.request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as error:
            if error.status != 404:
                raise


def kubestar(namespace: str, plural: str, name: str = "", sub: str = "") -> str:
    path = f"/apis/kubestar.dev/v1alpha1/namespaces/{namespace}/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def core(namespace: str, plural: str, name: str = "", sub: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def apis(group_version: str, namespace: str, plural: str, name: str = "") -> str:
    path = f"/apis/{group_version}/namespaces/{namespace}/{plural}"
    return path + (f"/{name}" if name else "")


@dataclass
class LocalCluster:
    directory: Path
    bin: Path = field(init=False)
    port: int = field(default_factory=free_port)
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    startup_seconds: float = 0.0

    def __post_init__(self) -> None:
        version = os.environ.get("K8S_VERSION", "1.20.2")
        cache = os.environ.get(
            "KUBESTAR_K8S_CACHE", str(Path.home() / ".cache" / "kubestar" / f"k8s-{version}")
        )
        self.bin = Path(os.environ.get("KUBESTAR_K8S_BIN", f"{cache}/bin"))

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "APISERVER_PORT": str(self.port),
            "ETCD_PORT": str(self.etcd_port),
            "ETCD_PEER_PORT": str(self.etcd_peer_port),
        }

    @property
    def kubeconfig(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str:
        return str(self.directory / "pki" / "ca.crt")

    def api(self, token: str | None = None) -> Api:
        admin = (self.directory / "pki" / "admin.token").read_text().strip()
        return Api(self.server, token or admin, self.ca_file)

    @staticmethod
    def ensure_binaries() -> str | None:
        """None when the binaries are there (building them if needed), else why not."""
        if subprocess.run([E2E / "install.sh", "--check"], check=False).returncode == 0:
            return None
        log = Path(tempfile.gettempdir()) / "kubestar-k8s-install.log"
        with log.open("w") as out:
            try:
                done = subprocess.run(
                    [E2E / "install.sh"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=INSTALL_TIMEOUT,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"building Kubernetes 1.20 took over {INSTALL_TIMEOUT:g}s (see {log})"
        if done.returncode != 0:
            tail = " | ".join(log.read_text().splitlines()[-5:])
            return f"e2e/local/install.sh failed ({tail}); see {log}"
        return None

    def start(self) -> None:
        started = time.monotonic()
        subprocess.run(
            [E2E / "cluster.sh", "start", str(self.directory)],
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        subprocess.run(
            [E2E / "cluster.sh", "stop", str(self.directory)],
            env=self.env,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self.directory / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.directory / "helm" / "config"),
            "HELM_DATA_HOME": str(self.directory / "helm" / "data"),
        }
        return subprocess.run(
            [str(self.bin / "helm"), *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
            env=env,
        )

    def apply_crds(self) -> None:
        self.kubectl("apply", "-f", str(CHART / "crds"))
        for plural in ("sandboxpools", "rolloutfleets", "trainingruns"):
            self.kubectl(
                "wait", "--for=condition=Established", "--timeout=30s", f"crd/{plural}.kubestar.dev"
            )

    def namespace(self, name: str) -> str:
        self.api().create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
        wait_for(
            f"service account default in {name}",
            lambda: self.api().get(core(name, "serviceaccounts", "default")),
        )
        return name

    def service_account_token(self, namespace: str, name: str) -> str:
        """The token of a service account (1.20 makes a Secret for each)."""

        def token() -> str | None:
            sa = self.api().get(core(namespace, "serviceaccounts", name))
            for ref in (sa or {}).get("secrets") or []:
                secret = self.api().get(core(namespace, "secrets", ref["name"]))
                data = (secret or {}).get("data") or {}
                if data.get("token"):
                    import base64

                    return base64.b64decode(data["token"]).decode()
            return None

        return wait_for(f"a token for {namespace}/{name}", token, timeout=30)

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["users"][0]["user"] = {"token": token}
        config["contexts"][0]["context"]["namespace"] = namespace
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path


class OperatorProcess:
    """`kubestar operator run` as a subprocess (stopped by its PID)."""

    def __init__(
        self,
        kubeconfig: Path,
        settings: Mapping[str, Any],
        log: Path,
        leader_election: bool = True,
        lease_namespace: str = "kubestar-system",
        lease_name: str = "kubestar-operator",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.settings_file = log.with_suffix(".settings.yaml")
        self.settings_file.write_text(yaml.safe_dump(dict(settings)))
        self.log = log
        self.leader_election = leader_election
        self.lease_namespace = lease_namespace
        self.lease_name = lease_name
        self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        self.metrics_port = free_port()
        command = [
            sys.executable,
            "-m",
            "kubestar.cli.main",
            "operator",
            "run",
            "--kubeconfig",
            str(self.kubeconfig),
            "--config",
            str(self.settings_file),
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-address",
            "127.0.0.1",
            "--health-port",
            "0",
            "--no-probe",
            "--log-level",
            "info",
            "--lease-namespace",
            self.lease_namespace,
            "--lease-name",
            self.lease_name,
        ]
        if not self.leader_election:
            command.append("--no-leader-election")
        handle = self.log.open("ab")
        self.process = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT
        )
        handle.close()
        wait_for("the operator's metrics endpoint", self.metrics, timeout=30)
        return self

    def metrics(self) -> dict[str, float]:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"operator exited ({self.process.returncode}); see {self.log}")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kubestar_operator") and " " in line:
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        code = self.process.returncode
        self.process = None
        return code

    def restart(self) -> OperatorProcess:
        self.stop()
        return self.start()

    def wait_idle(self, settle: float = 1.0, timeout: float = 30.0) -> None:
        """Until no reconcile has started for `settle` seconds and none is running."""
        deadline = time.monotonic() + timeout
        last = -1.0
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            count = self.metric("kubestar_operator_reconcile_seconds_count")
            busy = self.metric("kubestar_operator_reconciles_in_flight")
            if count != last or busy:
                last = count
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle:
                return
            time.sleep(0.1)
        raise AssertionError(f"operator still busy after {timeout:g}s")


class FakeKubelet:
    """Writes pod statuses as a kubelet would (there is no node in this cluster)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.api.items(core(namespace, "pods"), selector)

    def set_status(self, pod: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        self.api.merge_patch(
            core(meta["namespace"], "pods", meta["name"], "status"), {"status": status}
        )

    @staticmethod
    def running(pod: Mapping[str, Any], ready: bool = True) -> dict[str, Any]:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        names = [c["name"] for c in pod["spec"]["containers"]]
        flag = "True" if ready else "False"
        return {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                {"type": "Ready", "status": flag, "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": n,
                    "ready": ready,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
                for n in names
            ],
        }

    @staticmethod
    def waiting(
        pod: Mapping[str, Any],
        reason: str,
        message: str,
        last_terminated: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        name = pod["spec"]["containers"][0]["name"]
        item: dict[str, Any] = {
            "name": name,
            "ready": False,
            "restartCount": 4,
            "image": "x",
            "imageID": "",
            "state": {"waiting": {"reason": reason, "message": message}},
        }
        if last_terminated:
            item["lastState"] = {"terminated": dict(last_terminated)}
        return {"phase": "Pending", "containerStatuses": [item]}

    @staticmethod
    def unschedulable(message: str) -> dict[str, Any]:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": now,
                }
            ],
        }

    @staticmethod
    def terminated(
        pod: Mapping[str, Any], exit_code: int, reason: str, message: str = ""
    ) -> dict[str, Any]:
        """A status whose first container exited (with its termination message)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        name = pod["spec"]["containers"][0]["name"]
        return {
            "phase": "Failed" if exit_code else "Succeeded",
            "containerStatuses": [
                {
                    "name": name,
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": reason,
                            **({"message": message} if message else {}),
                            "startedAt": now,
                            "finishedAt": now,
                        }
                    },
                }
            ],
        }

    def make_ready(
        self, namespace: str, selector: str, expect: int = 1, timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        """Wait for `expect` pods matching `selector`, then mark them running and ready."""
        pods = wait_for(
            f"{expect} pod(s) {selector} in {namespace}",
            lambda: (lambda p: p if len(p) >= expect else None)(self.pods(namespace, selector)),
            timeout=timeout,
        )
        for pod in pods:
            self.set_status(pod, self.running(pod))
        return pods


@contextmanager
def temporary_directory(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as name:
        yield Path(name)
