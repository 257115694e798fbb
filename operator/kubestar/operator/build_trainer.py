"""Children of a TrainingRun (pure): the run's config (a ConfigMap with run.yaml), a service
account with a Role that may only read its own TrainingRun and patch that run's status, and
the trainer: one Job per worker (`<run>-trainer` is worker 0,
`<run>-trainer-N` worker N), each with one pod of processesPerWorker training processes, and
a headless Service `<run>-trainer` whose one endpoint is worker 0's pod, where the other
workers join the process group (the way Kubeflow's PyTorchJob does it, without Indexed Jobs,
which Kubernetes 1.20 lacks). See kubestar.api.trainer_contract for what the trainer
receives. With the installation's token (settings.auth) the run gets a copy of it (a
Secret) that its trainer pods mount; their sandbox, scheduler and engine clients send it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from kubestar.api import trainer_contract as c
from kubestar.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    RolloutFleetSpec,
    SandboxPoolSpec,
    TrainingRunSpec,
)
from kubestar.operator import build_fleet, build_sandbox
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings

TRAINER = "trainer"
# Job.spec.podFailurePolicy: beta and on by default from Kubernetes 1.26.
POD_FAILURE_POLICY_SINCE = (1, 26)
LABEL_WORKER = o.LABEL_WORKER


def trainer_name(run: str) -> str:
    """Worker 0's Job, the rendezvous Service, the service account and its Role."""
    return o.child_name(run, "trainer")


def worker_name(run: str, index: int) -> str:
    """The Job of trainer worker `index`."""
    return trainer_name(run) if index == 0 else o.child_name(run, f"trainer-{index}")


def world_size(spec: TrainingRunSpec) -> int:
    return spec.trainer.workers * spec.trainer.processes_per_worker


def config_name(run: str) -> str:
    return o.child_name(run, "run")


def run_manifest(run: Mapping[str, Any], spec: TrainingRunSpec) -> str:
    """run.yaml: the TrainingRun as `kubestar train -f` reads it (defaults filled in)."""
    meta = run["metadata"]
    document = {
        "apiVersion": API_VERSION,
        "kind": "TrainingRun",
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace", "default")},
        "spec": spec.model_dump(mode="json", by_alias=True),
    }
    return yaml.safe_dump(document, sort_keys=False)


def config_map(run: Mapping[str, Any], spec: TrainingRunSpec) -> o.Obj:
    name = run["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": o.metadata(run, config_name(name), TRAINER),
            "data": {"run.yaml": run_manifest(run, spec)},
        }
    )


def service_account(run: Mapping[str, Any]) -> o.Obj:
    return o.service_account(run, trainer_name(run["metadata"]["name"]), TRAINER)


def trainer_rules(name: str) -> list[o.Obj]:
    """May read its own TrainingRun, patch its status and keep its metrics log: resourceNames
    pins the run's."""
    return [
        {
            "apiGroups": [GROUP],
            "resources": ["trainingruns"],
            "resourceNames": [name],
            "verbs": ["get"],
        },
        {
            "apiGroups": [GROUP],
            "resources": ["trainingruns/status"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [c.metrics_log_name(name)],
            "verbs": ["get", "patch"],
        },
    ]


def role(run: Mapping[str, Any]) -> o.Obj:
    """May read its own TrainingRun and patch its status (trainer_rules)."""
    name = run["metadata"]["name"]
    return o.role(run, trainer_name(name), TRAINER, trainer_rules(name))


def role_binding(run: Mapping[str, Any]) -> o.Obj:
    return o.role_binding(run, trainer_name(run["metadata"]["name"]), TRAINER)


def shares_checkpoints(spec: TrainingRunSpec, settings: OperatorSettings) -> bool:
    """The run checkpoints to the volume its fleet's engines mount (not to its own PVC)."""
    return settings.trainer.shared_checkpoints.enabled and not spec.checkpoint.pvc_claim_name


def spec_problem(spec: TrainingRunSpec, settings: OperatorSettings) -> str | None:
    """Why this installation cannot run the spec as written, or None."""
    refused = settings.refusal("spec.trainer.image", image=spec.trainer.image)
    if refused:
        return refused
    shared = shares_checkpoints(spec, settings) or spec.checkpoint.pvc_claim_name
    if spec.trainer.workers > 1 and not shared:
        return (
            f"spec.trainer.workers is {spec.trainer.workers}: every trainer pod writes its "
            "shard of each checkpoint to one volume that all of them mount, and the run's own "
            "claim is ReadWriteOnce; set spec.checkpoint.pvcClaimName to a ReadWriteMany "
            "claim, or the chart's trainer.sharedCheckpoints, or use 1 worker"
        )
    return None


def persistent_checkpoints(spec: TrainingRunSpec, settings: OperatorSettings) -> bool:
    """Checkpoints outlive the trainer's pods (so a retry resumes rather than starts over):
    everywhere but in a development run's emptyDir."""
    return not ephemeral_checkpoints(spec, settings)


def ephemeral_checkpoints(spec: TrainingRunSpec, settings: OperatorSettings) -> bool:
    return spec.checkpoint.ephemeral and not shares_checkpoints(spec, settings)


def checkpoint_claim_name(run: str) -> str:
    return o.child_name(run, "checkpoints")


def checkpoint_claim(
    run: Mapping[str, Any], spec: TrainingRunSpec, settings: OperatorSettings
) -> o.Obj | None:
    """The claim the operator makes for the run's checkpoints, owned by the run (deleted
    with it), where the run names none and shares no volume with its engines."""
    if shares_checkpoints(spec, settings) or spec.checkpoint.pvc_claim_name:
        return None
    if spec.checkpoint.ephemeral:
        return None
    claim: o.Obj = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.checkpoint.storage}},
    }
    if spec.checkpoint.storage_class_name:
        claim["storageClassName"] = spec.checkpoint.storage_class_name
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": o.metadata(run, checkpoint_claim_name(run["metadata"]["name"]), TRAINER),
            "spec": claim,
        }
    )


