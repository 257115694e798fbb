"""kubestar.dev/v1alpha1 types: SandboxPool, RolloutFleet, TrainingRun.

One source of truth: the operator reconciles these, `kubestar train -f` runs them on one
machine, and the CRD schemas in helm/kubestar/crds are generated from them
(`kubestar.api.crds`), descriptions included: each field's `description` is what
`kubectl explain` prints, so it is written for the person who fills the field in. Field names
are camelCase on the wire; unknown fields are errors, so a typo is reported with its path
instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from kubestar.api.conditions import Condition, Phase
from kubestar.api.errors import KubestarError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

GROUP = "kubestar.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Where a model's claim (model.pvcClaimName) is mounted, read-only, in the pods that read it.
MODEL_MOUNT = "/models"
# The model the images carry and a ModelSource that names none runs
# (kubestar.engine.models.DEFAULT_MODEL, the same name).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Trajectories rolled out per kept one under grpo-roc, unless algorithm.oversampleFactor says.
ROC_OVERSAMPLE_FACTOR = 2.0


class Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# As in a Pod's resources; the CRD types it int-or-string ("500m", "64Gi", 8).
Quantity = str | int


class ResourceRequirements(Spec):
    """Compute resources of a container, as in a Pod, e.g.
    {"limits": {"amd.com/gpu": 8, "memory": "64Gi"}}."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="The least of each resource the scheduler must find on a node, by "
        'resource name, e.g. {"cpu": "4", "memory": "16Gi"}. Empty: nothing reserved.',
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="The most of each resource the container may use, by resource name, e.g. "
        '{"memory": "64Gi", "amd.com/gpu": 8}. Accelerators are requested here.',
    )


class ObjectReference(Spec):
    """Another kubestar resource in the same namespace, by name."""

    name: str = Field(
        min_length=1, max_length=253, description="metadata.name of the referenced resource."
    )


# --- Pod overrides (every kind) ----------------------------------------------------------

# Label keys kubestar sets on its pods (selectors, ownership); annotations and labels under
# this prefix are kubestar's too. A podOverrides that names one is refused.
KUBESTAR_LABEL_KEYS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)
KUBESTAR_KEY_PREFIX = "kubestar.dev/"
# Environment kubestar's own wiring depends on (its contract with the trainer, the engines'
# GPU check, the rendezvous, the non-root runtime, the devices the device plugin gives):
# podOverrides.env may not set these, nor any name starting with KUBESTAR_.
RESERVED_ENV = frozenset(
    {
        "HOME",
        "USER",
        "LOGNAME",
        "PYTHONPATH",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "HF_HUB_OFFLINE",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "POD_UID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
    }
)
RESERVED_ENV_PREFIX = "KUBESTAR_"


class Toleration(Spec):
    """A taint the pods tolerate, as in a Pod."""

    key: str = Field("", description="The taint's key; empty with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", description="Exists: any value of the key. Equal: the value below."
    )
    value: str = Field("", description="The taint's value, for operator Equal.")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        "", description="The taint's effect to tolerate; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        description="NoExecute only: how long a pod stays on a node after the taint appears.",
    )


class KeyReference(Spec):
    """A key of a Secret or ConfigMap in the resource's own namespace."""

    name: str = Field(min_length=1, max_length=253, description="The Secret's or ConfigMap's name.")
    key: str = Field(min_length=1, description="The key whose value the variable takes.")
    optional: bool | None = Field(None, description="Whether the key may be missing.")


class FieldReference(Spec):
    """A field of the pod, as in a Pod's env (metadata.name, status.podIP, ...)."""

    field_path: str = Field(min_length=1, description="The pod's field, e.g. status.hostIP.")


class ResourceFieldReference(Spec):
    """A resource of the container, as in a Pod's env (limits.memory, requests.cpu)."""

    resource: str = Field(min_length=1, description="e.g. limits.memory.")
    divisor: Quantity | None = Field(None, description="The unit, e.g. 1Mi.")


class EnvVarSource(Spec):
    """Where a variable's value comes from: exactly one of these."""

    secret_key_ref: KeyReference | None = Field(None, description="A key of a Secret.")
    config_map_key_ref: KeyReference | None = Field(None, description="A key of a ConfigMap.")
    field_ref: FieldReference | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldReference | None = Field(
        None, description="A resource of the container."
    )

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        set_ = [name for name, value in self if value is not None]
        if len(set_) != 1:
            raise ValueError(
                "set exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef"
            )
        return self


class EnvVar(Spec):
    """An environment variable, as in a Pod: a value, or valueFrom."""

    name: str = Field(
        min_length=1,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="The variable's name.",
    )
    value: str | None = Field(None, description="Its value.")
    value_from: EnvVarSource | None = Field(None, description="Where its value comes from.")

    @model_validator(mode="after")
    def _one(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: set exactly one of value and valueFrom")
        return self


class LocalObjectReference(Spec):
    """An object of the resource's own namespace, by name."""

    name: str = Field(min_length=1, max_length=253, description="The object's name.")


class PodOverrides(Spec):
    """Placement and runtime settings merged into the pods kubestar builds for one component,
    as Kubeflow Trainer's podTemplateOverrides and KubeRay's pod templates give them: added to
    what kubestar sets, never replacing its command, probes, volumes or security context.
    What would break tenancy (host paths, privileges, host namespaces, capabilities, another
    service account, a runtime class) is not here; kubestar's own label keys and environment
    variables are refused."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods must be scheduled on, e.g. "
        '{"node.kubernetes.io/instance-type": "mi300x"}; added to kubestar\'s.',
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Taints the pods tolerate, added to kubestar's (GPU pods already tolerate "
        "their accelerator's taint).",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="The pods' affinity as in a Pod: nodeAffinity, podAffinity, podAntiAffinity.",
    )
    priority_class_name: str = Field(
        "", description="PriorityClass of the pods (preemption, a queue's priority)."
    )
    scheduler_name: str = Field(
        "", description="The scheduler that places the pods, e.g. volcano. Empty: the default."
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the pods, e.g. Kueue's kueue.x-k8s.io/queue-name; kubestar's "
        "own keys (app.kubernetes.io/name, instance, component, managed-by, kubestar.dev/*) "
        "are refused.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations of the pods; kubestar.dev/* keys are refused.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment variables of the pods' containers (e.g. NCCL_SOCKET_IFNAME, "
        "NCCL_IB_HCA); a name kubestar also sets takes this value. Names starting with "
        "KUBESTAR_ and those kubestar's wiring needs (HOME, USER, LOGNAME, PYTHONPATH, "
        "TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, HF_HUB_OFFLINE, KUBERNETES_SERVICE_HOST/"
        "PORT, POD_UID, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, "
        "CUDA/HIP/ROCR_VISIBLE_DEVICES) are refused.",
    )
    supplemental_groups: list[int] = Field(
        default_factory=list,
        description="Groups the pods' processes also belong to (e.g. the node's render group "
        "for ROCm devices), added to kubestar's.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        description="Secrets of the namespace to pull the images with, added to the chart's "
        "images.pullSecrets.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Extra resources of the pods' main container, e.g. "
        '{"limits": {"rdma/rdma_shared_device_a": 1}}; a name kubestar also sets takes this '
        "value. GPUs (*/gpu) are refused: they come from the resource's own fields.",
    )

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key in labels:
            if key in KUBESTAR_LABEL_KEYS or key.startswith(KUBESTAR_KEY_PREFIX):
                raise ValueError(f"{key} is a label kubestar sets and selects its pods by")
        return labels

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str]) -> dict[str, str]:
        for key in annotations:
            if key.startswith(KUBESTAR_KEY_PREFIX):
                raise ValueError(f"{key} is an annotation kubestar sets")
        return annotations

    @field_validator("env")
    @classmethod
    def _env(cls, env: list[EnvVar]) -> list[EnvVar]:
        for var in env:
            if var.name in RESERVED_ENV or var.name.startswith(RESERVED_ENV_PREFIX):
                raise ValueError(f"{var.name} is set by kubestar (reserved)")
        names = [var.name for var in env]
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names}")
        return env

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, affinity: dict[str, Any]) -> dict[str, Any]:
        unknown = set(affinity) - {"nodeAffinity", "podAffinity", "podAntiAffinity"}
        if unknown:
            raise ValueError(
                f"{sorted(unknown)}: an affinity has nodeAffinity, podAffinity and "
                "podAntiAffinity only"
            )
        return affinity

    @field_validator("resources")
    @classmethod
    def _no_gpus(cls, resources: ResourceRequirements) -> ResourceRequirements:
        for section in (resources.requests, resources.limits):
            for name in section:
                if name.endswith("/gpu"):
                    raise ValueError(
                        f"{name}: GPUs come from the resource's own resources (and a fleet's "
                        "engine.tensorParallelSize), not from podOverrides"
                    )
        return resources


class SandboxPoolPodOverrides(Spec):
    """Pod overrides of a SandboxPool's components."""

    worker: PodOverrides | None = Field(None, description="The sandbox worker pods.")
    dispatcher: PodOverrides | None = Field(None, description="The dispatcher's pod.")


class RolloutFleetPodOverrides(Spec):
    """Pod overrides of a RolloutFleet's components."""

    engine: PodOverrides | None = Field(None, description="The engine pods.")
    scheduler: PodOverrides | None = Field(None, description="The rollout scheduler's pod.")


class TrainingRunPodOverrides(Spec):
    """Pod overrides of a TrainingRun's components."""

    trainer: PodOverrides | None = Field(None, description="Every trainer pod (all workers).")


# --- SandboxPool -------------------------------------------------------------------------


class CallLimitsSpec(Spec):
    """Limits of each tool call: time, memory and output."""

    timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=300,
        description="Wall-clock seconds a call may run before it is killed and reported as a "
        "timeout to the model.",
    )
    memory_mib: int = Field(
        512,
        ge=16,
        # The sandbox's ceiling (kubestar.sandbox.limits.LimitPolicy): a worker refuses to
        # start with a default above it.
        le=8192,
        description="Memory a call may allocate, in MiB; beyond it the call fails with a "
        "MemoryError.",
    )
    output_bytes: int = Field(
        65536,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Bytes a call may write to stdout, and to stderr; output beyond it is cut "
        "and the call is reported as over its output limit.",
    )


