"""Children of a RolloutFleet (pure): a Deployment of vLLM engines, and the KV-aware
scheduler (Deployment, Service, and a ServiceAccount allowed to list the fleet's pods: it
discovers the ready engines by label selector, each on the port its pod names `http`).

On the node's network (network.hostNetwork) every engine needs a port of its own, which one
pod template cannot give: engine i is then a Deployment of its own, serving on
engine.port + i, so that a fleet still scales to any size on one node. The operator never
deletes: an engine beyond spec.replicas keeps its Deployment at 0 replicas.

Engines by accelerator: `amd` runs vLLM's ROCm image and asks for `amd.com/gpu`, `nvidia`
vLLM's CUDA image and `nvidia.com/gpu` (tensorParallelSize GPUs per engine, tolerating the
usual GPU taints), `cpu` kubestar's engine image (vLLM's CPU build) through
`kubestar engine serve`. GPU images run vLLM's OpenAI server directly, with kubestar's
weights route and worker extension (kubestar.engine.weight_sync) imported from a copy in a
ConfigMap, since those images lack kubestar. With spec.weightSync volume the engines mount the
chart's shared checkpoint volume, where the trainers write their weights; with broadcast they
mount nothing of the trainers'.

With the installation's token (settings.auth) the fleet gets a copy of it (a Secret) that its
engines and scheduler mount: the scheduler requires it of its callers and sends it to the
engines, which require it on every path but /health, /ping and /metrics.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from kubestar.api.v1alpha1 import RolloutFleetSpec
from kubestar.engine.launch import SERVED_MODEL_NAME, EngineSettings
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings

ENGINE = "engine"
SCHEDULER = "scheduler"
GPU_RESOURCE = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}
# GPU engines import kubestar's engine modules from a ConfigMap: their names there, its folder.
ENGINE_AUTH_MODULE = "kubestar_engine_auth"
ENGINE_WEIGHT_SYNC_MODULE = "kubestar_weight_sync"
# Runs before vLLM: checks that torch sees the engine's GPUs (kubestar.common.accelerators).
ENGINE_ACCELERATORS_MODULE = "kubestar_accelerators"
TERMINATION_LOG = "/dev/termination-log"
ENGINE_MODULES_DIR = "/etc/kubestar/engine-modules"
# On the host's network: which engine of the fleet a Deployment and its pod are.
LABEL_ENGINE_INDEX = "kubestar.dev/engine-index"
# How often the scheduler lists the fleet's pods, and how long a deleted engine keeps
# serving (its preStop pause): the scheduler stops sending it turns and moves those in flight
# before the engine stops, so a scale-down or a rolling update costs no turn a retry.
DISCOVERY_INTERVAL_SECONDS = 2
ENGINE_DRAIN_SECONDS = 3 * DISCOVERY_INTERVAL_SECONDS


def auth_name(fleet: str) -> str:
    """The fleet's copy of the installation's token (its engines and scheduler mount it)."""
    return o.child_name(fleet, "fleet-auth")


def engine_modules_name(fleet: str) -> str:
    return o.child_name(fleet, "engine-modules")


def engine_name(fleet: str, index: int | None = None) -> str:
    """The engines' Deployment, or on the host's network engine `index`'s."""
    name = o.child_name(fleet, "engine")
    return name if index is None else f"{name}-{index}"


def scheduler_name(fleet: str) -> str:
    return o.child_name(fleet, "scheduler")


def engine_selector(fleet: str) -> dict[str, str]:
    return o.selector_labels("RolloutFleet", fleet, ENGINE)


def engine_selector_text(fleet: str) -> str:
    """engine_selector as a label selector's text (status.selector, the scheduler's)."""
    return ",".join(f"{key}={value}" for key, value in engine_selector(fleet).items())


def engine_count(deployments: Sequence[Mapping[str, Any]]) -> int:
    """On the host's network: how many engines have a Deployment (the highest index + 1)."""
    indices = [
        int(index)
        for deployment in deployments
        if (
            index := (deployment["metadata"].get("labels") or {}).get(LABEL_ENGINE_INDEX, "")
        ).isdigit()
    ]
    return max(indices, default=-1) + 1