def checkpoint_dir(
    run: Mapping[str, Any], spec: TrainingRunSpec, settings: OperatorSettings
) -> str:
    """Where the trainer checkpoints (and writes the weights it pushes to the engines).

    On the shared volume: a folder per run below trainer.checkpointDir, the path at which
    the engines mount that volume too. Otherwise spec.checkpoint.path or checkpointDir, on
    the run's own volume."""
    if shares_checkpoints(spec, settings):
        meta = run["metadata"]
        base = settings.trainer.checkpoint_dir.rstrip("/")
        return f"{base}/{meta.get('namespace', 'default')}/{meta['name']}"
    return spec.checkpoint.path or settings.trainer.checkpoint_dir


def checkpoint_volume(
    run: Mapping[str, Any], spec: TrainingRunSpec, settings: OperatorSettings
) -> str:
    """What holds the checkpoint folder, in words: what a full volume's message names."""
    if shares_checkpoints(spec, settings):
        return "the chart's shared checkpoint volume (trainer.sharedCheckpoints)"
    if ephemeral_checkpoints(spec, settings):
        return "an emptyDir (checkpoint.ephemeral)"
    claim = spec.checkpoint.pvc_claim_name or checkpoint_claim_name(run["metadata"]["name"])
    return f"PersistentVolumeClaim {claim}"


def trainer_env(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
    worker: int = 0,
) -> dict[str, str]:
    meta = run["metadata"]
    namespace = meta.get("namespace", "default")
    env = {
        c.ENV_NAME: meta["name"],
        c.ENV_NAMESPACE: namespace,
        c.ENV_RUN_CONFIG: c.RUN_CONFIG,
        c.ENV_SCHEDULER: build_fleet.scheduler_endpoint(
            spec.rollout_fleet_ref.name, namespace, fleet, settings
        ),
        c.ENV_SANDBOX: build_sandbox.endpoint(
            spec.sandbox_pool_ref.name, namespace, pool, settings
        ),
        c.ENV_SANDBOX_LIMITS: json.dumps(pool.limits.model_dump(by_alias=True), sort_keys=True),
        c.ENV_CHECKPOINT_DIR: checkpoint_dir(run, spec, settings),
        c.ENV_CHECKPOINT_VOLUME: checkpoint_volume(run, spec, settings),
        c.ENV_WORKERS: str(spec.trainer.workers),
        c.ENV_WORKER_INDEX: str(worker),
        c.ENV_PROCESSES: str(spec.trainer.processes_per_worker),
        c.ENV_RENDEZVOUS: rendezvous_address(run, settings) if world_size(spec) > 1 else "",
        c.ENV_WEIGHT_SYNC: fleet.weight_sync,
        c.ENV_WEIGHTS_LISTEN: weights_listen(settings),
        "PYTHONUNBUFFERED": "1",
        **o.NON_ROOT_ENV,
    }
    if worker == 0:
        env[c.ENV_METRICS_LISTEN] = metrics_listen(settings)
    if settings.network.loopback_only:
        # torch.distributed's collectives (gloo) on the loopback interface only.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if settings.network.loopback_only and not spec.trainer.ray_address:
        # Local Ray on the node's loopback only: with this, Ray takes 127.0.0.1 as the
        # node's address (GCS, raylet, workers bind it) instead of the first interface.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if settings.network.api_server_host:
        env["KUBERNETES_SERVICE_HOST"] = settings.network.api_server_host
        env["KUBERNETES_SERVICE_PORT"] = str(settings.network.api_server_port)
    return env


