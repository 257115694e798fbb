"""Names, labels, owner references and hashes shared by the builders (all pure)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kubestar.api.v1alpha1 import API_VERSION, MODEL_MOUNT, ModelSource, PodOverrides
from kubestar.common import accelerators
from kubestar.common.auth import ENV_TOKEN_FILE, namespace_token

Obj = dict[str, Any]

MANAGED_BY = "kubestar-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_OWNER_KIND = "kubestar.dev/owner-kind"
ANNOTATION_HASH = "kubestar.dev/spec-hash"
# A trainer pod's worker index; worker 0 holds rank 0 (rollouts, the weight server).
LABEL_WORKER = "kubestar.dev/trainer-worker"

# Base names are short enough that every child name, a StatefulSet's pod names and the
# controller-revision-hash label built from them stay within 63 characters.
MAX_BASE = 36


def _digest(text: str, size: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def base_name(name: str) -> str:
    """The parent's name, shortened (with a hash, so still unique) when too long."""
    if len(name) <= MAX_BASE:
        return name
    return f"{name[: MAX_BASE - 9].rstrip('-.')}-{_digest(name)}"


def label_value(name: str) -> str:
    """A label value (at most 63 characters) that identifies the parent."""
    if len(name) <= 63:
        return name
    return f"{name[:54].rstrip('-.')}-{_digest(name)}"


def child_name(parent: str, suffix: str) -> str:
    return f"{base_name(parent)}-{suffix}"


def selector_labels(owner_kind: str, owner: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "kubestar",
        LABEL_INSTANCE: label_value(owner),
        LABEL_COMPONENT: component,
        LABEL_OWNER_KIND: owner_kind,
    }


def labels(owner_kind: str, owner: str, component: str) -> dict[str, str]:
    return {**selector_labels(owner_kind, owner, component), LABEL_MANAGED_BY: MANAGED_BY}


def owner_reference(parent: Mapping[str, Any]) -> Obj:
    meta = parent["metadata"]
    return {
        "apiVersion": parent.get("apiVersion", API_VERSION),
        "kind": parent["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(parent: Mapping[str, Any], name: str, component: str, **extra_labels: str) -> Obj:
    """Metadata of a child: same namespace, kubestar labels, the parent as controller."""
    meta = parent["metadata"]
    return {
        "name": name,
        "namespace": meta.get("namespace", "default"),
        "labels": {**labels(parent["kind"], meta["name"], component), **extra_labels},
        "ownerReferences": [owner_reference(parent)],
    }


def spec_hash(obj: Mapping[str, Any]) -> str:
    """A hash of what the operator wants a child to be (its annotation excluded)."""
    clean = json.loads(json.dumps(obj, sort_keys=True, default=str))
    meta = clean.get("metadata", {})
    annotations = meta.get("annotations")
    if annotations is not None:
        annotations.pop(ANNOTATION_HASH, None)
        if not annotations:
            del meta["annotations"]
    return _digest(json.dumps(clean, sort_keys=True), 16)


def with_hash(obj: Obj) -> Obj:
    """The object with its spec hash annotation set (what the applier compares)."""
    digest = spec_hash(obj)
    obj.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_HASH] = digest
    return obj


def service_account(parent: Mapping[str, Any], name: str, component: str) -> Obj:
    """A ServiceAccount its pods run as (with a Role and RoleBinding of the same name)."""
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(parent, name, component),
        }
    )


def role(parent: Mapping[str, Any], name: str, component: str, rules: list[Obj]) -> Obj:
    return with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(parent, name, component),
            "rules": rules,
        }
    )


def role_binding(parent: Mapping[str, Any], name: str, component: str) -> Obj:
    """Binds the Role `name` to the ServiceAccount `name` of the parent's namespace."""
    return with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(parent, name, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": name,
                    "namespace": parent["metadata"].get("namespace", "default"),
                }
            ],
        }
    )


def rbac(parent: Mapping[str, Any], name: str, component: str, rules: list[Obj]) -> list[Obj]:
    """A ServiceAccount, a Role with `rules` and the RoleBinding between them, all `name`."""
    return [
        service_account(parent, name, component),
        role(parent, name, component, rules),
        role_binding(parent, name, component),
    ]