def scheduler_endpoint(
    fleet: str, namespace: str, spec: RolloutFleetSpec, settings: OperatorSettings
) -> str:
    if settings.network.host_network:
        return f"127.0.0.1:{spec.scheduler.port}"
    domain = settings.network.cluster_domain
    return f"{scheduler_name(fleet)}.{namespace}.svc.{domain}:{spec.scheduler.port}"


def openai_endpoint(
    fleet: str, namespace: str, spec: RolloutFleetSpec, settings: OperatorSettings
) -> str:
    """The OpenAI-compatible API's base URL ("" when spec.scheduler.openaiPort is 0)."""
    port = spec.scheduler.openai_port
    if not port:
        return ""
    if settings.network.host_network:
        return f"http://127.0.0.1:{port}/v1"
    domain = settings.network.cluster_domain
    return f"http://{scheduler_name(fleet)}.{namespace}.svc.{domain}:{port}/v1"


def engine_image(spec: RolloutFleetSpec, settings: OperatorSettings) -> str:
    if spec.engine.image:
        return spec.engine.image
    images = settings.images
    return {
        "amd": images.engine_rocm,
        "nvidia": images.engine_cuda,
        "cpu": images.engine_cpu,
    }[spec.accelerator]


def engine_command(
    spec: RolloutFleetSpec,
    bind_address: str = "0.0.0.0",
    auth_token_file: str = "",
    port: int | None = None,
) -> list[str]:
    """`auth_token_file`: the engine requires the token in that file (a CPU engine through
    `kubestar engine serve --auth-token-file`, a GPU image through vLLM's --middleware and
    the copy of the middleware's module in engine_modules_config). `port`: another than
    spec.engine.port (an engine of its own on the host's network)."""
    engine = spec.engine
    port = engine.port if port is None else port
    if spec.accelerator == "cpu":
        command = [
            "kubestar",
            "engine",
            "serve",
            "--model",
            spec.model.location(),
            "--host",
            bind_address,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-model-len",
            str(engine.max_model_len),
            "--kv-cache-bytes",
            str(engine.kv_cache_bytes),
            "--max-num-seqs",
            str(engine.max_num_seqs),
        ]
        if auth_token_file:
            command += ["--auth-token-file", auth_token_file]
        return command + (["--", *engine.extra_args] if engine.extra_args else [])
    settings = EngineSettings(
        model=spec.model.location(),
        host=bind_address,
        port=port,
        max_model_len=engine.max_model_len,
        kv_cache_bytes=engine.kv_cache_bytes,
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        device="rocm" if spec.accelerator == "amd" else "cuda",
        max_num_seqs=engine.max_num_seqs,
        extra_args=list(engine.extra_args),
        python="python3",
        auth_token_file=auth_token_file,
        auth_middleware=f"{ENGINE_AUTH_MODULE}.BearerTokenMiddleware",
        weight_sync_module=ENGINE_WEIGHT_SYNC_MODULE,
    )
    # An engine whose torch does not see its GPUs states AcceleratorUnavailable and exits
    # instead of starting vLLM.
    check = [
        "python3",
        f"{ENGINE_MODULES_DIR}/{ENGINE_ACCELERATORS_MODULE}.py",
        "--termination-log",
        TERMINATION_LOG,
        "--python-path",
        ENGINE_MODULES_DIR,
    ]
    return [*check, "--", *settings.command()]


def engine_env(spec: RolloutFleetSpec) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    # Engines run as a non-root uid: a user name for getpass, caches (compile, kernels) in
    # the writable /tmp.
    env.update(o.NON_ROOT_ENV)
    if spec.accelerator == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        # The engine runs eagerly (--enforce-eager), but vLLM's sampler still torch.compiles
        # a helper the first time logprobs are asked for, which needs a C++ compiler in the
        # image (a slim engine image has none: the engine died on the first rollout).
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def engine_resources(spec: RolloutFleetSpec) -> o.Obj:
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    gpu = GPU_RESOURCE.get(spec.accelerator)
    if gpu:
        limits.setdefault(gpu, spec.engine.tensor_parallel_size)
        requests.setdefault(gpu, limits[gpu])
    return o.resources(requests, limits)