class SandboxPoolSpec(Spec):
    """Desired state of a SandboxPool: how many sandbox workers run, how many Python
    executors each keeps warm, and what one tool call may use."""

    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Number of sandbox worker pods. 0 stops the pool (its Ready condition "
        "says NoReplicas). `kubectl scale` changes it.",
    )
    executors_per_pod: int = Field(
        4,
        ge=1,
        le=256,
        description="Pre-started Python executors in each worker pod: the calls one pod runs "
        "at the same time. The pool's capacity is ready workers x executorsPerPod.",
    )
    limits: CallLimitsSpec = Field(
        default_factory=CallLimitsSpec,
        description="Limits of each tool call: wall-clock time, memory and output size.",
    )
    preload: list[str] = Field(
        default_factory=lambda: ["numpy", "sympy"],
        description="Python modules each executor imports before its first call, so that "
        "calls using them start at once. Modules must be installed in the sandbox image.",
    )
    queue_timeout_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a call may wait for a free executor when all are busy before it "
        "fails with a queue timeout.",
    )
    image: str = Field(
        "",
        description="Container image of the sandbox workers and dispatcher. Empty: the "
        "chart's kubestar image (images.kubestar in the Helm values).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Compute resources of each worker pod's sandbox container. Empty: the "
        "chart's defaults.",
    )
    runtime_class_name: str | None = Field(
        None,
        description="RuntimeClass of the worker pods, e.g. gvisor (runsc) or kata for "
        "kernel-level isolation of untrusted code in production. Unset: the cluster's default "
        "runtime.",
    )
    isolation: Literal["Required", "Disabled"] = Field(
        "Required",
        description="Whether workers must isolate every call: network, mount, PID, IPC and "
        "UTS namespaces of its own and kubestar's syscall filter. Required: a worker that "
        "cannot (a capability the container lacks, a namespace the node or the seccomp "
        "profile refuses) does not start, and the Ready condition says IsolationUnavailable, "
        "naming what is missing, the system call that failed and why; how workers get the "
        "namespaces is the chart's sandbox.isolationMechanism. Disabled: calls run without "
        "namespaces or filter and can reach the pod's network; for development only.",
    )
    port: int = Field(
        50051,
        ge=1,
        le=65535,
        description="TCP port of the dispatcher's gRPC service (status.endpoint).",
    )
    http_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the dispatcher's HTTP APIs in the dialects verl and "
        "rStar2-Agent call (SandboxFusion's /run_code, code-judge's /run/long-batch; "
        "status.httpEndpoint): the same workers, limits, isolation and token. 0: off.",
    )
    pod_overrides: SandboxPoolPodOverrides | None = Field(
        None,
        description="Placement and runtime settings (nodeSelector, tolerations, affinity, "
        "priorityClassName, schedulerName, labels, annotations, env, supplementalGroups, "
        "imagePullSecrets, extra resources) merged into the worker and dispatcher pods.",
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> SandboxPoolSpec:
        if self.http_port and self.http_port == self.port:
            raise ValueError("httpPort must differ from port (the dispatcher's gRPC port)")
        return self


# --- RolloutFleet ------------------------------------------------------------------------


class ModelSource(Spec):
    """Where a model's weights come from: a name embedded in the image, a folder in the image
    or on the node, or a PersistentVolumeClaim. The first that is set wins, in the order
    pvcClaimName, path, name."""

    name: str = Field(
        "",
        description=f"A model name the images carry ({DEFAULT_MODEL_NAME}, or "
        "tiny-random-llama for tests), used when neither path nor pvcClaimName is set; empty: "
        f"{DEFAULT_MODEL_NAME}. A RolloutFleet's OpenAI-compatible API also serves its model "
        "under this name (empty: the model's location). Models are never downloaded.",
    )
    path: str | None = Field(
        None,
        description="A folder in the container holding a Hugging Face model (config.json, "
        "tokenizer and safetensors weights).",
    )
    pvc_claim_name: str | None = Field(
        None,
        description=f"A PersistentVolumeClaim holding the model, mounted read-only at "
        f"{MODEL_MOUNT} in the pods that read it (engines, the scheduler's OpenAI front, the "
        "trainer); takes precedence over path and name. A local run (`kubestar train -f`) "
        "cannot mount it and uses path instead.",
    )
    pvc_sub_path: str = Field(
        "",
        description="The model's folder inside the PersistentVolumeClaim. Empty: its root.",
    )

    def location(self) -> str:
        """The model as a pod finds it: the claim's folder, else `local_location`."""
        if self.pvc_claim_name:
            return f"{MODEL_MOUNT}/{self.pvc_sub_path}".rstrip("/")
        return self.local_location()

    def local_location(self) -> str:
        """The model as a local run finds it (it mounts no claim): path, else the name."""
        return self.path or self.name or DEFAULT_MODEL_NAME


class EngineSpec(Spec):
    """The vLLM engine each replica of the fleet runs."""

    image: str = Field(
        "",
        description="Container image of the engines. Empty: the chart's image for the "
        "fleet's accelerator (images.engineRocm, engineCuda or engineCpu in the Helm values).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs one engine shards the model over (vLLM --tensor-parallel-size); "
        "each engine pod requests this many GPUs unless resources.limits says otherwise.",
    )
    max_model_len: int = Field(
        4096,
        ge=128,
        le=1_048_576,
        description="The longest context in tokens, prompt and response together (vLLM "
        "--max-model-len). Must hold the longest stage's maxResponseTokens plus the prompt.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory vLLM may use for weights, activations and "
        "KV cache (vLLM --gpu-memory-utilization).",
    )
    kv_cache_bytes: int = Field(
        0,
        ge=0,
        description="A fixed KV cache size in bytes per engine. 0: vLLM sizes it from "
        "gpuMemoryUtilization.",
    )
    max_num_seqs: int = Field(
        64,
        ge=1,
        le=4096,
        description="The most sequences an engine decodes at once (vLLM --max-num-seqs).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More vLLM command-line arguments, passed as given, e.g. "
        '["--enable-prefix-caching"].',
    )
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="TCP port of each engine's OpenAI-compatible HTTP server.",
    )


