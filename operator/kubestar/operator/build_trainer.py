"""Children of a TrainingRun (pure): the run's config (a ConfigMap with run.yaml), a service
account with a Role that may only read its own TrainingRun and patch that run's status, and
the trainer workload: a Job with one pod (local Ray) or, with several workers, a KubeRay
RayJob. See kubestar.api.trainer_contract for what the trainer receives."""

from __future__ import annotations

import json
from collections.abc import Mapping
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
RAY_GROUP = "ray.io"


def trainer_name(run: str) -> str:
    return o.child_name(run, "trainer")


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
    name = run["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": o.metadata(run, trainer_name(name), TRAINER),
        }
    )


def role(run: Mapping[str, Any]) -> o.Obj:
    """May read its own TrainingRun and patch its status: resourceNames pins the run."""
    name = run["metadata"]["name"]
    return o.with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": o.metadata(run, trainer_name(name), TRAINER),
            "rules": [
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
            ],
        }
    )


def role_binding(run: Mapping[str, Any]) -> o.Obj:
    meta = run["metadata"]
    name = trainer_name(meta["name"])
    return o.with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": o.metadata(run, name, TRAINER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": name,
                    "namespace": meta.get("namespace", "default"),
                }
            ],
        }
    )


def shares_checkpoints(spec: TrainingRunSpec, settings: OperatorSettings) -> bool:
    """The run checkpoints to the volume its fleet's engines mount (not to its own PVC)."""
    return settings.trainer.shared_checkpoints.enabled and not spec.checkpoint.pvc_claim_name


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


def trainer_env(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
    ray_address: str = "",
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
        c.ENV_RAY_ADDRESS: ray_address or spec.trainer.ray_address,
        c.ENV_WORKERS: str(spec.trainer.workers),
        "PYTHONUNBUFFERED": "1",
        "HOME": "/tmp",
    }
    if settings.network.loopback_only and not (ray_address or spec.trainer.ray_address):
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
    if shares_checkpoints(spec, settings):
        mount_path = settings.trainer.checkpoint_dir
        checkpoints: o.Obj = settings.trainer.shared_checkpoints.volume("checkpoints")
    else:
        mount_path = env[c.ENV_CHECKPOINT_DIR]
        checkpoints = {
            "name": "checkpoints",
            **(
                {"persistentVolumeClaim": {"claimName": spec.checkpoint.pvc_claim_name}}
                if spec.checkpoint.pvc_claim_name
                else {"emptyDir": {}}
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
            {"name": "checkpoints", "mountPath": mount_path},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.trainer.data_pvc_claim_name:
        container["volumeMounts"].append(
            {"name": "data", "mountPath": spec.trainer.data_mount_path, "readOnly": True}
        )
    uid = settings.trainer.run_as_user
    pod: o.Obj = {
        "serviceAccountName": trainer_name(name),
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "fsGroup": uid},
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
    if settings.network.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod


TRAIN_COMMAND = ["kubestar", "train", "-f", c.RUN_CONFIG, "--in-cluster"]


def job(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
) -> o.Obj:
    """One trainer pod (local Ray). A failed pod fails the Job after backoffLimit retries."""
    name = run["metadata"]["name"]
    env = trainer_env(run, spec, fleet, pool, settings)
    pod = _pod_spec(run, spec, settings, env, TRAIN_COMMAND)
    pod["restartPolicy"] = "Never"
    return o.with_hash(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": o.metadata(run, trainer_name(name), TRAINER),
            "spec": {
                "backoffLimit": settings.trainer.backoff_limit,
                "template": {
                    "metadata": {"labels": o.labels("TrainingRun", name, TRAINER)},
                    "spec": pod,
                },
            },
        }
    )


def ray_job(
    run: Mapping[str, Any],
    spec: TrainingRunSpec,
    fleet: RolloutFleetSpec,
    pool: SandboxPoolSpec,
    settings: OperatorSettings,
    ray_version: str = "v1",
) -> o.Obj:
    """Several trainer workers: a KubeRay RayJob (head + workers-1 worker pods); the
    entrypoint runs on the Ray cluster and joins it (KUBESTAR_RAY_ADDRESS=auto)."""
    name = run["metadata"]["name"]
    env = trainer_env(run, spec, fleet, pool, settings, ray_address="auto")
    head = _pod_spec(run, spec, settings, env, [])
    head["containers"][0].pop("command")
    head["containers"][0]["name"] = "ray-head"
    worker = _pod_spec(run, spec, settings, env, [])
    worker["containers"][0].pop("command")
    worker["containers"][0]["name"] = "ray-worker"
    labels = o.labels("TrainingRun", name, TRAINER)
    replicas = spec.trainer.workers - 1
    return o.with_hash(
        {
            "apiVersion": f"{RAY_GROUP}/{ray_version}",
            "kind": "RayJob",
            "metadata": o.metadata(run, trainer_name(name), TRAINER),
            "spec": {
                "entrypoint": " ".join(TRAIN_COMMAND),
                "shutdownAfterJobFinishes": True,
                "rayClusterSpec": {
                    "headGroupSpec": {
                        "rayStartParams": {"dashboard-host": settings.network.bind_address},
                        "template": {"metadata": {"labels": labels}, "spec": head},
                    },
                    "workerGroupSpecs": [
                        {
                            "groupName": "trainer",
                            "replicas": replicas,
                            "minReplicas": replicas,
                            "maxReplicas": replicas,
                            "rayStartParams": {},
                            "template": {"metadata": {"labels": labels}, "spec": worker},
                        }
                    ],
                },
            },
        }
    )


def rbac(run: Mapping[str, Any]) -> list[o.Obj]:
    return [service_account(run), role(run), role_binding(run)]