def _network(pod: o.Obj, settings: OperatorSettings) -> None:
    if settings.network.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"


def _api_server_env(settings: OperatorSettings) -> dict[str, str]:
    if not settings.network.api_server_host:
        return {}
    return {
        "KUBERNETES_SERVICE_HOST": settings.network.api_server_host,
        "KUBERNETES_SERVICE_PORT": str(settings.network.api_server_port),
    }


ENGINE_ROLLOUT = {
    "type": "RollingUpdate",
    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "25%"},
}


def engine_deployments(
    fleet: Mapping[str, Any], spec: RolloutFleetSpec, settings: OperatorSettings, existing: int = 0
) -> list[o.Obj]:
    """The engines' Deployment; on the host's network one per engine, for each of the
    spec.replicas engines and each of the `existing` ones beyond them (those at 0)."""
    if not settings.network.host_network:
        return [engine_deployment(fleet, spec, settings)]
    count = max(spec.replicas, existing)
    return [engine_deployment(fleet, spec, settings, index) for index in range(count)]


def engine_deployment(
    fleet: Mapping[str, Any],
    spec: RolloutFleetSpec,
    settings: OperatorSettings,
    index: int | None = None,
) -> o.Obj:
    """All the engines, or engine `index` alone (on the host's network: its own port)."""
    name = fleet["metadata"]["name"]
    port = spec.engine.port + (index or 0)
    container: o.Obj = {
        "name": "engine",
        "image": engine_image(spec, settings),
        "imagePullPolicy": settings.images.pull_policy,
        "command": engine_command(
            spec,
            settings.network.bind_address,
            o.AUTH_TOKEN_FILE if settings.auth.token else "",
            port,
        ),
        "env": o.env_list(engine_env(spec)),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": engine_resources(spec),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            # Loading a large model takes minutes: allow 30.
            "failureThreshold": 180,
        },
        # A busy engine (a CPU one above all) answers /health late: a short timeout took it
        # out of the scheduler's endpoints mid-run and back, over and over (seen in e2e
        # under load). Not ready only after 30 s without an answer.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 5,
        },
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": o.restricted_container_security(read_only_root=False),
        # A deleted engine serves on until the scheduler has let it go (ENGINE_DRAIN_SECONDS).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ENGINE_DRAIN_SECONDS)]}}},
    }
    volumes: list[o.Obj] = [
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.model.pvc_claim_name:
        o.mount_model(container, volumes, spec.model)
    shared = settings.trainer.shared_checkpoints
    if spec.weight_sync == "volume" and shared.enabled:
        # The weights each trainer pushes are read from the trainer's checkpoint volume, at
        # the path the trainer wrote them to.
        container["volumeMounts"].append(
            {
                "name": "checkpoints",
                "mountPath": settings.trainer.checkpoint_dir,
                "readOnly": True,
            }
        )
        volumes.append(shared.volume("checkpoints", read_only=True))
    if settings.network.host_network:
        container["ports"][0]["hostPort"] = port
    o.with_accelerator_env(container)
    # Pod Security Standard "restricted". The trainers' uid: engines read the weights the
    # trainers write. GPU images that expect root need their devices readable by it (the
    # NVIDIA runtime does that; ROCm's /dev/kfd and /dev/dri want the video and render
    # groups: supplementalGroups by a policy of the cluster's).
    uid = settings.trainer.run_as_user
    pod: o.Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": ENGINE_DRAIN_SECONDS + 30,
    }
    gpu = GPU_RESOURCE.get(spec.accelerator)
    if gpu:
        pod["tolerations"] = [o.gpu_toleration(gpu)]
    groups = settings.gpu_groups(gpu or "")
    if groups:  # ROCm's devices open to the video and render groups only
        pod["securityContext"]["supplementalGroups"] = groups
    _network(pod, settings)
    if spec.accelerator != "cpu":
        # vLLM's own images lack kubestar: its engine modules come from copies, which the
        # GPU check (the command's first part) appends to the image's PYTHONPATH for vLLM.
        container["volumeMounts"].append(
            {"name": "engine-modules", "mountPath": ENGINE_MODULES_DIR, "readOnly": True}
        )
        volumes.append({"name": "engine-modules", "configMap": {"name": engine_modules_name(name)}})
    replicas, strategy = spec.replicas, ENGINE_ROLLOUT
    selector, labels = engine_selector(name), o.labels("RolloutFleet", name, ENGINE)
    own: dict[str, str] = {}
    if index is not None:
        own = {LABEL_ENGINE_INDEX: str(index)}
        replicas = 1 if index < spec.replicas else 0
        strategy = o.single_pod_rollout(host_network=True)
    engines = o.with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": o.metadata(fleet, engine_name(name, index), ENGINE, **own),
            "spec": {
                "replicas": replicas,
                # A change (a new image, a chart upgrade) replaces a quarter of the engines
                # at a time (at least one), the others serving meanwhile; none extra is
                # started first, since a new engine cannot get GPUs while an old one holds
                # them. On the host's network each engine's Deployment replaces its one pod,
                # the old first (the new one needs its port).
                "strategy": strategy,
                "selector": {"matchLabels": {**selector, **own}},
                "template": {
                    "metadata": {
                        "labels": {**labels, **own},
                        "annotations": {
                            "kubestar.dev/served-model-name": SERVED_MODEL_NAME,
                            # vLLM's own metrics (vllm:*) on its serving port.
                            **o.scrape_annotations(container, "http"),
                        },
                    },
                    "spec": pod,
                },
            },
        }
    )
    overrides = spec.pod_overrides.engine if spec.pod_overrides else None
    engines = o.with_pod_overrides(engines, overrides, settings.images.pull_secret_names)
    return o.with_auth(engines, auth_name(name), settings.auth.token, flag=False)