class SchedulerSpec(Spec):
    """The rollout scheduler in front of the engines: it places each request on an engine."""

    policy: Literal["kv-aware", "least-requests", "round-robin"] = Field(
        "kv-aware",
        description="How requests are placed: kv-aware admits a request only where its KV "
        "cache fits and keeps a trajectory's turns on the engine that holds its prefix while "
        "it has room; "
        "least-requests picks the engine with the fewest requests in flight; round-robin "
        "takes engines in turn.",
    )
    metrics_interval_seconds: float = Field(
        0.2,
        gt=0,
        le=60,
        description="How often the scheduler reads each engine's /metrics (KV usage, queue "
        "lengths), in seconds.",
    )
    segment_tokens: int = Field(
        256,
        ge=0,
        le=1_048_576,
        description="kv-aware only: the most new tokens one admission reserves KV room for; "
        "longer turns run in segments of this size on the same engine. 0: reserve room for "
        "the whole turn at once.",
    )
    port: int = Field(
        50061,
        ge=1,
        le=65535,
        description="TCP port of the scheduler's gRPC service (status.schedulerEndpoint).",
    )
    weights_reload_timeout_seconds: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="An engine that has not loaded a step's new weights after this many "
        "seconds is taken out (named in the fleet's Ready condition) and loads them when it "
        "comes back; the other engines go on with the new weights.",
    )
    openai_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the scheduler's OpenAI-compatible API (/v1/models, "
        "/v1/completions, /v1/chat/completions, status.openaiEndpoint): an OpenAI client or "
        "verl's agent loop uses the fleet as one endpoint, through the same scheduling. The "
        "X-Session-ID header (or the user field) keeps a session on one engine. 0: off.",
    )


class AutoscalingSpec(Spec):
    """Engines added and removed by the rollout load, as a HorizontalPodAutoscaler would: the
    operator sets spec.replicas (through the scale subresource) to
    ceil(replicas x value / target), within minReplicas and maxReplicas."""

    min_replicas: int = Field(1, ge=1, le=1024, description="The fewest engines.")
    max_replicas: int = Field(ge=1, le=1024, description="The most engines.")
    metric: Literal["queuedTurns", "kvUsage"] = Field(
        "queuedTurns",
        description="What the fleet is scaled by, as its scheduler reports it: queuedTurns, "
        "the turns waiting for KV room per ready engine; kvUsage, the mean fraction of the "
        "engines' KV cache in use (0 to 1).",
    )
    target: float = Field(
        gt=0,
        le=1_000_000,
        description="The metric's value the fleet is sized for: more engines above it, fewer "
        "below it (within a tolerance of 10 %). kvUsage: at most 1.",
    )
    scale_down_delay_seconds: int = Field(
        120,
        ge=0,
        le=86400,
        description="How long the metric must stay below the target before engines are "
        "removed (scale-ups are at once): a rollout's lull between two steps, while the "
        "trainer trains, removes none.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas "
                f"({self.max_replicas})"
            )
        if self.metric == "kvUsage" and self.target > 1:
            raise ValueError(f"target ({self.target:g}) must be at most 1 for metric kvUsage")
        return self


class RolloutFleetSpec(Spec):
    """Desired state of a RolloutFleet: vLLM engines serving the policy model, and the
    scheduler that spreads rollout requests over them."""

    model: ModelSource = Field(
        default_factory=ModelSource,
        description="The model the engines serve before the trainer pushes its first weights.",
    )
    replicas: int = Field(
        1,
        ge=0,
        le=1024,
        description="Number of engine pods. 0 stops the fleet. `kubectl scale` (the scale "
        "subresource, which a HorizontalPodAutoscaler drives too) changes it; with "
        "autoscaling set, the operator does.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Scale the engines by the rollout load (the scheduler's queue or KV "
        "use). A joining engine loads the current weights before it takes a turn; a leaving "
        "one takes no new turn and its turns in flight finish on the others. Unset: "
        "replicas stays as set.",
    )
    accelerator: Literal["amd", "nvidia", "cpu"] = Field(
        "cpu",
        description="What the engines run on: amd requests amd.com/gpu on ROCm nodes, nvidia "
        "requests nvidia.com/gpu, cpu runs vLLM's CPU build. Unset on a cluster: the chart's "
        "accelerator.vendor; unset in a local run: cpu.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        description="The vLLM engine settings: image, parallelism, context length, memory.",
    )
    scheduler: SchedulerSpec = Field(
        default_factory=SchedulerSpec,
        description="The rollout scheduler's placement policy and its knobs.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Compute resources of each engine pod. The accelerator's GPU resource is "
        "added with engine.tensorParallelSize when limits do not name it.",
    )
    weight_sync: Literal["broadcast", "volume"] = Field(
        "broadcast",
        description="How the engines get a trainer's new weights after each step. broadcast: "
        "the trainer sends them in bf16 buckets over a process group it makes with the "
        "engines (NCCL between GPUs, else gloo), straight into their memory; nothing is "
        "shared but the network. volume: the engines read the folder the trainer writes on "
        "the chart's shared checkpoint volume (trainer.sharedCheckpoints), which they mount.",
    )
    pod_overrides: RolloutFleetPodOverrides | None = Field(
        None,
        description="Placement and runtime settings (nodeSelector, tolerations, affinity, "
        "priorityClassName, schedulerName, labels, annotations, env, supplementalGroups, "
        "imagePullSecrets, extra resources, e.g. RDMA devices) merged into the engine and "
        "scheduler pods.",
    )


# --- TrainingRun -------------------------------------------------------------------------