def _pod_spec(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    settings: OperatorSettings,
    env: dict[str, str],
    command: list[str],
) -> o.Obj:
    name = run["metadata"]["name"]
    subpath = ""
    if shares_checkpoints(spec, settings):
        # Only this run's folder of the shared volume, at the path the engines see it by:
        # a run can neither read nor overwrite another's checkpoints or weights.
        mount_path = env[c.ENV_CHECKPOINT_DIR]
        subpath = mount_path.removeprefix(settings.trainer.checkpoint_dir.rstrip("/") + "/")
        checkpoints: o.Obj = settings.trainer.shared_checkpoints.volume("checkpoints")
    else:
        mount_path = env[c.ENV_CHECKPOINT_DIR]
        claim = spec.checkpoint.pvc_claim_name or checkpoint_claim_name(name)
        checkpoints = {
            "name": "checkpoints",
            **(
                {"emptyDir": {}}
                if ephemeral_checkpoints(spec, settings)
                else {"persistentVolumeClaim": {"claimName": claim}}
            ),
        }
    container: o.Obj = {
        "name": "trainer",
        "image": spec.trainer.image or settings.images.kubestar,
        "imagePullPolicy": settings.images.pull_policy,
        "command": command,
        "env": o.env_list(env),
        "resources": o.resources(spec.trainer.resources.requests, spec.trainer.resources.limits),
        "volumeMounts": [
            {"name": "config", "mountPath": c.CONFIG_DIR, "readOnly": True},
            {
                "name": "checkpoints",
                "mountPath": mount_path,
                **({"subPath": subpath} if subpath else {}),
            },
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # A trainer that fails for a reason it states (CheckpointVolumeFull) writes it here;
        # the operator passes it on in TrainerReady.
        "terminationMessagePath": c.TERMINATION_LOG,
        "terminationMessagePolicy": "File",
    }
    if spec.trainer.data_pvc_claim_name:
        container["volumeMounts"].append(
            {"name": "data", "mountPath": spec.trainer.data_mount_path, "readOnly": True}
        )
    # Each rank checks that torch sees the GPUs the pod was given (AcceleratorUnavailable).
    o.with_accelerator_env(container)
    uid = settings.trainer.run_as_user
    pod: o.Obj = {
        "serviceAccountName": trainer_name(name),
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_name(name)}},
            checkpoints,
            {"name": "tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if spec.trainer.data_pvc_claim_name:
        pod["volumes"].append(
            {
                "name": "data",
                "persistentVolumeClaim": {
                    "claimName": spec.trainer.data_pvc_claim_name,
                    "readOnly": True,
                },
            }
        )
    if spec.model.pvc_claim_name:
        o.mount_model(container, pod["volumes"], spec.model)
    _, gpu = o.gpus(container["resources"])
    if gpu:  # GPU nodes are commonly tainted with their resource's name, as for engines
        pod["tolerations"] = [o.gpu_toleration(gpu)]
    groups = settings.gpu_groups(gpu)
    if groups:  # ROCm's devices open to the video and render groups only
        pod["securityContext"]["supplementalGroups"] = groups
    if settings.network.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod


# Info: a step's stage, filter and per-rank lines are what a user reads in `kubectl logs`.
TRAIN_COMMAND = ["kubestar", "train", "-f", c.RUN_CONFIG, "--in-cluster", "--log-level", "info"]


def rendezvous_address(run: Mapping[str, Any], settings: OperatorSettings) -> str:
    """HOST:PORT of the rendezvous Service, for clusters with DNS. With hostNetwork (clusters
    without pod networking, nor DNS) only :PORT: the trainer reads worker 0's pod address
    from status.rendezvousAddress."""
    if settings.network.host_network:
        return f":{settings.ports.trainer_rendezvous}"
    meta = run["metadata"]
    namespace = meta.get("namespace", "default")
    domain = settings.network.cluster_domain
    host = f"{trainer_name(meta['name'])}.{namespace}.svc.{domain}"
    return f"{host}:{settings.ports.trainer_rendezvous}"


def weights_listen(settings: OperatorSettings) -> str:
    """Where worker 0's WeightServer listens: the pod's address (the trainer's on the route
    to its scheduler) on trainer_weights; the loopback, or any free port, where pods share
    the host's network (the trainer tells the scheduler the address it got)."""
    if settings.network.loopback_only:
        return "127.0.0.1:0"
    if settings.network.host_network:
        return ":0"
    return f":{settings.ports.trainer_weights}"


def metrics_listen(settings: OperatorSettings) -> str:
    """Where rank 0 serves Prometheus metrics: the pod's addresses, or the loopback."""
    host = "127.0.0.1" if settings.network.loopback_only else ""
    return f"{host}:{settings.ports.trainer_metrics}"


def metrics_service_name(run: str) -> str:
    return o.child_name(run, "trainer-metrics")


def telemetry(run: Mapping[str, Any], settings: OperatorSettings) -> list[o.Obj]:
    """The ConfigMap where rank 0 keeps the run's metrics log (made empty: the trainer
    patches its data, which this operator never applies, so it keeps it), and a Service
    for rank 0's Prometheus metrics (what a ServiceMonitor selects)."""
    name = run["metadata"]["name"]
    port = settings.ports.trainer_metrics
    rank0 = {**o.selector_labels("TrainingRun", name, TRAINER), LABEL_WORKER: "0"}
    return [
        o.with_hash(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": o.metadata(run, c.metrics_log_name(name), TRAINER),
            }
        ),
        o.with_hash(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": o.metadata(run, metrics_service_name(name), TRAINER),
                "spec": {
                    "selector": rank0,
                    "ports": [
                        {"name": "metrics", "port": port, "targetPort": port, "protocol": "TCP"}
                    ],
                },
            }
        ),
    ]