def engine_modules_config(fleet: Mapping[str, Any], auth: bool = True) -> o.Obj:
    """kubestar's engine modules as GPU engines import them (their images have vLLM but not
    kubestar): the weights route and worker extension (kubestar.engine.weight_sync, which
    imports torch where it uses it), the check of the engine's GPUs that runs before vLLM
    (kubestar.common.accelerators) and, with `auth`, the auth middleware
    (kubestar.engine.auth_middleware, standard library only)."""
    name = fleet["metadata"]["name"]
    package = resources.files("kubestar.engine")
    common = resources.files("kubestar.common")
    data = {
        f"{ENGINE_WEIGHT_SYNC_MODULE}.py": package.joinpath("weight_sync.py").read_text(),
        f"{ENGINE_ACCELERATORS_MODULE}.py": common.joinpath("accelerators.py").read_text(),
    }
    if auth:
        data[f"{ENGINE_AUTH_MODULE}.py"] = package.joinpath("auth_middleware.py").read_text()
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": o.metadata(fleet, engine_modules_name(name), ENGINE),
            "data": data,
        }
    )


def spec_problem(spec: RolloutFleetSpec, settings: OperatorSettings) -> str | None:
    """Why this installation cannot run the fleet as written, or None."""
    refused = settings.refusal("spec.engine.image", image=spec.engine.image)
    if refused:
        return refused
    if spec.weight_sync == "volume" and not settings.trainer.shared_checkpoints.enabled:
        return (
            "spec.weightSync is volume, but this installation has no shared checkpoint volume "
            "for the engines to read the trainers' weights from: set spec.weightSync to "
            "broadcast, or the chart's trainer.sharedCheckpoints"
        )
    return None


# The scheduler lists the fleet's pods to find its engines.
SCHEDULER_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def scheduler_rbac(fleet: Mapping[str, Any]) -> list[o.Obj]:
    """The scheduler's ServiceAccount, Role (SCHEDULER_RULES) and RoleBinding."""
    name = scheduler_name(fleet["metadata"]["name"])
    return o.rbac(fleet, name, SCHEDULER, SCHEDULER_RULES)