def quantity(value: str | int | float) -> str:
    """Quantities as strings: server-side apply requires them typed so."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def resources(requests: Mapping[str, Any], limits: Mapping[str, Any]) -> Obj:
    out: Obj = {}
    if requests:
        out["requests"] = {k: quantity(v) for k, v in requests.items()}
    if limits:
        out["limits"] = {k: quantity(v) for k, v in limits.items()}
    return out


def restricted_container_security(read_only_root: bool = True) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def network_policy(
    parent: Mapping[str, Any],
    name: str,
    component: str,
    pods: Mapping[str, str],
    ingress: list[Obj],
    egress: list[Obj],
) -> Obj:
    """A NetworkPolicy for `pods` (labels), isolated both ways: only `ingress` reaches them,
    and they reach only `egress` (an empty list: nothing). Policies add up: a pod several
    select gets what any of them allows, and an admin's own policies widen these."""
    return with_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(parent, name, component),
            "spec": {
                "podSelector": {"matchLabels": dict(pods)},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": ingress,
                "egress": egress,
            },
        }
    )


def pods_of(labels: Mapping[str, str]) -> Obj:
    """A NetworkPolicy peer: pods of this namespace with these labels."""
    return {"podSelector": {"matchLabels": dict(labels)}}


def trainer_rank0_pods() -> Obj:
    """A NetworkPolicy peer: the pods that hold rank 0 (worker 0) of every TrainingRun of
    this namespace, which alone call the fleets, the pools and take part in a weights
    broadcast (a run names its fleet and pool, so any run here may use them)."""
    return pods_of({LABEL_NAME: "kubestar", LABEL_COMPONENT: "trainer", LABEL_WORKER: "0"})


def operator_pods(namespace: str) -> Obj:
    """A NetworkPolicy peer: the operator's pods in `namespace` (by the namespace's
    kubernetes.io/metadata.name label, which Kubernetes 1.21+ sets)."""
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": {LABEL_NAME: "kubestar", LABEL_COMPONENT: "operator"}},
    }


def tcp_ports(*ports: int | str) -> list[Obj]:
    return [{"protocol": "TCP", "port": port} for port in ports]


# Every TCP port: torch.distributed's and a weights broadcast's connections (gloo pairs,
# NCCL's sockets) go to ports each end picks at random, in either direction.
ALL_TCP: list[Obj] = [{"protocol": "TCP"}]

# Name lookups, for pods that dial by DNS name (the trainer its fleet's scheduler, its pool's
# dispatcher and its rendezvous; the dispatcher its workers). To any address: the cluster's
# DNS is a Service whose endpoints may not be pods (a node-local cache, say).
DNS_EGRESS: Obj = {
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}


def api_server_egress(peers: list[Obj], port: int) -> Obj:
    """Egress to the Kubernetes API server, for pods that call it. Policies see a connection
    to the kubernetes Service after its translation, to the API server's own address and
    port, which no pod selector names: `peers` (ipBlocks of the control plane) where the
    admin gives them, else any address; on 443 (managed control planes), 6443 (kubeadm's)
    and `port` (network.apiServerPort) only."""
    rule: Obj = {"ports": tcp_ports(*sorted({443, 6443, port}))}
    if peers:
        rule["to"] = [dict(peer) for peer in peers]
    return rule


def metrics_peers(peers: list[Obj]) -> list[Obj]:
    """Who may scrape a metrics port: `peers` (networkPolicies.metricsFrom), else the pods
    of the policy's own namespace."""
    return [dict(peer) for peer in peers] or [{"podSelector": {}}]


def scrape_annotations(container: Obj, port: str = "metrics") -> dict[str, str]:
    """The prometheus.io annotations of a pod whose `container` serves /metrics on its port
    named `port`: what a Prometheus without the Prometheus operator discovers pods by."""
    number = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(number),
        "prometheus.io/path": "/metrics",
    }