def rendezvous_pod_address(pods: Sequence[Mapping[str, Any]]) -> str:
    """Worker 0's pod address (status.rendezvousAddress), once it has one; "" before."""
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        status = pod.get("status") or {}
        if labels.get(LABEL_WORKER) == "0" and status.get("phase") in ("Pending", "Running"):
            return str(status.get("podIP") or "")
    return ""


def rendezvous_service(run: Mapping[str, Any], settings: OperatorSettings) -> o.Obj:
    """Headless: its one endpoint is worker 0's pod, listed before that pod is ready (the
    other workers must find it while it waits for them)."""
    name = run["metadata"]["name"]
    selector = {**o.selector_labels("TrainingRun", name, TRAINER), LABEL_WORKER: "0"}
    port = settings.ports.trainer_rendezvous
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": o.metadata(run, trainer_name(name), TRAINER),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector,
                "ports": [
                    {"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}
                ],
            },
        }
    )


def job(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
    worker: int = 0,
    server_version: tuple[int, int] = (1, 20),
) -> o.Obj:
    """Trainer worker `worker`: a Job with one pod of processesPerWorker processes. A failed
    pod fails the Job after backoffLimit retries; a failed Job fails the run.
    `server_version`: the API server's (major, minor), for the fields it has."""
    name = run["metadata"]["name"]
    env = trainer_env(run, spec, fleet, pool, settings, worker)
    pod = _pod_spec(run, spec, settings, env, TRAIN_COMMAND)
    pod["restartPolicy"] = "Never"
    # SIGTERM makes the trainer checkpoint the step in progress and exit: give it the time.
    pod["terminationGracePeriodSeconds"] = settings.trainer.termination_grace_seconds
    worker_label = {LABEL_WORKER: str(worker)}
    template: o.Obj = {"labels": {**o.labels("TrainingRun", name, TRAINER), **worker_label}}
    if worker == 0:  # rank 0 serves the run's Prometheus metrics
        port = settings.ports.trainer_metrics
        metrics = {"name": "metrics", "containerPort": port, "protocol": "TCP"}
        template["annotations"] = o.scrape_annotations({"ports": [metrics]})
        if not settings.network.host_network:
            # On the host's network a declared port is a host port, which would keep a
            # replacement pod from being scheduled until the one it replaces is gone: the
            # replacement must start while the old pod checkpoints (it waits on the run
            # folder's lock), so the port is only in the annotations there.
            pod["containers"][0]["ports"] = [metrics]
    job_spec: o.Obj = {
        # A retry resumes from the newest checkpoint, if checkpoints outlive the pod.
        "backoffLimit": settings.trainer.backoff_limit
        if persistent_checkpoints(spec, settings)
        else 0,
        "template": {"metadata": template, "spec": pod},
    }
    if server_version >= POD_FAILURE_POLICY_SINCE:
        # A pod lost to a drain, an eviction or a preemption is not the trainer's failure:
        # it does not count against backoffLimit. A failure the trainer states as final (a
        # full checkpoint volume, a stage without problems) fails the Job at once: a retry
        # would meet it again.
        job_spec["podFailurePolicy"] = {
            "rules": [
                {
                    "action": "Ignore",
                    # status: required by the API servers of 1.26 to 1.34.
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": "trainer",
                        "operator": "In",
                        "values": [c.EXIT_FINAL_FAILURE],
                    },
                },
            ]
        }
    workload = o.with_hash(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": o.metadata(run, worker_name(name, worker), TRAINER, **worker_label),
            "spec": job_spec,
        }
    )
    overrides = spec.pod_overrides.trainer if spec.pod_overrides else None
    workload = o.with_pod_overrides(workload, overrides, settings.images.pull_secret_names)
    # The sandbox, scheduler and engine clients read the token from the file it names.
    return o.with_auth(workload, auth_name(name), settings.auth.token, flag=False)