class AlgorithmSpec(Spec):
    """The RL algorithm and its hyperparameters (GRPO-RoC, as in rStar2-Agent)."""

    name: Literal["grpo-roc", "grpo"] = Field(
        "grpo-roc",
        description="grpo-roc: GRPO with Resample-on-Correct (roll out groupSize x "
        "oversampleFactor trajectories per problem and keep groupSize of them: correct ones "
        "favouring few tool errors and format issues, incorrect ones at random). grpo: plain "
        "GRPO, no oversampling.",
    )
    group_size: int = Field(
        16,
        ge=2,
        le=1024,
        description="Trajectories per problem that enter the update (G); advantages are "
        "rewards normalised within the group.",
    )
    oversample_factor: float | None = Field(
        None,
        ge=1.0,
        le=16.0,
        description="grpo-roc only (refused under grpo): roll out groupSize x "
        "oversampleFactor trajectories per problem, then resample down to groupSize. Unset: "
        f"{ROC_OVERSAMPLE_FACTOR:g}, the paper's.",
    )
    clip_low: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Lower clip range of the policy ratio: the ratio is clipped at 1 - clipLow.",
    )
    clip_high: float = Field(
        0.28,
        ge=0,
        le=10,
        description="Upper clip range of the policy ratio (clip-higher): the ratio is clipped "
        "at 1 + clipHigh, above clipLow so that unlikely good tokens can grow.",
    )
    learning_rate: float = Field(
        1e-6,
        gt=0,
        le=1,
        description="AdamW learning rate of the RL stages.",
    )
    updates_per_step: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer steps per RL step: the step's kept trajectories are split into "
        "this many mini-batches (verl's train_batch_size / ppo_mini_batch_size). The published "
        "rStar2-Agent recipe takes 1 (both 128). Above 1, the later mini-batches are trained "
        "on weights that already moved: the ratio leaves 1 and clipLow/clipHigh bite "
        "(train_clip_fraction in the metrics).",
    )
    tis_cap: float | None = Field(
        None,
        gt=1,
        le=100,
        description="Off-policy correction for the engine/trainer mismatch (the engine samples "
        "in bf16 with its own kernels): token-level truncated importance sampling, each "
        "token's loss weighted by min(p_trainer / p_engine, tisCap) from the engine's sampling "
        "log-probabilities (verl's tis_imp_ratio_cap). Unset: off. The gap is logged either "
        "way (engine_logprob_gap).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="Rollouts ahead of training: 0 (the paper's loop) rolls a step out, then "
        "trains on it while the engines idle. k > 0 starts the rollouts of the next k steps "
        "as soon as a step's are collected, so the engines roll out while the trainer trains; "
        "new weights are pushed as they are made, each token records the weights that "
        "sampled it, a token at most k versions behind the trained weights enters an update "
        "(older trajectories are dropped), and tisCap, required here, corrects each token by "
        "the logprobs of the weights that sampled it. Each stage starts in step.",
    )
    max_turns: int = Field(
        10,
        ge=1,
        le=1000,
        description="The most assistant turns in one trajectory; each turn may make a tool "
        "call whose output the next turn reads.",
    )
    positive_selection: Literal["inverse-penalty", "lowest-penalty"] | None = Field(
        None,
        description="grpo-roc only (refused under grpo): how correct trajectories are kept. "
        "inverse-penalty (the default) samples them with weights that fall as tool errors "
        "and format issues rise; lowest-penalty keeps those with the fewest.",
    )
    temperature: float = Field(
        1.0,
        ge=0,
        le=5,
        description="Sampling temperature of training rollouts (evaluation has its own, "
        "evaluation.temperature).",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling of training rollouts: sample from the smallest set of "
        "tokens whose probability reaches topP. 1: no truncation.",
    )

    @model_validator(mode="after")
    def _staleness_needs_correction(self) -> AlgorithmSpec:
        if self.max_staleness and self.tis_cap is None:
            raise ValueError(
                f"maxStaleness ({self.max_staleness}) needs tisCap: tokens sampled from older "
                "weights are corrected by truncated importance sampling (e.g. tisCap: 2)"
            )
        return self

    @model_validator(mode="after")
    def _roc_fields_need_roc(self) -> AlgorithmSpec:
        if self.name == "grpo":
            for key, value in (
                ("oversampleFactor", self.oversample_factor),
                ("positiveSelection", self.positive_selection),
            ):
                if value is not None:
                    raise ValueError(
                        f"{key}: only grpo-roc oversamples and resamples; remove it or set "
                        "name: grpo-roc"
                    )
        return self

    @property
    def rollouts_oversample_factor(self) -> float:
        """Trajectories rolled out per kept one: oversampleFactor under grpo-roc, else 1."""
        if self.name != "grpo-roc":
            return 1.0
        return ROC_OVERSAMPLE_FACTOR if self.oversample_factor is None else self.oversample_factor


class DatasetMixEntry(Spec):
    """One reasoning-gym generator of a mixed dataset and its share."""

    generator: str = Field(
        min_length=1,
        description="A reasoning-gym generator, optionally with its config as "
        "name:key=value,... (e.g. leg_counting:max_animals=4).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="This generator's share of the dataset's size, relative to the others'.",
    )


class DatasetSpec(Spec):
    """A set of problems with reference answers: a reasoning-gym generator, a mix of them, or
    a file in a published format. Exactly one of generator, mix and path is set."""

    generator: str | None = Field(
        None,
        description="A reasoning-gym generator that makes the problems, e.g. "
        "basic_arithmetic, chain_sum, gcd; optionally with its config as name:key=value,... "
        "(e.g. basic_arithmetic:min_terms=3,max_terms=5).",
    )
    mix: list[DatasetMixEntry] | None = Field(
        None,
        min_length=1,
        description="Several reasoning-gym generators in one dataset: size problems shared "
        "out by weight, each generator seeded with seed, shuffled together. Evaluation "
        "reports accuracy per generator.",
    )
    path: str | None = Field(
        None,
        description="A file of problems in the trainer's container (e.g. on "
        "trainer.dataPvcClaimName, mounted at trainer.dataMountPath).",
    )
    format: Literal["jsonl", "dapo", "aime"] = Field(
        "jsonl",
        description="The file's layout. jsonl: JSON lines with a question (question, "
        "problem, prompt or query) and an answer (answer, final_answer, ground_truth, "
        "solution, target or reward_model.ground_truth), an optional id. dapo: DAPO-Math-17k "
        "as published (parquet, JSON lines or a JSON array): the problem is prompt's user "
        "message without DAPO's instruction, the answer reward_model.ground_truth, the id "
        "extra_info.index; a repeated problem is read once. aime: AIME sets as published "
        "(parquet, JSON lines, a JSON array or CSV; keys in any case): problem or question, "
        "answer, and id or problem_idx. A file that does not match is refused, naming the "
        "record and the missing field. Ignored for a generator.",
    )
    size: int = Field(
        1000,
        ge=1,
        description="The number of problems: how many the generator makes, or the first that "
        "many of the file.",
    )
    seed: int = Field(
        0,
        description="Seed of the problems and of their order. A generator or mix makes the "
        "same problems from the same seed; a stage draws its problems (generated or from a "
        "file) in an order shuffled with this seed and the stage's name, a new shuffle each "
        "pass. Evaluation takes every problem, so the order does not matter there.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if sum(source is not None for source in (self.generator, self.mix, self.path)) != 1:
            raise ValueError("set exactly one of generator, mix or path")
        return self


class SftDatasetSpec(Spec):
    """The user's own SFT conversations: JSON lines, each {"messages": [...]} as TRL's
    SFTTrainer and verl's multi-turn SFT read them (roles system, user, assistant, tool; an
    assistant message may carry OpenAI-style tool_calls of the python tool). They are
    rendered in kubestar's tool-call format; the loss is on the assistant's turns only."""

    path: str = Field(
        min_length=1,
        description="A JSONL file of conversations in the trainer's container (e.g. on "
        "trainer.dataPvcClaimName, mounted at trainer.dataMountPath).",
    )


class SftSpec(Spec):
    """Non-reasoning SFT before RL: teaches instruction following and the tool-call format,
    not reasoning. It trains on small examples made with the real sandbox, or on the
    conversations of dataset when it is set."""

    enabled: bool = Field(True, description="Whether the SFT stage runs.")
    dataset: SftDatasetSpec | None = Field(
        None,
        description="A file of the user's own conversations to train on instead of the "
        "examples kubestar makes. Unset: examples are made with the real sandbox.",
    )
    examples: int | None = Field(
        None,
        ge=1,
        description="Number of examples trained on. Unset: 256 made examples, or every "
        "conversation of dataset; with dataset, its first this many that fit maxTokens.",
    )
    epochs: int = Field(1, ge=1, le=100, description="Passes over the examples.")
    learning_rate: float = Field(
        1e-5,
        gt=0,
        le=1,
        description="AdamW learning rate of the SFT stage (RL's optimizer is restored after).",
    )
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step.")
    max_tokens: int = Field(
        1024,
        ge=64,
        description="The longest example in tokens, prompt included; longer ones (made or in "
        "dataset) are dropped (under about 400 with SmolLM2's tokenizer, no made example is "
        "left).",
    )


class StageFilterSpec(Spec):
    """Which problems of its dataset a stage keeps, judged by the policy at the stage's
    start."""

    drop_solved_k_of_k: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Sample each problem k times with the current policy and drop those it "
        "solved every time, evaluating problems in the stage's order until steps x "
        "problemsPerStep are kept or none is left. status.stageFilters says how many were "
        "evaluated and kept; a stage left with fewer than problemsPerStep fails the run "
        "(reason TooFewProblems). Unset: keep every problem.",
    )


class StageSpec(Spec):
    """One RL stage: a dataset, a response length budget and a number of steps. Stages run in
    order, each from the policy the previous one left."""

    name: str = Field(
        min_length=1,
        max_length=63,
        description="The stage's name, unique in the run; shown in status.stage.",
    )
    max_response_tokens: int = Field(
        ge=16,
        le=1_048_576,
        description="The most tokens one trajectory may generate, over all its turns; one "
        "that reaches it is cut off and, with no final answer, scores 0.",
    )
    steps: int = Field(ge=1, description="Training steps (policy updates) in this stage.")
    problems_per_step: int = Field(
        32,
        ge=1,
        description="Problems per step; each is rolled out groupSize x oversampleFactor times.",
    )
    dataset: DatasetSpec = Field(description="Where the stage's problems come from.")
    filter: StageFilterSpec | None = Field(
        None,
        description="Drops problems the policy already solves before the stage starts. Unset: "
        "every problem is kept.",
    )
    reset_optimizer: bool = Field(
        False,
        description="Start this stage with fresh optimizer state (AdamW moments).",
    )


class TrainerSpec(Spec):
    """The trainer workload: its pods, image and resources."""

    workers: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer pods (one Job each, as Kubeflow's PyTorchJob makes them): "
        "workers x processesPerWorker training processes in one torch.distributed world, the "
        "model, gradients and optimizer state sharded (FSDP2) over all of them. Worker 0's "
        "first process (rank 0) rolls out, reports status and writes the weights. More than 1 "
        "needs a checkpoint volume every pod mounts (the chart's trainer.sharedCheckpoints, "
        "or checkpoint.pvcClaimName on a ReadWriteMany claim): each rank writes its shard.",
    )
    image: str = Field(
        "",
        description="Container image of the trainer. Empty: the chart's kubestar image "
        "(images.kubestar in the Helm values).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Compute resources of each trainer pod, accelerators included.",
    )
    ray_address: str = Field(
        "",
        description="Address of an existing Ray cluster for the rollout workers to join "
        "(ray.init(address)). Empty: a local Ray instance in rank 0's pod.",
    )
    micro_batch_size: int = Field(
        4,
        ge=1,
        description="Trajectories per forward/backward pass; gradients are accumulated over "
        "micro-batches, so it trades memory for speed without changing the update. Ignored "
        "when maxTokensPerMicroBatch is set.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Micro-batches by tokens instead of trajectories; when set it wins over "
        "microBatchSize. Each rank's trajectories are taken longest first, and a "
        "forward/backward pass holds as many as keep (trajectories x its longest, in tokens) "
        "within this budget; a longer trajectory passes alone. Compute and activation memory "
        "then follow the tokens, not the longest trajectory of the batch; the update is the "
        "same (the loss is normalised by the mini-batch's tokens either way).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the trainer computes: cuda (NVIDIA or ROCm GPUs), cpu, or auto (a "
        "GPU when one is visible).",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="What the trainer computes in. bf16: mixed precision (the forward and "
        "backward passes in bf16; master weights, optimizer state and gradient reductions in "
        "fp32), at every world size. fp32: fp32 throughout. auto: bf16 on GPUs, fp32 on CPU "
        "(CPU kernels gain little from bf16).",
    )
    processes_per_worker: int = Field(
        1,
        ge=1,
        le=64,
        description="Training processes per trainer pod, one per accelerator: a pod's "
        "accelerator limit (nvidia.com/gpu, amd.com/gpu) must equal it. `kubestar train -f` "
        "starts all workers x processesPerWorker processes on the local machine.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead "
        "of keeping them: less memory, about a third more compute. The update is the same.",
    )
    data_pvc_claim_name: str | None = Field(
        None,
        description="A PersistentVolumeClaim holding dataset files, mounted read-only at "
        "dataMountPath in the trainer pods.",
    )
    data_mount_path: str = Field(
        "/data",
        description="Where dataPvcClaimName is mounted in the trainer pods.",
    )

    @model_validator(mode="after")
    def _accelerators_per_process(self) -> TrainerSpec:
        for resource, amount in self.resources.limits.items():
            if resource.endswith("/gpu") and str(amount) != str(self.processes_per_worker):
                raise ValueError(
                    f"resources.limits[{resource}] is {amount} but processesPerWorker is "
                    f"{self.processes_per_worker}: each training process drives one "
                    "accelerator; make them equal"
                )
        return self


class CheckpointSpec(Spec):
    """How often the trainer saves checkpoints, how many it keeps and where. A restarted
    trainer resumes from the newest."""

    every_steps: int = Field(1, ge=1, description="Save a checkpoint every this many steps.")
    keep: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    path: str = Field(
        "",
        description="Folder of the checkpoints. Empty: under the run's folder in a local run, "
        "the chart's trainer.checkpointDir on a cluster. With the chart's shared checkpoint "
        "volume (trainer.sharedCheckpoints; optional, since engines take new weights by "
        "broadcast unless their fleet sets weightSync: volume) checkpoints go to "
        "checkpointDir/NAMESPACE/NAME there instead. The trained model is the newest "
        "checkpoint's weights/ folder (status.lastCheckpoint).",
    )
    pvc_claim_name: str | None = Field(
        None,
        description="A PersistentVolumeClaim of the run's own for the checkpoints, mounted at "
        "path in the trainer pods; takes precedence over the shared checkpoint volume.",
    )
    storage: str = Field(
        "50Gi",
        pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$",
        description="Size of the claim the operator makes for the run's checkpoints (RUN-"
        "checkpoints, ReadWriteOnce, deleted with the run) when neither pvcClaimName nor the "
        "chart's shared checkpoint volume is set.",
    )
    storage_class_name: str | None = Field(
        None,
        description="StorageClass of that claim. Unset: the cluster's default class.",
    )
    ephemeral: bool = Field(
        False,
        description="Development only: checkpoints in an emptyDir that dies with the trainer "
        "pod instead of a claim, so a lost pod starts the run over (and is not retried).",
    )

    @model_validator(mode="after")
    def _one_place(self) -> CheckpointSpec:
        if self.ephemeral and self.pvc_claim_name:
            raise ValueError(
                "checkpoint.ephemeral and checkpoint.pvcClaimName: choose one (an emptyDir "
                "for development, or the claim)"
            )
        return self


EvaluationPoint = Literal["start", "sft", "end"]

SearchMode = Literal["mcts", "beam", "majority", "best-of-n", "ppm-vote"]
# The modes whose answers a process preference model chooses.
PPM_SEARCH_MODES: tuple[str, ...] = ("mcts", "beam", "best-of-n", "ppm-vote")
# Each budget field and the modes that spend it, as `kubestar solve`'s budget flags: another
# mode refuses it, since it would change nothing.
SEARCH_BUDGET_FIELDS: dict[str, tuple[str, ...]] = {
    "rollouts": ("mcts",),
    "children": ("mcts",),
    "beams": ("beam",),
    "beam_samples": ("beam",),
    "samples": ("majority", "best-of-n", "ppm-vote"),
}
# An unset budget field's value: rStar-Math's and `kubestar solve`'s defaults.
SEARCH_BUDGET_DEFAULTS: dict[str, int] = {
    "rollouts": 8,
    "children": 16,
    "beams": 8,
    "beam_samples": 8,
    "samples": 8,
}


class SearchEvaluationSpec(Spec):
    """Test-time search on the held-out problems at every evaluation point, beside the sampled
    evaluation: rStar-Math's MCTS or beam search guided by a process preference model
    (PPM), or a vote or best-of-N over sampled solutions, on the run's RolloutFleet and
    SandboxPool (what `kubestar solve` runs). A search's solution may use as many tokens
    after the prompt as the sampled evaluation's (the largest stage maxResponseTokens)."""

    mode: SearchMode = Field(
        description="mcts: rStar-Math's Monte Carlo tree search, valued by the PPM. beam: "
        "step-level beam search ranked by the PPM. majority: the most frequent answer of "
        "samples solutions (no PPM). best-of-n: the answer of the solution the PPM values "
        "highest, of samples. ppm-vote: a vote over samples solutions, each weighted by "
        "its PPM value."
    )
    rollouts: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="mcts only: rollouts per problem (selection, expansion, valuation, "
        "backpropagation). Unset: 8.",
    )
    children: int | None = Field(
        None,
        ge=1,
        le=256,
        description="mcts only: steps sampled per expansion, in one request of that many "
        "samples. Unset: 16.",
    )
    beams: int | None = Field(
        None,
        ge=1,
        le=256,
        description="beam only: beams kept after each step (B1). Unset: 8.",
    )
    beam_samples: int | None = Field(
        None,
        ge=1,
        le=256,
        description="beam only: steps sampled per beam (B2). Unset: 8.",
    )
    samples: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="majority, best-of-n and ppm-vote only: solutions sampled per problem. "
        "Unset: 8.",
    )
    format: Literal["tool-call", "rstar"] = Field(
        "tool-call",
        description="How a step is written: tool-call, one <tool_call> turn (policies trained "
        "by the agent loop, as this run's); rstar, rStar-Math's <code> / <end_of_step> "
        "format.",
    )
    ppm: str | None = Field(
        None,
        min_length=1,
        description="A PPM folder (`kubestar ppm train --out`) the trainer can read, e.g. on "
        "trainer.dataPvcClaimName; loaded in the trainer at each evaluation point. It must "
        "read token ids with the policy's tokenizer. Required by mcts, beam, best-of-n and "
        "ppm-vote.",
    )
    temperature: float = Field(
        0.7,
        gt=0,
        le=5,
        description="Sampling temperature of the search's steps (rStar-Math's 0.7).",
    )
    seed: int = Field(
        1,
        ge=0,
        description="Seed of the search's sampling, so that evaluation points differ by the "
        "policy rather than by chance. 0: unseeded.",
    )

    @model_validator(mode="after")
    def _mode_fields(self) -> SearchEvaluationSpec:
        """Refuse what the mode would not use, and a PPM mode without a PPM; each message
        names the field."""
        for name, modes in SEARCH_BUDGET_FIELDS.items():
            if self.mode not in modes and getattr(self, name) is not None:
                raise ValueError(
                    f"{to_camel(name)}: mode {self.mode} does not use it; it is for "
                    f"{' and '.join(modes)} (unset it)"
                )
        if self.mode in PPM_SEARCH_MODES and self.ppm is None:
            raise ValueError(
                f"ppm: mode {self.mode} needs a process preference model: set ppm to a PPM "
                "folder (`kubestar ppm train`), or choose mode majority"
            )
        if self.mode not in PPM_SEARCH_MODES and self.ppm is not None:
            raise ValueError(f"ppm: mode {self.mode} does not use a PPM (unset it)")
        return self

    def budget(self, name: str) -> int:
        """A budget field's value, or its default when unset (SEARCH_BUDGET_DEFAULTS): the
        field has no schema default, so that a mode never carries another mode's budget."""
        value = getattr(self, name)
        return int(value) if value is not None else SEARCH_BUDGET_DEFAULTS[name]