def scheduler_deployment(
    fleet: Mapping[str, Any], spec: RolloutFleetSpec, settings: OperatorSettings
) -> o.Obj:
    meta = fleet["metadata"]
    name = meta["name"]
    port = spec.scheduler.port
    metrics = settings.metrics_port(settings.ports.scheduler_metrics, port)
    selector = engine_selector_text(name)
    container: o.Obj = {
        "name": "scheduler",
        "image": settings.images.kubestar,
        "imagePullPolicy": settings.images.pull_policy,
        "command": [
            "kubestar",
            "scheduler",
            "serve",
            "--listen",
            o.listen_address(settings.network.bind_address, port),
            "--policy",
            spec.scheduler.policy,
            "--poll-interval",
            f"{spec.scheduler.metrics_interval_seconds:g}",
            "--segment-tokens",
            str(spec.scheduler.segment_tokens),
            "--weights-reload-timeout",
            f"{spec.scheduler.weights_reload_timeout_seconds:g}",
            "--k8s-selector",
            selector,
            "--k8s-namespace",
            meta.get("namespace", "default"),
            "--k8s-port",
            str(spec.engine.port),
            "--k8s-interval",
            str(DISCOVERY_INTERVAL_SECONDS),
            "--metrics-port",
            str(metrics),
            "--metrics-address",
            settings.network.bind_address,
        ],
        "env": o.env_list({"PYTHONUNBUFFERED": "1", "HOME": "/tmp", **_api_server_env(settings)}),
        "ports": [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}},
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
        "securityContext": o.restricted_container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.scheduler.openai_port:
        # The OpenAI-compatible API: the tokenizer and chat template of the served model.
        container["command"] += [
            "--openai-listen",
            o.listen_address(settings.network.bind_address, spec.scheduler.openai_port),
            "--tokenizer",
            spec.model.location(),
            "--served-model-name",
            spec.model.name or spec.model.location(),
        ]
        container["ports"].append(
            {"name": "openai", "containerPort": spec.scheduler.openai_port, "protocol": "TCP"}
        )
    if settings.network.host_network:
        for item in container["ports"]:
            item["hostPort"] = item["containerPort"]
    pod: o.Obj = {
        "serviceAccountName": scheduler_name(name),
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if spec.scheduler.openai_port and spec.model.pvc_claim_name:
        o.mount_model(container, pod["volumes"], spec.model)  # its tokenizer and chat template
    _network(pod, settings)
    scheduler = o.with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": o.metadata(fleet, scheduler_name(name), SCHEDULER),
            "spec": {
                "replicas": 1,
                "strategy": o.single_pod_rollout(settings.network.host_network),
                "selector": {"matchLabels": o.selector_labels("RolloutFleet", name, SCHEDULER)},
                "template": {
                    "metadata": {
                        "labels": o.labels("RolloutFleet", name, SCHEDULER),
                        "annotations": o.scrape_annotations(container),
                    },
                    "spec": pod,
                },
            },
        }
    )
    overrides = spec.pod_overrides.scheduler if spec.pod_overrides else None
    scheduler = o.with_pod_overrides(scheduler, overrides, settings.images.pull_secret_names)
    # The scheduler requires the token of its callers and sends it to the engines.
    return o.with_auth(scheduler, auth_name(name), settings.auth.token)


def scheduler_service(fleet: Mapping[str, Any], spec: RolloutFleetSpec) -> o.Obj:
    name = fleet["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": o.metadata(fleet, scheduler_name(name), SCHEDULER),
            "spec": {
                "selector": o.selector_labels("RolloutFleet", name, SCHEDULER),
                "ports": [
                    {
                        "name": "grpc",
                        "port": spec.scheduler.port,
                        "targetPort": "grpc",
                        "protocol": "TCP",
                    },
                    *(
                        [
                            {
                                "name": "openai",
                                "port": spec.scheduler.openai_port,
                                "targetPort": "openai",
                                "protocol": "TCP",
                            }
                        ]
                        if spec.scheduler.openai_port
                        else []
                    ),
                ],
            },
        }
    )


