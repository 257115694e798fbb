"""kubestar.dev/v1alpha1 types: SandboxPool, RolloutFleet, TrainingRun.

One source of truth: the operator reconciles these, `kubestar train -f` runs them on one
machine, and the CRD schemas in helm/kubestar/crds are generated from them
(`kubestar.api.crds`). Field names are camelCase on the wire; unknown fields are errors, so a
typo is reported with its path instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kubestar.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# As in a Pod's resources; the CRD types it int-or-string ("500m", "64Gi", 8).
Quantity = str | int


class ResourceRequirements(Spec):
    """As in a Pod: e.g. {"limits": {"amd.com/gpu": 8, "memory": "64Gi"}}."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class ObjectReference(Spec):
    name: str = Field(min_length=1, max_length=253)


# --- SandboxPool -------------------------------------------------------------------------


class CallLimitsSpec(Spec):
    """Defaults for each tool call; a call may ask for less."""

    timeout_seconds: float = Field(10.0, gt=0, le=300)
    memory_mib: int = Field(512, ge=16, le=65536)
    output_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024)


class SandboxPoolSpec(Spec):
    replicas: int = Field(1, ge=0, le=1000)
    executors_per_pod: int = Field(4, ge=1, le=256)
    limits: CallLimitsSpec = Field(default_factory=CallLimitsSpec)
    preload: list[str] = Field(default_factory=lambda: ["numpy", "sympy"])
    queue_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    image: str = ""  # empty: the chart's default sandbox image
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    # gVisor (runsc) or Kata in production clusters.
    runtime_class_name: str | None = None
    port: int = Field(50051, ge=1, le=65535)


# --- RolloutFleet ------------------------------------------------------------------------


class ModelSource(Spec):
    """Where weights come from: an embedded name, a path in the image/node, or a PVC."""

    name: str = "SmolLM2-135M-Instruct"
    path: str | None = None
    pvc_claim_name: str | None = None
    pvc_sub_path: str = ""


class EngineSpec(Spec):
    image: str = ""  # empty: the chart's default for the fleet's accelerator
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_model_len: int = Field(4096, ge=128, le=1_048_576)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Fixed KV cache size in bytes (0: vLLM decides).
    kv_cache_bytes: int = Field(0, ge=0)
    max_num_seqs: int = Field(64, ge=1, le=4096)
    extra_args: list[str] = Field(default_factory=list)
    port: int = Field(8000, ge=1, le=65535)


class SchedulerSpec(Spec):
    policy: Literal["kv-aware", "least-requests", "round-robin"] = "kv-aware"
    # How often engines' /metrics are read.
    metrics_interval_seconds: float = Field(0.2, gt=0, le=60)
    # kv-aware: the most new tokens one admission reserves KV room for; longer turns run in
    # segments of this size on the same engine (0: reserve the whole turn at once).
    segment_tokens: int = Field(256, ge=0, le=1_048_576)
    port: int = Field(50061, ge=1, le=65535)


class RolloutFleetSpec(Spec):
    model: ModelSource = Field(default_factory=ModelSource)
    replicas: int = Field(1, ge=0, le=1024)
    # amd: amd.com/gpu on ROCm nodes; nvidia: nvidia.com/gpu; cpu: vLLM's CPU build.
    # Omitted on a cluster: the chart's accelerator.vendor (the CRD sets no default);
    # omitted in a local run: cpu.
    accelerator: Literal["amd", "nvidia", "cpu"] = "cpu"
    engine: EngineSpec = Field(default_factory=EngineSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)


# --- TrainingRun -------------------------------------------------------------------------


class AlgorithmSpec(Spec):
    name: Literal["grpo-roc", "grpo"] = "grpo-roc"
    group_size: int = Field(16, ge=2, le=1024)
    # Roll out group_size * oversample_factor per problem, keep group_size (RoC).
    oversample_factor: float = Field(2.0, ge=1.0, le=16.0)
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.28, ge=0, le=10)
    learning_rate: float = Field(1e-6, gt=0, le=1)
    max_turns: int = Field(10, ge=1, le=1000)
    positive_selection: Literal["inverse-penalty", "lowest-penalty"] = "inverse-penalty"
    temperature: float = Field(1.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)


class DatasetSpec(Spec):
    """A reasoning-gym generator, or a local file in a published format."""

    generator: str | None = None
    path: str | None = None
    format: Literal["jsonl", "dapo", "aime"] = "jsonl"
    size: int = Field(1000, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.generator is None) == (self.path is None):
            raise ValueError("set exactly one of generator or path")
        return self


class SftSpec(Spec):
    """Non-reasoning SFT: instruction following and the tool-call format, before RL."""

    enabled: bool = True
    examples: int = Field(256, ge=1)
    epochs: int = Field(1, ge=1, le=100)
    learning_rate: float = Field(1e-5, gt=0, le=1)
    batch_size: int = Field(8, ge=1)
    max_tokens: int = Field(1024, ge=64)


class StageFilterSpec(Spec):
    # Keep only problems the previous stage's policy did not solve in all of k samples.
    drop_solved_k_of_k: int | None = Field(None, ge=1, le=256)


class StageSpec(Spec):
    name: str = Field(min_length=1, max_length=63)
    max_response_tokens: int = Field(ge=16, le=1_048_576)
    steps: int = Field(ge=1)
    problems_per_step: int = Field(32, ge=1)
    dataset: DatasetSpec
    filter: StageFilterSpec | None = None
    reset_optimizer: bool = False