def listen_address(host: str, port: int) -> str:
    """HOST:PORT for a server's listen flag ([HOST]:PORT for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def env_list(values: Mapping[str, str]) -> list[Obj]:
    return [{"name": k, "value": v} for k, v in values.items()]


def gpus(resources: Mapping[str, Any]) -> tuple[int, str]:
    """(count, resource name) of the GPUs in a container's resources (a */gpu resource:
    amd.com/gpu, nvidia.com/gpu), limits first; (0, "") without one."""
    for section in ("limits", "requests"):
        for key, value in (resources.get(section) or {}).items():
            if key.endswith("/gpu") and str(value).isdigit():
                return int(value), key
    return 0, ""


# What torch, inductor and triton need of a non-root uid that is in no /etc/passwd:
# getpass.getuser() reads USER or LOGNAME (and raises without them), HOME and the compile
# caches must be writable. /tmp is each such pod's emptyDir.
NON_ROOT_ENV = {
    "USER": "kubestar",
    "LOGNAME": "kubestar",
    "HOME": "/tmp",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor",
    "TRITON_CACHE_DIR": "/tmp/triton",
}


def gpu_toleration(resource: str) -> Obj:
    """Tolerates the taint GPU nodes commonly carry: their GPU resource's name, NoSchedule."""
    return {"key": resource, "operator": "Exists", "effect": "NoSchedule"}


def with_accelerator_env(container: Obj) -> Obj:
    """`container` told the GPUs its resources give it (kubestar.common.accelerators'
    ENV_GPUS and ENV_GPU_RESOURCE), which it checks torch sees before it starts; unchanged
    without GPUs. The resource's field reference cannot carry an extended resource, so the
    values are written out."""
    count, resource = gpus(container.get("resources") or {})
    if count:
        env = container.setdefault("env", [])
        env += env_list(
            {accelerators.ENV_GPUS: str(count), accelerators.ENV_GPU_RESOURCE: resource}
        )
    return container


# The installation's bearer token (kubestar.common.auth) in every pod that serves or calls
# kubestar's services: a Secret beside the resource, mounted read-only under
# /var/run/secrets, which the sandbox hides from tool calls (an empty mount over it).
AUTH_VOLUME = "kubestar-auth"
AUTH_DIR = "/var/run/secrets/kubestar/auth"
AUTH_KEY = "token"
AUTH_TOKEN_FILE = f"{AUTH_DIR}/{AUTH_KEY}"
# A digest of the token on pod templates: a new token rolls the pods (servers read it once).
ANNOTATION_AUTH = "kubestar.dev/auth-token-digest"


def auth_secret(parent: Mapping[str, Any], name: str, component: str, token: str) -> Obj:
    """The token of the resource's namespace, derived from the installation's `token`
    (kubestar.common.auth.namespace_token): its pods serve and call with it, and the other
    namespaces' services refuse it. Owned by the resource, like every child."""
    namespace = parent["metadata"].get("namespace", "default")
    mine = namespace_token(token, namespace)
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata(parent, name, component),
            "type": "Opaque",
            "data": {AUTH_KEY: base64.b64encode(mine.encode()).decode()},
        }
    )


def with_auth(workload: Obj, secret: str, token: str, flag: bool = True) -> Obj:
    """`workload` (a Deployment, StatefulSet or Job) with the Secret `secret` mounted
    read-only at AUTH_DIR in each container, KUBESTAR_AUTH_TOKEN_FILE naming the file (what
    clients read), `--auth-token-file` added to each container's command when `flag` (the
    servers'), and the token's digest on the pod template; unchanged without a token."""
    if not token:
        return workload
    template = workload["spec"]["template"]
    pod = template["spec"]
    pod.setdefault("volumes", []).append({"name": AUTH_VOLUME, "secret": {"secretName": secret}})
    for container in pod["containers"]:
        container.setdefault("volumeMounts", []).append(
            {"name": AUTH_VOLUME, "mountPath": AUTH_DIR, "readOnly": True}
        )
        container.setdefault("env", []).append({"name": ENV_TOKEN_FILE, "value": AUTH_TOKEN_FILE})
        if flag:
            container["command"] = auth_flagged(container["command"])
    annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[ANNOTATION_AUTH] = _digest(f"kubestar-auth:{token}", 16)
    return with_hash(workload)