class EvaluationSpec(Spec):
    """Evaluation of the policy on held-out problems: samples trajectories per problem at
    temperature (avg@k and pass@k, as the paper reports), and optionally test-time search
    (search)."""

    dataset: DatasetSpec | None = Field(
        None, description="The held-out problems. Unset: no evaluation."
    )
    samples: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trajectories per problem (k): accuracy is their mean (avg@k), passAtK the "
        "share of problems with at least one right answer (pass@k). More than 1 needs a "
        "temperature above 0.",
    )
    temperature: float = Field(
        1.0,
        ge=0,
        le=5,
        description="Sampling temperature of the evaluation's trajectories (top-p 1): 1.0 is "
        "the paper's avg@k setting. 0: greedy decoding, with samples 1.",
    )
    at: list[EvaluationPoint] = Field(
        default_factory=lambda: list[EvaluationPoint](["end"]),
        description="When to evaluate: start (the policy before any training, as verl's "
        "val_before_train), sft (right after the SFT stage), end (after the last RL step).",
    )
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also evaluate after every this many RL steps (verl's test_freq), to "
        "see whether the policy drifts during training. Unset: only at the points of at.",
    )
    search: SearchEvaluationSpec | None = Field(
        None,
        description="Also solve the held-out problems by test-time search at each evaluation "
        "point (MCTS or beam search with a PPM, a majority vote, best-of-N), through the "
        "run's scheduler and sandbox; accuracy, generated tokens per problem and seconds go "
        "beside the sampled figures in status.evaluations, metrics.jsonl and the report. "
        "Unset: no search.",
    )

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> EvaluationSpec:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(
                f"samples: {self.samples} greedy trajectories (temperature 0) are all the same; "
                "set samples to 1 or temperature above 0"
            )
        return self

    @model_validator(mode="after")
    def _search_needs_problems(self) -> EvaluationSpec:
        if self.search is not None and self.dataset is None:
            raise ValueError(
                "search: searches the held-out problems, but dataset is unset: set dataset"
            )
        return self


