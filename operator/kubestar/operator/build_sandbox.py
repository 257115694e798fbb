"""Children of a SandboxPool (pure): a StatefulSet of sandbox workers behind a headless
Service (stable names the dispatcher dials), a dispatcher Deployment and its Service.

Sandbox pods mount no service-account token, have a read-only root filesystem (writable
/tmp only), no privilege escalation, the runtime's default seccomp profile, and take the
pool's runtimeClassName (gVisor, Kata) when set. The dispatcher runs as non-root with no
capabilities. A worker of a pool with isolation: Required gets the namespaces it runs calls in
as the operator's settings say (sandbox.isolationMechanism): by default it runs as root with
exactly the capabilities its executors use, and each call runs as a uid of its own with none;
with UserNamespace it runs as non-root with no capabilities. Workers listen on
`spec.port + 1`, the dispatcher on `spec.port`. With the installation's token
(settings.auth) both mount the pool's copy of it (a Secret): the dispatcher requires it of
its callers and sends it to the workers, which require it too. Both get spec.limits as the
defaults of calls that set no limit of their own (`--call-timeout`, `--call-memory-mib`,
`--call-max-output-bytes`).

A worker that cannot isolate its calls (spec.isolation: Required) exits with one line in its
termination message, which the kubelet puts in the pod's status and the SandboxPool's Ready
condition passes on (see conditions.diagnose_pod).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubestar.api.v1alpha1 import SandboxPoolSpec
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings
from kubestar.sandbox.isolation import ROOT_CAPABILITIES

WORKER = "sandbox-worker"
DISPATCHER = "sandbox-dispatcher"
# Where a sandbox server writes why it could not start; Kubernetes' default path, named in
# the container so that the server's --termination-log and the kubelet agree.
TERMINATION_LOG = "/dev/termination-log"
# The pod's writable /tmp (the node's disk): past it the kubelet evicts the pod. Isolated
# calls write to tmpfs of their own instead (memory, see kubestar.sandbox.isolation).
TMP_SIZE = "1Gi"
# The most of the node's disk a sandbox container may fill (its /tmp, its logs) when the
# pool's resources do not say.
EPHEMERAL_STORAGE_LIMIT = "2Gi"


def worker_name(pool: str) -> str:
    return o.child_name(pool, "sandbox-worker")


def dispatcher_name(pool: str) -> str:
    return o.child_name(pool, "sandbox")


def auth_name(pool: str) -> str:
    """The pool's copy of the installation's token (its workers and dispatcher mount it)."""
    return o.child_name(pool, "sandbox-auth")


def worker_port(spec: SandboxPoolSpec) -> int:
    return spec.port + 1


def worker_addresses(
    pool: str, namespace: str, spec: SandboxPoolSpec, settings: OperatorSettings
) -> list[str]:
    """HOST:PORT of every worker, in ordinal order (what the dispatcher's --worker gets)."""
    port = worker_port(spec)
    if settings.network.host_network:
        return [f"127.0.0.1:{port}"] * min(spec.replicas, 1)
    name = worker_name(pool)
    domain = settings.network.cluster_domain
    return [f"{name}-{i}.{name}.{namespace}.svc.{domain}:{port}" for i in range(spec.replicas)]


def endpoint(pool: str, namespace: str, spec: SandboxPoolSpec, settings: OperatorSettings) -> str:
    if settings.network.host_network:
        return f"127.0.0.1:{spec.port}"
    domain = settings.network.cluster_domain
    return f"{dispatcher_name(pool)}.{namespace}.svc.{domain}:{spec.port}"


def http_endpoint(
    pool: str, namespace: str, spec: SandboxPoolSpec, settings: OperatorSettings
) -> str:
    """The base URL of the dispatcher's HTTP dialects ("" when spec.httpPort is 0)."""
    if not spec.http_port:
        return ""
    if settings.network.host_network:
        return f"http://127.0.0.1:{spec.http_port}"
    domain = settings.network.cluster_domain
    return f"http://{dispatcher_name(pool)}.{namespace}.svc.{domain}:{spec.http_port}"


def _pod_security(settings: OperatorSettings) -> o.Obj:
    uid = settings.sandbox.run_as_user
    security: o.Obj = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    if settings.sandbox.seccomp_runtime_default:
        security["seccompProfile"] = {"type": "RuntimeDefault"}
    return security


def call_limit_args(spec: SandboxPoolSpec) -> list[str]:
    """spec.limits as the defaults of every call that leaves a limit unset (the HTTP
    dialects, `kubestar sandbox exec`, a gRPC call with limits at 0): a worker and the
    dispatcher both get them, so a change of spec.limits rolls their pods."""
    limits = spec.limits
    return [
        "--call-timeout",
        f"{limits.timeout_seconds:g}",
        "--call-memory-mib",
        str(limits.memory_mib),
        "--call-max-output-bytes",
        str(limits.output_bytes),
    ]


def worker_runs_as_root(spec: SandboxPoolSpec, settings: OperatorSettings) -> bool:
    return spec.isolation == "Required" and settings.sandbox.isolation_mechanism == "Capabilities"


def _worker_security(spec: SandboxPoolSpec, settings: OperatorSettings) -> o.Obj:
    """The worker container's security context: the dispatcher's, or root with exactly the
    capabilities the executors use (the calls themselves hold none)."""
    security = o.restricted_container_security()
    if worker_runs_as_root(spec, settings):
        security.update(runAsUser=0, runAsGroup=0, runAsNonRoot=False)
        added = [name.removeprefix("CAP_") for name in ROOT_CAPABILITIES.values()]
        security["capabilities"] = {"drop": ["ALL"], "add": added}
    return security


def _pod_spec(spec: SandboxPoolSpec, settings: OperatorSettings, container: o.Obj) -> o.Obj:
    pod: o.Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(settings),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}],
        "terminationGracePeriodSeconds": 45,
    }
    runtime_class = spec.runtime_class_name or settings.sandbox.runtime_class_name
    if runtime_class:
        pod["runtimeClassName"] = runtime_class
    if settings.network.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod


def _container(
    name: str,
    spec: SandboxPoolSpec,
    settings: OperatorSettings,
    args: list[str],
    port: int,
    metrics_port: int,
) -> o.Obj:
    container: o.Obj = {
        "name": name,
        "image": spec.image or settings.images.kubestar,
        "imagePullPolicy": settings.images.pull_policy,
        "command": ["kubestar", "sandbox", "serve", *args, "--termination-log", TERMINATION_LOG],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "ports": [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "env": o.env_list({"PYTHONUNBUFFERED": "1", "HOME": "/tmp"}),
        "securityContext": o.restricted_container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": port},
            "periodSeconds": 20,
            "failureThreshold": 6,
        },
    }
    if settings.network.host_network:
        for item in container["ports"]:
            item["hostPort"] = item["containerPort"]
    return container


def worker_statefulset(
    pool: Mapping[str, Any], spec: SandboxPoolSpec, settings: OperatorSettings
) -> o.Obj:
    name = pool["metadata"]["name"]
    port = worker_port(spec)
    metrics = settings.metrics_port(settings.ports.sandbox_worker_metrics, port)
    bind = settings.network.bind_address
    args = [
        "--listen",
        o.listen_address(bind, port),
        "--executors",
        str(spec.executors_per_pod),
        "--preload",
        ",".join(spec.preload),
        "--queue-timeout",
        f"{spec.queue_timeout_seconds:g}",
        "--metrics-port",
        str(metrics),
        "--metrics-address",
        bind,
        *call_limit_args(spec),
    ]
    if spec.isolation == "Disabled":
        args.append("--no-isolation")
    else:
        # Each pod's calls run as uids of its own: the kernel's per-uid limits are node-wide.
        args += ["--uid-range-key", "$(POD_UID)"]
    container = _container("worker", spec, settings, args, port, metrics)
    if spec.isolation != "Disabled":
        container["env"].append(
            {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
        )
    container["securityContext"] = _worker_security(spec, settings)
    limits = {"ephemeral-storage": EPHEMERAL_STORAGE_LIMIT, **spec.resources.limits}
    container["resources"] = o.resources(spec.resources.requests, limits)
    selector = o.selector_labels("SandboxPool", name, WORKER)
    workers = o.with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": o.metadata(pool, worker_name(name), WORKER),
            "spec": {
                "serviceName": worker_name(name),
                "replicas": spec.replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": o.labels("SandboxPool", name, WORKER),
                        "annotations": o.scrape_annotations(container),
                    },
                    "spec": _pod_spec(spec, settings, container),
                },
            },
        }
    )
    overrides = spec.pod_overrides.worker if spec.pod_overrides else None
    workers = o.with_pod_overrides(workers, overrides, settings.images.pull_secret_names)
    return o.with_auth(workers, auth_name(name), settings.auth.token)


def worker_service(pool: Mapping[str, Any], spec: SandboxPoolSpec) -> o.Obj:
    name = pool["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": o.metadata(pool, worker_name(name), WORKER),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": o.selector_labels("SandboxPool", name, WORKER),
                "ports": [
                    {
                        "name": "grpc",
                        "port": worker_port(spec),
                        "targetPort": "grpc",
                        "protocol": "TCP",
                    }
                ],
            },
        }
    )


