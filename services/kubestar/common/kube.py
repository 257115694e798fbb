"""kubestar's Kubernetes API client: small, typed, async, on aiohttp.

The one client beside kopf's watches: the operator reconciles with it (get, list, create,
merge-patch, delete, leases), the rollout scheduler discovers engines with it, and the trainer
patches its TrainingRun's status with it (`call_blocking`, for synchronous callers).
Credentials come from a kubeconfig or the pod's service account (`connect`); kopf logs in with
the same ones (kubestar.operator.main).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import json
import os
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import yaml

T = TypeVar("T")
Obj = dict[str, Any]
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# Plurals of the kinds the operator touches (no discovery round trips).
PLURALS: dict[str, str] = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "ServiceAccount": "serviceaccounts",
    "Event": "events",
    "Secret": "secrets",
    "Namespace": "namespaces",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "Job": "jobs",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Lease": "leases",
    "SandboxPool": "sandboxpools",
    "RolloutFleet": "rolloutfleets",
    "TrainingRun": "trainingruns",
    "CustomResourceDefinition": "customresourcedefinitions",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


class ApiError(Exception):
    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        message = body.get("message", "") if isinstance(body, dict) else str(body)
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        self.message = message
        super().__init__(f"{method} {path}: {status} {self.reason}: {message}")


# What a request may raise: the API server's answer, or no answer (refused, TLS, timeout).
REQUEST_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError, OSError)


@dataclass
class Connection:
    server: str
    token: str = ""
    token_file: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure: bool = False
    namespace: str = "default"

    def bearer(self) -> str:
        # Projected service-account tokens rotate: read the file at every request.
        if self.token_file:
            return Path(self.token_file).read_text().strip()
        return self.token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        return context


def _data_file(data: str, suffix: str) -> str:
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept for the process's lifetime
        prefix="kubestar-", suffix=suffix, delete=False
    )
    handle.write(base64.b64decode(data))
    handle.close()
    atexit.register(_remove, handle.name)
    return handle.name


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def from_kubeconfig(path: str | Path | None = None, context: str | None = None) -> Connection:
    path = Path(
        path
        or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        or Path.home() / ".kube" / "config"
    )
    config = yaml.safe_load(path.read_text())
    name = context or config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    ctx = contexts[name] if name else next(iter(contexts.values()))
    cluster = {c["name"]: c["cluster"] for c in config["clusters"]}[ctx["cluster"]]
    user = {u["name"]: u.get("user") or {} for u in config.get("users") or []}.get(
        ctx.get("user", ""), {}
    )

    def relative(value: str) -> str:
        return str((path.parent / value).resolve()) if value else ""

    ca = relative(cluster.get("certificate-authority", ""))
    if cluster.get("certificate-authority-data"):
        ca = _data_file(cluster["certificate-authority-data"], ".crt")
    cert = relative(user.get("client-certificate", ""))
    if user.get("client-certificate-data"):
        cert = _data_file(user["client-certificate-data"], ".crt")
    key = relative(user.get("client-key", ""))
    if user.get("client-key-data"):
        key = _data_file(user["client-key-data"], ".key")
    return Connection(
        server=cluster["server"],
        token=user.get("token", ""),
        token_file=relative(user.get("tokenFile", "")),
        ca_file=ca,
        cert_file=cert,
        key_file=key,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        namespace=ctx.get("namespace", "default"),
    )


def in_cluster() -> Connection:
    """The pod's service account, and the API server at KUBERNETES_SERVICE_HOST/PORT (which
    the operator overrides in its children where the kubernetes Service is unreachable)."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    namespace_file = SA_DIR / "namespace"
    return Connection(
        server=f"https://{host}:{port}",
        token_file=str(SA_DIR / "token"),
        ca_file=str(SA_DIR / "ca.crt"),
        namespace=namespace_file.read_text().strip() if namespace_file.exists() else "default",
    )


def connect(kubeconfig: str | None = None) -> Connection:
    """A kubeconfig when given (or $KUBECONFIG), else the pod's service account."""
    if kubeconfig or os.environ.get("KUBECONFIG"):
        return from_kubeconfig(kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").exists():
        return in_cluster()
    return from_kubeconfig()


def api_base(api_version: str) -> str:
    return f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"


def path(
    api_version: str,
    kind: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    parts = [api_base(api_version)]
    if namespace and kind not in CLUSTER_SCOPED:
        parts.append(f"namespaces/{quote(namespace)}")
    parts.append(PLURALS[kind])
    if name:
        parts.append(quote(name))
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def path_of(obj: Mapping[str, Any], subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's Ready condition is True (the pod as the API serialises it)."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


class Kube:
    """One aiohttp session against one API server."""

    def __init__(self, connection: Connection, timeout: float = 30.0) -> None:
        self.connection = connection
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                base_url=self.connection.server,
                connector=aiohttp.TCPConnector(ssl=self.connection.ssl_context(), limit=32),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        session = await self.session()
        headers = {"Accept": "application/json"}
        token = self.connection.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        self.requests += 1
        async with session.request(
            method, url, data=data, headers=headers, params=params
        ) as response:
            text = await response.text()
            try:
                payload: Any = json.loads(text) if text else {}
            except json.JSONDecodeError:
                payload = text
            if response.status >= 400:
                raise ApiError(response.status, payload, method, url)
            return payload if isinstance(payload, dict) else {"raw": payload}

    async def get(self, url: str) -> Obj | None:
        try:
            return await self.request("GET", url)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, url: str, label_selector: str = "", field_selector: str = "") -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        result = await self.request("GET", url, params=params or None)
        items: list[Obj] = result.get("items") or []
        return items

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", url, obj)

    async def merge_patch(self, url: str, body: Mapping[str, Any]) -> Obj:
        return await self.request("PATCH", url, body, content_type="application/merge-patch+json")

    async def delete(self, url: str, propagation: str = "Background") -> Obj | None:
        try:
            return await self.request(
                "DELETE",
                url,
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation},
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await self.request("GET", "/version")
                return
            except REQUEST_ERRORS:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)


def call_blocking(
    connection: Connection, call: Callable[[Kube], Awaitable[T]], timeout: float = 30.0
) -> T:
    """`call` on a fresh client, for synchronous callers (the trainer's status reports).

    It runs on an event loop of its own in a worker thread, so it works the same whether or
    not the caller's thread runs an event loop; the client is closed before returning.
    """

    async def once() -> T:
        async with Kube(connection, timeout) as kube:
            return await call(kube)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kube-call") as worker:
        return worker.submit(asyncio.run, once()).result()