class ResilienceSpec(Spec):
    """What a run does when the infrastructure under it fails (an engine, the rollout
    scheduler or the sandbox), as opposed to the policy."""

    max_infra_failure_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Largest share of a step's trajectories that may be spoiled by an engine, "
        "scheduler or sandbox failure (a generation error, a sandbox internal or "
        "queue-timeout result). Such trajectories are never trained on, whatever their "
        "share; above this share the step is rolled out again instead of trained on.",
    )
    rollout_attempts: int = Field(
        4,
        ge=1,
        le=100,
        description="Rollouts of one step at most: after the last, with too many "
        "trajectories still spoiled, the run fails (reason InfrastructureFailures).",
    )
    retry_backoff_seconds: float = Field(
        30.0,
        ge=0,
        le=600,
        description="Wait before a step is rolled out again or its weights are pushed again, "
        "doubled for each further attempt (at most 10 minutes): time for a restarted pod to "
        "come back. A push is tried again sooner when the scheduler, away after the failed "
        "try, answers again (a replaced pod): for it the wait is the longest.",
    )
    weights_update_seconds: float = Field(
        900.0,
        gt=0,
        le=86400,
        description="Deadline of one push of a step's weights through the rollout scheduler "
        "(every engine reloading them); a push that passes it, or finds the scheduler away, "
        "is tried again.",
    )
    stall_seconds: float = Field(
        3600.0,
        ge=10,
        le=7 * 86400,
        description="When the trainer's current activity (status.activity: a rollout, a "
        "weight push, an update, a checkpoint, an evaluation) has not moved on for this many "
        "seconds, the run's Stalled condition turns True naming the activity and the "
        "component it waits on. Longer than the slowest step.",
    )
    weights_update_attempts: int = Field(
        4,
        ge=1,
        le=100,
        description="Pushes of one step's weights at most; after the last the run fails "
        "(reason InfrastructureFailures). Before each rollout the trainer also checks that "
        "the scheduler still serves the latest weights (a restarted scheduler does not) and "
        "pushes them again if not.",
    )


class TrainingRunSpec(Spec):
    """Desired state of a TrainingRun: the model, the algorithm and the stages to train it
    with, on a RolloutFleet and a SandboxPool in the same namespace."""

    rollout_fleet_ref: ObjectReference = Field(
        description="The RolloutFleet that generates rollouts and receives the new weights "
        "after each step."
    )
    sandbox_pool_ref: ObjectReference = Field(
        description="The SandboxPool that runs the policy's tool calls (Python code)."
    )
    model: ModelSource = Field(
        default_factory=ModelSource,
        description="The model to train; it should be the one the RolloutFleet serves.",
    )
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec,
        description="The RL algorithm (GRPO-RoC by default) and its hyperparameters: group "
        "size, oversampling, clip range, learning rate, turns, sampling.",
    )
    sft: SftSpec | None = Field(
        None,
        description="A non-reasoning SFT stage before RL. Unset: RL starts from the model as "
        "it is.",
    )
    stages: list[StageSpec] = Field(
        min_length=1,
        description="The RL stages, run in order (e.g. a growing maxResponseTokens, as in "
        "rStar2-Agent).",
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec,
        description="The trainer workload: pods, image, resources, device.",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Checkpoint frequency, retention and storage.",
    )
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec,
        description="Held-out evaluation: dataset, samples, and when it runs.",
    )
    resilience: ResilienceSpec = Field(
        default_factory=ResilienceSpec,
        description="What the run does when engines, the scheduler or the sandbox fail: "
        "trajectories they spoil are left out, and a step with too many is rolled out again.",
    )
    pod_overrides: TrainingRunPodOverrides | None = Field(
        None,
        description="Placement and runtime settings (nodeSelector, tolerations, affinity, "
        "priorityClassName, schedulerName, labels and annotations for Kueue or Volcano, env, "
        "supplementalGroups, imagePullSecrets, extra resources, e.g. RDMA devices) merged into "
        "every trainer pod.",
    )

    @model_validator(mode="after")
    def _unique_stage_names(self) -> TrainingRunSpec:
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: names must be unique, got {names}")
        return self


# --- Status ------------------------------------------------------------------------------


def _observed_generation() -> Any:
    return Field(
        0,
        description="The metadata.generation the operator last acted on; smaller than "
        "metadata.generation while a spec change is being reconciled.",
    )


def _conditions() -> Any:
    return Field(
        default_factory=list,
        description="The latest observations of the resource's state; each says why in its "
        "reason and message (e.g. a pod in ImagePullBackOff or CrashLoopBackOff).",
    )


class TrainingMetrics(Spec):
    """Metrics of the latest training step; unset until the first step reports them."""

    reward: float | None = Field(None, description="Mean reward of the step's rollouts.")
    accuracy: float | None = Field(
        None, description="Fraction of the step's rollouts whose final answer is correct."
    )
    tool_calls_per_trajectory: float | None = Field(
        None, description="Mean number of tool calls in one rollout."
    )
    tool_error_rate: float | None = Field(
        None, description="Fraction of the step's tool calls that ended in an error."
    )
    positive_tool_error_rate: float | None = Field(
        None,
        description="Tool error rate of the correct trajectories kept for the update: what "
        "Resample-on-Correct drives down.",
    )
    mean_response_tokens: float | None = Field(
        None, description="Mean tokens the policy generated per rollout."
    )
    tokens_per_second: float | None = Field(
        None, description="Rollout throughput: response tokens per second over the step."
    )
    step_seconds: float | None = Field(
        None, description="Wall-clock seconds of the step: rollouts, rewards, update, weights."
    )