def network_policies(
    fleet: Mapping[str, Any], spec: RolloutFleetSpec, settings: OperatorSettings
) -> list[o.Obj]:
    """Engines: reached by their scheduler (generation, their gauges, the weights route) and
    by scrapers on their HTTP port (vLLM's /metrics; every other path requires the token).
    With spec.weightSync broadcast they and the namespace's trainers (rank 0's pod, the
    weight server) reach each other on every TCP port, both ways: each engine worker dials
    the server's store on the weights port, then every pair of members of the session's
    process group connects on a port one of them picked at random, which end dialling
    depending on their addresses (gloo's pairs; NCCL's sockets alike). Nothing else: models
    are never downloaded, and engines dial nothing by name.

    The scheduler: reached by the namespace's trainers (rank 0's pod) and the operator on
    gRPC, by scrapers on the metrics port, and with spec.scheduler.openaiPort by anyone on
    the OpenAI-compatible API (its callers run wherever the user runs them: it requires the
    token); reaching its engines' HTTP port and the API server (it lists its engines' pods),
    and name lookups where the API server is given by name (network.apiServerHost)."""
    name = fleet["metadata"]["name"]
    engines = o.selector_labels("RolloutFleet", name, ENGINE)
    scheduler = o.selector_labels("RolloutFleet", name, SCHEDULER)
    policies = settings.network_policies
    scrapers = o.metrics_peers(policies.metrics_from)
    callers: list[o.Obj] = [o.trainer_rank0_pods()]
    if policies.operator_namespace:
        callers.append(o.operator_pods(policies.operator_namespace))
    broadcast = [o.pods_of(engines), o.trainer_rank0_pods()]
    engine_ingress = [
        {"from": [o.pods_of(scheduler)], "ports": o.tcp_ports("http")},
        {"from": scrapers, "ports": o.tcp_ports("http")},
    ]
    engine_egress: list[o.Obj] = []
    if spec.weight_sync == "broadcast":
        engine_ingress.append({"from": broadcast, "ports": o.ALL_TCP})
        engine_egress.append({"to": broadcast, "ports": o.ALL_TCP})
    network = settings.network
    scheduler_egress = [
        {"to": [o.pods_of(engines)], "ports": o.tcp_ports("http")},
        o.api_server_egress(policies.api_server_peers, network.api_server_port),
    ]
    if network.api_server_host and not is_ip_address(network.api_server_host):
        scheduler_egress.append(o.DNS_EGRESS)
    return [
        o.network_policy(
            fleet,
            engine_name(name),
            ENGINE,
            engines,
            ingress=engine_ingress,
            egress=engine_egress,
        ),
        o.network_policy(
            fleet,
            scheduler_name(name),
            SCHEDULER,
            scheduler,
            ingress=[
                {"from": callers, "ports": o.tcp_ports("grpc")},
                {"from": scrapers, "ports": o.tcp_ports("metrics")},
                *([{"ports": o.tcp_ports("openai")}] if spec.scheduler.openai_port else []),
            ],
            egress=scheduler_egress,
        ),
    ]


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def children(
    fleet: Mapping[str, Any], spec: RolloutFleetSpec, settings: OperatorSettings, existing: int = 0
) -> list[o.Obj]:
    """Everything a RolloutFleet owns, in creation order (`existing`: engine_deployments')."""
    policies = (
        network_policies(fleet, spec, settings)
        if settings.network_policies.enabled and not settings.network.host_network
        else []
    )
    token = settings.auth.token
    auth: list[o.Obj] = []
    if token:
        auth.append(o.auth_secret(fleet, auth_name(fleet["metadata"]["name"]), "fleet", token))
    modules = [engine_modules_config(fleet, bool(token))] if spec.accelerator != "cpu" else []
    return [
        *policies,
        *auth,
        *modules,
        *engine_deployments(fleet, spec, settings, existing),
        *scheduler_rbac(fleet),
        scheduler_service(fleet, spec),
        scheduler_deployment(fleet, spec, settings),
    ]