def dispatcher_deployment(
    pool: Mapping[str, Any], spec: SandboxPoolSpec, settings: OperatorSettings
) -> o.Obj:
    meta = pool["metadata"]
    name = meta["name"]
    metrics = settings.metrics_port(settings.ports.sandbox_dispatcher_metrics, spec.port)
    bind = settings.network.bind_address
    args = ["--listen", o.listen_address(bind, spec.port)]
    for address in worker_addresses(name, meta.get("namespace", "default"), spec, settings):
        args += ["--worker", address]
    args += [
        "--queue-timeout",
        f"{spec.queue_timeout_seconds:g}",
        "--metrics-port",
        str(metrics),
        "--metrics-address",
        bind,
        *call_limit_args(spec),
    ]
    if spec.http_port:
        # SandboxFusion's and code-judge's HTTP dialects, next to gRPC.
        args += ["--http-listen", o.listen_address(bind, spec.http_port)]
    container = _container("dispatcher", spec, settings, args, spec.port, metrics)
    if spec.http_port:
        port = {"name": "http", "containerPort": spec.http_port, "protocol": "TCP"}
        if settings.network.host_network:
            port["hostPort"] = spec.http_port
        container["ports"].append(port)
    container["resources"] = {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"ephemeral-storage": EPHEMERAL_STORAGE_LIMIT},
    }
    selector = o.selector_labels("SandboxPool", name, DISPATCHER)
    dispatcher = o.with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": o.metadata(pool, dispatcher_name(name), DISPATCHER),
            "spec": {
                "replicas": 1,
                "strategy": o.single_pod_rollout(settings.network.host_network),
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": o.labels("SandboxPool", name, DISPATCHER),
                        "annotations": o.scrape_annotations(container),
                    },
                    "spec": _pod_spec(spec, settings, container),
                },
            },
        }
    )
    overrides = spec.pod_overrides.dispatcher if spec.pod_overrides else None
    dispatcher = o.with_pod_overrides(dispatcher, overrides, settings.images.pull_secret_names)
    return o.with_auth(dispatcher, auth_name(name), settings.auth.token)


def dispatcher_service(pool: Mapping[str, Any], spec: SandboxPoolSpec) -> o.Obj:
    name = pool["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": o.metadata(pool, dispatcher_name(name), DISPATCHER),
            "spec": {
                "selector": o.selector_labels("SandboxPool", name, DISPATCHER),
                "ports": [
                    {"name": "grpc", "port": spec.port, "targetPort": "grpc", "protocol": "TCP"},
                    *(
                        [
                            {
                                "name": "http",
                                "port": spec.http_port,
                                "targetPort": "http",
                                "protocol": "TCP",
                            }
                        ]
                        if spec.http_port
                        else []
                    ),
                ],
            },
        }
    )


def network_policies(
    pool: Mapping[str, Any], spec: SandboxPoolSpec, settings: OperatorSettings
) -> list[o.Obj]:
    """Workers: reached only by their dispatcher (and by scrapers on the metrics port),
    reaching nothing: a call that escaped its executor meets a closed network. The
    dispatcher: reached by the namespace's trainers (rank 0's pod: the agent loop's tool
    calls), by scrapers on the metrics port, and with spec.httpPort by anyone on the HTTP
    dialects' port (its callers are wherever the user runs verl: it requires the token);
    reaching its workers, and name lookups (it dials them by name)."""
    name = pool["metadata"]["name"]
    workers = o.selector_labels("SandboxPool", name, WORKER)
    dispatcher = o.selector_labels("SandboxPool", name, DISPATCHER)
    scrapers = o.metrics_peers(settings.network_policies.metrics_from)
    metrics = {"from": scrapers, "ports": o.tcp_ports("metrics")}
    return [
        o.network_policy(
            pool,
            worker_name(name),
            WORKER,
            workers,
            ingress=[{"from": [o.pods_of(dispatcher)], "ports": o.tcp_ports("grpc")}, metrics],
            egress=[],
        ),
        o.network_policy(
            pool,
            dispatcher_name(name),
            DISPATCHER,
            dispatcher,
            ingress=[
                {"from": [o.trainer_rank0_pods()], "ports": o.tcp_ports("grpc")},
                metrics,
                *([{"ports": o.tcp_ports("http")}] if spec.http_port else []),
            ],
            egress=[
                {"to": [o.pods_of(workers)], "ports": o.tcp_ports(worker_port(spec))},
                o.DNS_EGRESS,
            ],
        ),
    ]


def children(
    pool: Mapping[str, Any], spec: SandboxPoolSpec, settings: OperatorSettings
) -> list[o.Obj]:
    """Everything a SandboxPool owns, in creation order."""
    policies = (
        network_policies(pool, spec, settings)
        if settings.network_policies.enabled and not settings.network.host_network
        else []
    )
    token = settings.auth.token
    name = auth_name(pool["metadata"]["name"])
    auth = [o.auth_secret(pool, name, "sandbox", token)] if token else []
    return [
        *policies,
        *auth,
        worker_service(pool, spec),
        worker_statefulset(pool, spec, settings),
        dispatcher_service(pool, spec),
        dispatcher_deployment(pool, spec, settings),
    ]
