"""kubestar's API client: credentials (kubeconfig, the pod's service account), paths, and the
requests it sends, against a stand-in API server on 127.0.0.1."""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from pathlib import Path

import pytest
import yaml
from kubestar.common import kube

from tests.common.fake_api_server import Certificate, FakeApiServer, in_cluster


def test_kubeconfig_with_inline_data_and_token(tmp_path: Path) -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    path = tmp_path / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://127.0.0.1:6443",
                            "certificate-authority-data": ca,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "secret"}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}
                ],
                "current-context": "x",
            }
        )
    )
    connection = kube.from_kubeconfig(path)
    assert connection.server == "https://127.0.0.1:6443"
    assert connection.bearer() == "secret" and connection.namespace == "ns"
    assert Path(connection.ca_file).read_bytes().startswith(b"-----BEGIN")


def test_api_paths() -> None:
    assert kube.path("apps/v1", "Deployment", "ns", "d") == (
        "/apis/apps/v1/namespaces/ns/deployments/d"
    )
    assert kube.path("v1", "Pod", "ns") == "/api/v1/namespaces/ns/pods"
    assert kube.path("kubestar.dev/v1alpha1", "TrainingRun", "ns", "r", "status") == (
        "/apis/kubestar.dev/v1alpha1/namespaces/ns/trainingruns/r/status"
    )


def test_in_cluster_uses_the_service_account_and_the_service_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("first\n")
    (tmp_path / "namespace").write_text("team")
    monkeypatch.setattr(kube, "SA_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    connection = kube.in_cluster()
    assert connection.server == "https://[fd00::1]:443"
    assert connection.ca_file == str(tmp_path / "ca.crt")
    assert connection.namespace == "team" and connection.bearer() == "first"
    (tmp_path / "token").write_text("rotated\n")
    assert connection.bearer() == "rotated"  # projected tokens rotate: read at every request

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert kube.connect().server == "https://10.0.0.1:6443"
    config = tmp_path / "config"
    config.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    assert kube.connect().server == "https://127.0.0.1:1"  # a kubeconfig named wins


async def test_requests_carry_method_path_body_and_token() -> None:
    with FakeApiServer() as server:
        pods = kube.path("v1", "Pod", "team")
        server.answer("GET", pods, {"kind": "PodList", "items": [{"metadata": {"name": "p"}}]})
        server.answer("POST", pods, {"metadata": {"name": "p"}}, status=201)
        server.answer("PATCH", f"{pods}/p", {"metadata": {"name": "p"}})
        server.answer("DELETE", f"{pods}/q", {"reason": "Forbidden", "message": "no"}, status=403)
        async with kube.Kube(kube.Connection(server=server.url, token="secret")) as client:
            assert await client.list(pods, "app=engine") == [{"metadata": {"name": "p"}}]
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p", "namespace": "team"},
            }
            await client.create(pod)
            await client.merge_patch(f"{pods}/p", {"metadata": {"labels": {"a": "b"}}})
            assert await client.get(f"{pods}/missing") is None
            with pytest.raises(kube.ApiError) as denied:
                await client.delete(f"{pods}/q")
        assert denied.value.status == 403 and denied.value.reason == "Forbidden"
        sent = [(r.method, r.path, r.query, r.body) for r in server.requests]
        assert sent == [
            ("GET", pods, {"labelSelector": "app=engine"}, None),
            ("POST", pods, {}, pod),
            ("PATCH", f"{pods}/p", {}, {"metadata": {"labels": {"a": "b"}}}),
            ("GET", f"{pods}/missing", {}, None),
            (
                "DELETE",
                f"{pods}/q",
                {},
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            ),
        ]
        assert {r.headers["Authorization"] for r in server.requests} == {"Bearer secret"}
        assert server.requests[2].headers["Content-Type"] == "application/merge-patch+json"


async def test_blocking_calls_work_inside_and_outside_an_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's way: a synchronous call, in cluster (TLS with the service account's CA,
    its token), whether or not the calling thread runs a loop (this test's does)."""
    with FakeApiServer(Certificate.create(tmp_path)) as server:
        token = in_cluster(monkeypatch, tmp_path, server)
        server.answer("GET", "/version", {"gitVersion": "v1.20.2"})
        connection = kube.in_cluster()

        def version(client: kube.Kube) -> Awaitable[kube.Obj]:
            return client.request("GET", "/version")

        assert kube.call_blocking(connection, version) == {"gitVersion": "v1.20.2"}
        token.write_text("rotated\n")
        assert kube.call_blocking(connection, version)["gitVersion"] == "v1.20.2"
        tokens = [r.headers["Authorization"] for r in server.requests]
        assert tokens == ["Bearer service-account-token", "Bearer rotated"]