# status.evaluations keeps the first evaluation and the newest after it, this many in all:
# a run that evaluates every step must not outgrow the object's size limit.
MAX_STATUS_EVALUATIONS = 100


class SearchEvaluationResult(Spec):
    """What the test-time search (spec.evaluation.search) did at one evaluation point."""

    mode: str = Field(description="The search's mode (spec.evaluation.search.mode).")
    accuracy: float = Field(description="Fraction of the held-out problems answered right.")
    answered: float = Field(0.0, description="Fraction of the problems given any answer.")
    generated_tokens_per_problem: float = Field(
        0.0,
        description="Tokens the policy generated per problem, every sampled step counted "
        "(duplicates dropped included): the budget to compare the sampled figure against.",
    )
    seconds: float = Field(0.0, description="Wall-clock seconds of the search, all problems.")


class EvaluationResult(Spec):
    """One held-out evaluation (spec.evaluation): when it ran, the sampled figures, and the
    search's when spec.evaluation.search is set."""

    point: Literal["start", "sft", "step", "end"] = Field(
        description="When it ran: start, sft or end (spec.evaluation.at), or step (every "
        "spec.evaluation.everySteps RL steps)."
    )
    step: int = Field(description="RL steps done when it ran.")
    problems: int = Field(0, description="Held-out problems evaluated.")
    samples: int = Field(1, description="Trajectories per problem (k, spec.evaluation.samples).")
    temperature: float = Field(
        0.0, description="Their sampling temperature (spec.evaluation.temperature)."
    )
    accuracy: float = Field(
        description="avg@k: fraction of the trajectories whose answer is right (over k "
        "samples per problem)."
    )
    pass_at_k: float = Field(
        0.0, description="pass@k: fraction of the problems with at least one right answer."
    )
    generated_tokens_per_problem: float = Field(
        0.0,
        description="Tokens the policy generated per problem (tool output not counted), over "
        "its k trajectories.",
    )
    seconds: float = Field(0.0, description="Wall-clock seconds of the sampled evaluation.")
    search: SearchEvaluationResult | None = Field(
        None, description="The test-time search's figures; unset without evaluation.search."
    )


class StageFilterResult(Spec):
    """What a stage's filter (spec.stages[].filter) kept."""

    stage: str = Field(description="The stage (spec.stages[].name).")
    k: int = Field(description="Samples per problem (filter.dropSolvedKOfK).")
    evaluated: int = Field(description="Problems the policy was sampled on.")
    kept: int = Field(description="Problems it did not solve k of k: the stage trains on these.")


class ProgressMetric(Spec):
    """One metric of the latest step: its name, and its value as a decimal string."""

    name: str = Field(description="The metric's name, as in status.metrics (e.g. reward).")
    value: str = Field(description="Its latest value, as a decimal string.")


class Progress(Spec):
    """How far the run is: RL steps done in percent, the estimated time left, the latest
    step's metrics as a list and when the trainer wrote them. Kubeflow Trainer's TrainJob
    reports the same figures at another path and partly under other names
    (status.trainerStatus: progressPercentage, estimatedRemainingSeconds, metrics,
    lastUpdatedTime): a tool written for TrainJobs does not read these unchanged."""

    percentage: int = Field(
        0, ge=0, le=100, description="RL steps done out of totalSteps, in percent (rounded down)."
    )
    estimated_remaining_seconds: int | None = Field(
        None,
        ge=0,
        description="Seconds until the last step is done, from the durations of the last five "
        "steps; unset before the first step.",
    )
    estimated_remaining_time_summary: str = Field(
        "",
        description="The same, for people and the Time-Left column of `kubectl get` "
        '(e.g. "1h5m", "42s"; "0s" when done).',
    )
    metrics: list[ProgressMetric] = Field(
        default_factory=list, description="The latest step's metrics, as name and value."
    )
    last_update_time: str = Field(
        "", description="When the trainer last updated this (RFC 3339, the trainer's clock)."
    )


class Activity(Spec):
    """What the trainer is doing now (written by the trainer as it moves from one part of a
    step to the next; the operator's watchdog reads it)."""

    what: str = Field(description='What the trainer does, e.g. "rolling out step 12".')
    waiting_on: str = Field(
        "",
        description="The component it waits on, e.g. the rollout scheduler and sandbox "
        "endpoints, or the checkpoint folder.",
    )
    since: str = Field("", description="When it began (RFC 3339, the trainer's clock).")


class RolloutRetry(Spec):
    """A step being rolled out again because infrastructure failures spoiled too many of its
    trajectories (written by the trainer; the operator shows it as the RolloutsHealthy
    condition)."""

    step: int = Field(description="The RL step (over all stages) being rolled out again.")
    attempt: int = Field(description="The attempt that failed (1 is the first rollout).")
    attempts: int = Field(description="spec.resilience.rolloutAttempts.")
    spoiled: int = Field(description="Trajectories of that attempt spoiled by a failure.")
    trajectories: int = Field(description="Trajectories of that attempt.")
    message: str = Field("", description="What failed, by cause, with the first error's text.")


class TrainingRunStatus(Spec):
    """Observed state of a TrainingRun. The trainer writes stage, step, progress, metrics,
    the checkpoint and the phases from Evaluating on; the operator writes the rest."""

    phase: Phase = Field(
        Phase.PENDING,
        description="Where the run is: Pending (waiting for its spec, fleet or pool), "
        "Provisioning (starting the trainer), Evaluating, SFT, Training, then Succeeded or "
        "Failed.",
    )
    stage: str = Field("", description="Name of the RL stage being trained (spec.stages).")
    step: int = Field(0, description="RL steps done, over all stages.")
    total_steps: int = Field(0, description="RL steps of the whole run: the stages' steps added.")
    progress: Progress = Field(
        default_factory=Progress,
        description="Percentage of the RL steps done, estimated time left and the latest "
        "step's metrics as a list.",
    )
    metrics: TrainingMetrics = Field(
        default_factory=TrainingMetrics, description="Metrics of the latest step."
    )
    last_checkpoint: str = Field(
        "", description="Folder of the newest checkpoint; a restarted trainer resumes from it."
    )
    observed_generation: int = _observed_generation()
    conditions: list[Condition] = _conditions()
    step_summary: str = Field(
        "", description='"step/totalSteps", as the Step column of `kubectl get` shows it.'
    )
    trainer: str = Field(
        "",
        description="The trainer's Jobs, as Job/name, one per worker (worker 0 first, "
        "comma-separated).",
    )
    world_size: int = Field(
        0,
        description="Training processes in the trainer's torch.distributed world "
        "(trainer.workers x trainer.processesPerWorker), once the trainer is created.",
    )
    rendezvous_address: str = Field(
        "",
        description="Address of trainer worker 0's pod, where the other workers join the "
        "process group on clusters without DNS for Services (kept by the operator).",
    )
    activity: Activity | None = Field(
        None,
        description="What the trainer is doing now and what it waits on; the Stalled "
        "condition turns True when it has not changed for spec.resilience.stallSeconds.",
    )
    rollout_retry: RolloutRetry | None = Field(
        None,
        description="Set while a step is rolled out again because too many of its "
        "trajectories were spoiled by engine, scheduler or sandbox failures (or when the run "
        "failed for that); cleared once the step trains.",
    )
    stage_filters: list[StageFilterResult] = Field(
        default_factory=list,
        description="Per stage with a filter (spec.stages[].filter), once it ran: problems "
        "evaluated and kept.",
    )
    evaluations: list[EvaluationResult] = Field(
        default_factory=list,
        description="The held-out evaluations so far, in the order they ran: avg@k and pass@k "
        "and, with spec.evaluation.search, the search's accuracy, tokens and time beside it. "
        "At most 100: the first and the newest 99 (metrics.jsonl keeps them all).",
    )