def jobs(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
    server_version: tuple[int, int] = (1, 20),
) -> list[o.Obj]:
    """One Job per trainer worker, worker 0 first."""
    workers = range(spec.trainer.workers)
    return [job(run, spec, fleet, pool, settings, w, server_version) for w in workers]


def rank0_policy_name(run: str) -> str:
    return o.child_name(run, "trainer-rank0")


def network_policies(
    run: Mapping[str, Any], spec: TrainingRunSpec, settings: OperatorSettings
) -> list[o.Obj]:
    """Two policies; none when policies are off or pods use the host's network (which
    policies do not govern).

    `R-trainer`, every trainer pod of the run: it and the run's other trainer pods reach
    each other on every TCP port (the rendezvous on worker 0, then the collectives'
    connections on ports each rank picks); it reaches the API server (rank 0 patches the
    run's status, every pod reads worker 0's address from it) and name lookups (the
    rendezvous, the scheduler and the dispatcher are dialled by name).

    `R-trainer-rank0`, worker 0's pod, where rank 0 runs the agent loop and the weight
    server: it reaches its fleet's scheduler and its pool's dispatcher on gRPC, and it and
    its fleet's engines reach each other on every TCP port (a weights broadcast: see
    build_fleet.network_policies; the engines' side admits it only for a broadcast fleet);
    scrapers reach its metrics port.
    The other ranks call no service: they follow rank 0's steps."""
    if not settings.network_policies.enabled or settings.network.host_network:
        return []
    name = run["metadata"]["name"]
    trainers = o.selector_labels("TrainingRun", name, TRAINER)
    rank0 = {**trainers, LABEL_WORKER: "0"}
    fleet = spec.rollout_fleet_ref.name
    engines = build_fleet.engine_selector(fleet)
    scheduler = o.selector_labels("RolloutFleet", fleet, build_fleet.SCHEDULER)
    dispatcher = o.selector_labels(
        "SandboxPool", spec.sandbox_pool_ref.name, build_sandbox.DISPATCHER
    )
    every_port = {"ports": o.ALL_TCP}
    scrapers = o.metrics_peers(settings.network_policies.metrics_from)
    api_server = o.api_server_egress(
        settings.network_policies.api_server_peers, settings.network.api_server_port
    )
    return [
        o.network_policy(
            run,
            trainer_name(name),
            TRAINER,
            trainers,
            ingress=[{"from": [o.pods_of(trainers)], **every_port}],
            egress=[{"to": [o.pods_of(trainers)], **every_port}, api_server, o.DNS_EGRESS],
        ),
        o.network_policy(
            run,
            rank0_policy_name(name),
            TRAINER,
            rank0,
            ingress=[
                {"from": [o.pods_of(engines)], **every_port},
                {"from": scrapers, "ports": o.tcp_ports("metrics")},
            ],
            egress=[
                {"to": [o.pods_of(scheduler)], "ports": o.tcp_ports("grpc")},
                {"to": [o.pods_of(dispatcher)], "ports": o.tcp_ports("grpc")},
                {"to": [o.pods_of(engines)], **every_port},
            ],
        ),
    ]


def rbac(run: Mapping[str, Any]) -> list[o.Obj]:
    name = run["metadata"]["name"]
    return o.rbac(run, trainer_name(name), TRAINER, trainer_rules(name))


def auth_name(run: str) -> str:
    """The run's copy of the installation's token (its trainer pods mount it)."""
    return o.child_name(run, "trainer-auth")


def auth(run: Mapping[str, Any], settings: OperatorSettings) -> list[o.Obj]:
    """The run's copy of the installation's token; none without one."""
    token = settings.auth.token
    name = auth_name(run["metadata"]["name"])
    return [o.auth_secret(run, name, TRAINER, token)] if token else []