class TrainerSpec(Spec):
    # More than 1: a Ray cluster (KubeRay RayJob) instead of one pod with local Ray.
    workers: int = Field(1, ge=1, le=1024)
    image: str = ""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    ray_address: str = ""
    micro_batch_size: int = Field(4, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Datasets on a cluster: a PVC mounted read-only at dataMountPath in the trainer pods.
    data_pvc_claim_name: str | None = None
    data_mount_path: str = "/data"


class CheckpointSpec(Spec):
    every_steps: int = Field(1, ge=1)
    keep: int = Field(3, ge=1)
    # Where checkpoints go: a path (local runs: under the run directory) or a PVC.
    path: str = ""
    pvc_claim_name: str | None = None


EvaluationPoint = Literal["start", "sft", "end"]


class EvaluationSpec(Spec):
    dataset: DatasetSpec | None = None
    samples: int = Field(1, ge=1)
    # When to evaluate: "start" is the policy before any training (verl's val_before_train),
    # "sft" right after the SFT stage, "end" after the last RL step.
    at: list[EvaluationPoint] = Field(default_factory=lambda: list[EvaluationPoint](["end"]))


class TrainingRunSpec(Spec):
    rollout_fleet_ref: ObjectReference
    sandbox_pool_ref: ObjectReference
    model: ModelSource = Field(default_factory=ModelSource)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    sft: SftSpec | None = None
    stages: list[StageSpec] = Field(min_length=1)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)

    @model_validator(mode="after")
    def _unique_stage_names(self) -> TrainingRunSpec:
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: names must be unique, got {names}")
        return self


# --- Status ------------------------------------------------------------------------------


class Condition(Spec):
    """As metav1.Condition: a type, a status, and a reason and message that say why."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class TrainingMetrics(Spec):
    reward: float | None = None
    accuracy: float | None = None
    tool_calls_per_trajectory: float | None = None
    tool_error_rate: float | None = None
    positive_tool_error_rate: float | None = None
    mean_response_tokens: float | None = None
    tokens_per_second: float | None = None
    step_seconds: float | None = None


Phase = Literal["Pending", "Provisioning", "Evaluating", "SFT", "Training", "Succeeded", "Failed"]


class TrainingRunStatus(Spec):
    phase: Phase = "Pending"
    stage: str = ""
    step: int = 0
    total_steps: int = 0
    progress: float = 0.0
    metrics: TrainingMetrics = Field(default_factory=TrainingMetrics)
    last_checkpoint: str = ""
    estimated_seconds_left: float | None = None
    observed_generation: int = 0
    conditions: list[Condition] = Field(default_factory=list)
    # Written by the operator: "step/totalSteps" for `kubectl get`, and the trainer's workload.
    step_summary: str = ""
    trainer: str = ""


class SandboxPoolStatus(Spec):
    observed_generation: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    # Concurrent executions: ready worker pods x executors per pod.
    capacity: int = 0
    # The dispatcher's gRPC address (HOST:PORT).
    endpoint: str = ""
    conditions: list[Condition] = Field(default_factory=list)


class EngineStatus(Spec):
    name: str
    ready: bool = False
    # KV capacity in tokens (vLLM's blocks x block size), as the scheduler reports it.
    kv_capacity_tokens: int | None = None
    kv_usage: float | None = None


class RolloutFleetStatus(Spec):
    observed_generation: int = 0
    # The accelerator in use (spec.accelerator, or the cluster's default).
    accelerator: str = ""
    replicas: int = 0
    ready_replicas: int = 0
    # The scheduler's gRPC address (HOST:PORT).
    scheduler_endpoint: str = ""
    engines: list[EngineStatus] = Field(default_factory=list)
    kv_capacity_tokens: int | None = None
    conditions: list[Condition] = Field(default_factory=list)


# --- Resources and manifests -------------------------------------------------------------


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=253)
    namespace: str = "default"


class Resource(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["kubestar.dev/v1alpha1"] = Field(
        "kubestar.dev/v1alpha1", alias="apiVersion"
    )
    metadata: Metadata
    status: dict[str, Any] | None = None


class SandboxPool(Resource):
    kind: Literal["SandboxPool"] = "SandboxPool"
    spec: SandboxPoolSpec = Field(default_factory=SandboxPoolSpec)


class RolloutFleet(Resource):
    kind: Literal["RolloutFleet"] = "RolloutFleet"
    spec: RolloutFleetSpec = Field(default_factory=RolloutFleetSpec)


class TrainingRun(Resource):
    kind: Literal["TrainingRun"] = "TrainingRun"
    spec: TrainingRunSpec


KINDS: dict[str, type[Resource]] = {
    "SandboxPool": SandboxPool,
    "RolloutFleet": RolloutFleet,
    "TrainingRun": TrainingRun,
}


class ManifestError(ValueError):
    """A manifest is invalid; the message names the document, kind and field."""


def parse_resource(document: dict[str, Any], where: str = "") -> Resource:
    kind = document.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}kind: expected one of {sorted(KINDS)}, got {kind!r}")
    try:
        return KINDS[kind].model_validate(document)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
            for item in error.errors()
        )
        name = (document.get("metadata") or {}).get("name", "?")
        raise ManifestError(f"{where}{kind} {name!r}: {problems}") from error


def load_manifests(path: str | Path) -> list[Resource]:
    """Every kubestar resource in a (multi-document) YAML file, validated."""
    text = Path(path).read_text()
    resources: list[Resource] = []
    for index, document in enumerate(yaml.safe_load_all(text)):
        if document is None:
            continue
        if not isinstance(document, dict):
            raise ManifestError(f"{path} document {index}: not a mapping")
        resources.append(parse_resource(document, f"{path} document {index}: "))
    return resources