class SandboxPoolStatus(Spec):
    """Observed state of a SandboxPool."""

    observed_generation: int = _observed_generation()
    replicas: int = Field(0, description="Worker pods wanted (spec.replicas).")
    ready_replicas: int = Field(0, description="Worker pods ready to run calls.")
    capacity: int = Field(
        0,
        description="Calls the pool can run at the same time: ready workers x "
        "executorsPerPod (0 while the dispatcher is not ready).",
    )
    endpoint: str = Field(
        "",
        description="HOST:PORT of the dispatcher's gRPC service, where tool calls are sent.",
    )
    http_endpoint: str = Field(
        "",
        description="http://HOST:PORT of the dispatcher's HTTP APIs (SandboxFusion's "
        "/run_code, code-judge's /run/long-batch), when spec.httpPort is set.",
    )
    isolation: str = Field(
        "",
        description="The isolation the workers run with (spec.isolation): Required, or "
        "Disabled (calls are not isolated).",
    )
    conditions: list[Condition] = _conditions()


class EngineStatus(Spec):
    """One engine of the fleet."""

    name: str = Field(description="The engine's pod.")
    ready: bool = Field(False, description="Whether the engine pod is ready to serve.")
    kv_capacity_tokens: int | None = Field(
        None,
        description="The engine's KV cache capacity in tokens (vLLM's blocks x block size), "
        "as the scheduler reports it.",
    )
    kv_usage: float | None = Field(
        None, description="Fraction of the engine's KV cache in use, from 0 to 1."
    )
    taken_out: str = Field(
        "",
        description="Why the rollout scheduler gives this engine no turns although its pod "
        "may be ready (its last failure, e.g. a weight reload that did not finish in "
        "scheduler.weightsReloadTimeoutSeconds); empty while it takes turns.",
    )


class ScaleEvent(Spec):
    """A change of the fleet's size: when, from what to what, and why."""

    time: str = Field(description="When the operator saw or made it (RFC 3339).")
    from_replicas: int = Field(description="Engines wanted before.")
    to_replicas: int = Field(description="Engines wanted after.")
    reason: Literal["Autoscaled", "SpecChanged"] = Field(
        description="Autoscaled: the operator, by spec.autoscaling. SpecChanged: "
        "spec.replicas was set by someone else (kubectl scale, an edit, an autoscaler of "
        "the cluster's)."
    )
    message: str = Field("", description="The metric and target behind an Autoscaled change.")


class AutoscalingStatus(Spec):
    """What the operator's autoscaler last saw (spec.autoscaling)."""

    value: float | None = Field(
        None,
        description="The metric's last value (spec.autoscaling.metric); unset while the "
        "scheduler does not answer.",
    )
    desired_replicas: int = Field(0, description="The engines the metric asks for.")
    below_target_since: str = Field(
        "",
        description="Since when (RFC 3339) the metric asks for fewer engines; they are "
        "removed once that lasted spec.autoscaling.scaleDownDelaySeconds. Empty: it does not.",
    )


class WeightsStatus(Spec):
    """Policy weights the fleet's engines serve."""

    version: int = Field(0, description="The version the trainer gave them (its step).")
    path: str = Field("", description="The folder every engine loaded them from.")


class RolloutFleetStatus(Spec):
    """Observed state of a RolloutFleet."""

    observed_generation: int = _observed_generation()
    accelerator: str = Field(
        "", description="The accelerator in use: spec.accelerator, or the cluster's default."
    )
    replicas: int = Field(0, description="Engine pods wanted (spec.replicas).")
    ready_replicas: int = Field(0, description="Engine pods ready to serve.")
    scheduler_endpoint: str = Field(
        "",
        description="HOST:PORT of the scheduler's gRPC service, where rollouts are requested.",
    )
    openai_endpoint: str = Field(
        "",
        description="http://HOST:PORT/v1 of the scheduler's OpenAI-compatible API, when "
        "spec.scheduler.openaiPort is set.",
    )
    selector: str = Field(
        "",
        description="The label selector of the engine pods (the scale subresource's, which "
        "a HorizontalPodAutoscaler needs).",
    )
    last_scale: ScaleEvent | None = Field(
        None, description="The latest change of spec.replicas the operator saw or made."
    )
    autoscaling: AutoscalingStatus | None = Field(
        None, description="The autoscaler's view, while spec.autoscaling is set."
    )
    engines: list[EngineStatus] = Field(
        default_factory=list, description="Each engine's readiness and KV cache."
    )
    kv_capacity_tokens: int | None = Field(
        None, description="KV cache capacity of all engines together, in tokens."
    )
    weights: WeightsStatus | None = Field(
        None,
        description="The policy weights the engines serve, as the scheduler last reported "
        "them; a restarted scheduler, which starts with the engines' own, gets the trainer's "
        "latest again before its next rollout. Unset until a trainer pushes weights.",
    )
    conditions: list[Condition] = _conditions()


# --- Resources and manifests -------------------------------------------------------------


class Metadata(BaseModel):
    """The object's name and namespace; other metadata (labels, annotations) is kept."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=253, description="The resource's name.")
    namespace: str = Field("default", description="The namespace the resource lives in.")


class Resource(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["kubestar.dev/v1alpha1"] = Field(
        "kubestar.dev/v1alpha1",
        alias="apiVersion",
        description="The API group and version of this object's schema: kubestar.dev/v1alpha1.",
    )
    metadata: Metadata = Field(description="Standard object metadata: name, namespace, labels.")
    status: dict[str, Any] | None = Field(
        None, description="Observed state, written by the operator and the trainer."
    )


class SandboxPool(Resource):
    """A pool of pre-warmed Python sandboxes that run the policy's tool calls: worker pods,
    each with executors ready to run code under per-call limits, behind a gRPC dispatcher."""

    kind: Literal["SandboxPool"] = Field(
        "SandboxPool", description="The kind of this object: SandboxPool."
    )
    spec: SandboxPoolSpec = Field(
        default_factory=SandboxPoolSpec, description="Desired state of the pool."
    )


class RolloutFleet(Resource):
    """A fleet of vLLM engines serving the policy model, behind a KV-aware scheduler that
    places rollout requests and keeps each trajectory's turns on the engine holding its
    prefix."""

    kind: Literal["RolloutFleet"] = Field(
        "RolloutFleet", description="The kind of this object: RolloutFleet."
    )
    spec: RolloutFleetSpec = Field(
        default_factory=RolloutFleetSpec, description="Desired state of the fleet."
    )


class TrainingRun(Resource):
    """An agentic RL training run: an optional SFT stage, then RL stages (GRPO-RoC) with
    rollouts on a RolloutFleet and tool calls on a SandboxPool, reporting progress and
    metrics in its status."""

    kind: Literal["TrainingRun"] = Field(
        "TrainingRun", description="The kind of this object: TrainingRun."
    )
    spec: TrainingRunSpec = Field(description="Desired state of the run.")


KINDS: dict[str, type[Resource]] = {
    "SandboxPool": SandboxPool,
    "RolloutFleet": RolloutFleet,
    "TrainingRun": TrainingRun,
}


class ManifestError(KubestarError, ValueError):
    """A manifest is invalid; the message names the document, kind and field."""


def parse_resource(document: dict[str, Any], where: str = "") -> Resource:
    kind = document.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}kind: expected one of {sorted(KINDS)}, got {kind!r}")
    try:
        return KINDS[kind].model_validate(document)
    except ValidationError as error:
        problems = "; ".join(_field_problem(item) for item in error.errors())
        name = (document.get("metadata") or {}).get("name", "?")
        raise ManifestError(f"{where}{kind} {name!r}: {problems}") from error


def _field_problem(item: Any) -> str:
    """One validation error as `field.path: what is wrong` (fields in the manifest's names)."""
    field = ".".join(str(part) for part in item["loc"])
    if item["type"] == "extra_forbidden":
        return f"{field}: unknown field"
    if item["type"] == "missing":
        return f"{field}: required field missing"
    return f"{field}: {item['msg']}"


def load_manifests(path: str | Path) -> list[Resource]:
    """Every kubestar resource in a (multi-document) YAML file, validated. Errors name the
    file, the document (counted from 1), the kind and the field."""
    text = Path(path).read_text()
    resources: list[Resource] = []
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ManifestError(f"{path}: not valid YAML{at}: {error.problem}") from error
    except yaml.YAMLError as error:
        raise ManifestError(f"{path}: not valid YAML: {error}") from error
    for number, document in enumerate(documents, start=1):
        if document is None:
            continue
        if not isinstance(document, dict):
            raise ManifestError(f"{path} document {number}: not a mapping")
        resources.append(parse_resource(document, f"{path} document {number}: "))
    return resources