def auth_flagged(command: list[str]) -> list[str]:
    """A kubestar command with `--auth-token-file AUTH_TOKEN_FILE`, before any `--` (after
    which arguments go to vLLM)."""
    at = command.index("--") if "--" in command else len(command)
    return [*command[:at], "--auth-token-file", AUTH_TOKEN_FILE, *command[at:]]


def mount_model(container: Obj, volumes: list[Obj], model: ModelSource) -> None:
    """The model's claim, read-only at MODEL_MOUNT (where ModelSource.location points)."""
    container["volumeMounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    volumes.append(
        {
            "name": "model",
            "persistentVolumeClaim": {"claimName": model.pvc_claim_name, "readOnly": True},
        }
    )


def single_pod_rollout(host_network: bool) -> Obj:
    """How a one-pod Deployment (a scheduler, a dispatcher) is replaced: the new pod first,
    so that one always serves; on the host's network the old one first, since both would
    need the same host ports and the new pod could never be scheduled beside the old."""
    surge, unavailable = (0, 1) if host_network else (1, 0)
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
    }


def with_pod_overrides(
    workload: Obj, overrides: PodOverrides | None, pull_secrets: Sequence[str] = ()
) -> Obj:
    """`workload` (a Deployment, StatefulSet or Job) with the installation's image pull
    secrets (`pull_secrets`, the chart's images.pullSecrets) and a component's podOverrides
    merged into its pod template: added to what kubestar set, never replacing its command,
    probes, volumes or security context (the override type has no such fields, and the
    spec refuses kubestar's label keys, annotations and environment names). A variable or a
    resource kubestar also sets takes the override's value; kubestar's annotations stay."""
    template = workload["spec"]["template"]
    pod = template["spec"]
    names = [
        *pull_secrets,
        *(ref.name for ref in (overrides.image_pull_secrets if overrides else [])),
    ]
    if names:
        pod["imagePullSecrets"] = [{"name": name} for name in dict.fromkeys(names)]
    if overrides is None:
        return with_hash(workload)
    meta = template.setdefault("metadata", {})
    if overrides.labels:
        meta["labels"] = {**overrides.labels, **meta.get("labels", {})}
    if overrides.annotations:
        meta["annotations"] = {**overrides.annotations, **meta.get("annotations", {})}
    if overrides.node_selector:
        pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **overrides.node_selector}
    if overrides.tolerations:
        pod["tolerations"] = [
            *pod.get("tolerations", []),
            *(_clean(t.model_dump(mode="json", by_alias=True)) for t in overrides.tolerations),
        ]
    if overrides.affinity:
        pod["affinity"] = overrides.affinity
    if overrides.priority_class_name:
        pod["priorityClassName"] = overrides.priority_class_name
    if overrides.scheduler_name:
        pod["schedulerName"] = overrides.scheduler_name
    if overrides.supplemental_groups:
        security = pod.setdefault("securityContext", {})
        groups = [*security.get("supplementalGroups", []), *overrides.supplemental_groups]
        security["supplementalGroups"] = list(dict.fromkeys(groups))
    for container in pod["containers"]:
        for var in overrides.env:
            entry = _clean(var.model_dump(mode="json", by_alias=True))
            env = container.setdefault("env", [])
            at = next((i for i, e in enumerate(env) if e["name"] == var.name), None)
            if at is None:
                env.append(entry)
            else:
                env[at] = entry
    main = pod["containers"][0]
    extra = overrides.resources
    for section, values in (("requests", extra.requests), ("limits", extra.limits)):
        if values:
            current = main.setdefault("resources", {}).setdefault(section, {})
            current.update({key: quantity(value) for key, value in values.items()})
    return with_hash(workload)


def _clean(value: Any) -> Any:
    """A dumped override without its unset parts (None, "", {}), as Kubernetes writes them."""
    if isinstance(value, dict):
        cleaned = {k: _clean(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v not in (None, "", {})}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
