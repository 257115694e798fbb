"""Operator settings: images, networking, defaults. The chart renders them to a YAML file
(`kubestar operator run --config FILE`); every field has a default that works on a cluster
with pod networking and the published images."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import yaml
from kubestar.common.auth import read_token_file
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class _Settings(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PullSecret(_Settings):
    name: str = Field(min_length=1)


class Images(_Settings):
    # kubestar itself: operator, sandbox, scheduler, trainer (and Ray for several workers).
    kubestar: str = "kubestar:0.1.0"
    # Rollout engines by accelerator: vLLM's CPU build in kubestar's engine image, vLLM's own
    # ROCm and CUDA images on GPU nodes.
    engine_cpu: str = "kubestar-engine-cpu:0.1.0"
    engine_rocm: str = "rocm/vllm:rocm7.14.0_cdna_ubuntu24.04_py3.14_pytorch_2.11.0_vllm_0.23.0"
    engine_cuda: str = "vllm/vllm-openai:v0.32.0"
    pull_policy: str = "IfNotPresent"
    # Secrets for private registries (the chart's images.pullSecrets, [{name: regcred}]):
    # every pod the operator makes pulls with them, besides the operator's own.
    pull_secrets: list[PullSecret] = Field(default_factory=list)

    @property
    def pull_secret_names(self) -> list[str]:
        return [secret.name for secret in self.pull_secrets]

    @property
    def own(self) -> tuple[str, ...]:
        """The installation's own images, which every policy allows."""
        return (self.kubestar, self.engine_cpu, self.engine_rocm, self.engine_cuda)


class Network(_Settings):
    # Pods on the node's network: for clusters without pod networking (a single-node test
    # cluster). Then every in-cluster address is 127.0.0.1 and ports must not collide.
    host_network: bool = False
    cluster_domain: str = "cluster.local"
    # Set where pods cannot reach the API server through the kubernetes Service (no
    # kube-proxy): given to the scheduler and trainer pods as KUBERNETES_SERVICE_HOST/PORT.
    api_server_host: str = ""
    api_server_port: int = 443
    # The address the children's servers listen on (sandbox worker and dispatcher, rollout
    # scheduler, engines, the trainer's Ray). With hostNetwork on a node whose address is
    # 127.0.0.1, set 127.0.0.1: 0.0.0.0 would then mean every interface of the machine.
    bind_address: str = "0.0.0.0"

    @property
    def loopback_only(self) -> bool:
        return self.bind_address in ("127.0.0.1", "localhost", "::1")


# On the host's network every pod of a node shares its ports: a pod's metrics port is then its
# serving port plus this, distinct for each pool and fleet as their serving ports must be.
HOST_NETWORK_METRICS_OFFSET = 1000


class Ports(_Settings):
    sandbox_dispatcher_metrics: int = 9090
    sandbox_worker_metrics: int = 9091
    scheduler_metrics: int = 9092
    # Worker 0 of a sharded trainer: torch.distributed's store, where the world meets.
    trainer_rendezvous: int = 29500
    # Worker 0's WeightServer, which broadcasts each step's weights to the fleet's engines
    # (spec.weightSync broadcast). With hostNetwork any free port: the trainer says which.
    trainer_weights: int = 29600
    # Worker 0's Prometheus metrics (rank 0's); on the host's network too: one trainer per
    # node serves them there, the next one's are logged as missing.
    trainer_metrics: int = 9093


class SandboxDefaults(_Settings):
    # The uid of dispatcher pods, and of worker pods that do not run as root (see below).
    run_as_user: int = 65532
    # How a worker of a pool with isolation: Required gets the namespaces it runs calls in.
    # Capabilities: the worker container runs as root with exactly the capabilities its
    # executors use (kubestar.sandbox.isolation.ROOT_CAPABILITIES), which the container
    # runtimes' default seccomp profiles honour; each call runs as a uid of its own with no
    # capabilities, under kubestar's syscall filter. UserNamespace: the worker runs as
    # run_as_user with no capabilities and makes a user namespace, which takes a node or a
    # runtime class (gVisor) that allows it; the runtimes' default profiles refuse it.
    isolation_mechanism: Literal["Capabilities", "UserNamespace"] = "Capabilities"
    # Used when a pool sets no runtimeClassName (e.g. gvisor); empty: the cluster default.
    runtime_class_name: str = ""
    seccomp_runtime_default: bool = True


class SharedCheckpoints(_Settings):
    """One volume that every trainer and every engine mount at trainer.checkpointDir: the
    weights a trainer pushes after each step are written there and read by the fleet's
    engines from the same path. At most one of the two; neither: each trainer keeps its
    checkpoints in its own volume and engines cannot load pushed weights."""

    # A ReadWriteMany PersistentVolumeClaim of this name in each namespace with runs.
    pvc_claim_name: str = ""
    # A directory on the node (single-node clusters: kind, the local e2e cluster). It must
    # exist and be writable by trainer.runAsUser (e.g. mode 1777).
    host_path: str = ""

    @model_validator(mode="after")
    def _one(self) -> SharedCheckpoints:
        if self.pvc_claim_name and self.host_path:
            raise ValueError("set at most one of pvcClaimName and hostPath")
        if self.host_path and not self.host_path.startswith("/"):
            raise ValueError("hostPath must be an absolute path")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.pvc_claim_name or self.host_path)

    def volume(self, name: str, read_only: bool = False) -> dict[str, Any]:
        if self.host_path:
            return {"name": name, "hostPath": {"path": self.host_path, "type": "Directory"}}
        claim: dict[str, Any] = {"claimName": self.pvc_claim_name}
        if read_only:
            claim["readOnly"] = True
        return {"name": name, "persistentVolumeClaim": claim}


class TrainerDefaults(_Settings):
    # Retries of a failed trainer pod before its Job (and so the run) fails; each retry
    # resumes from the newest checkpoint. Only where checkpoints outlive a pod (the shared
    # volume, or a claim of the run's): with a development run's emptyDir a retry would
    # start over, so none.
    backoff_limit: int = Field(6, ge=0)
    # Seconds a trainer pod has after SIGTERM (a drain, an eviction) to finish its step and
    # checkpoint it.
    termination_grace_seconds: int = Field(900, ge=30)
    run_as_user: int = 1000
    checkpoint_dir: str = "/var/lib/kubestar/checkpoints"
    # Shared by trainers and engines (see SharedCheckpoints); each run then checkpoints to
    # checkpointDir/NAMESPACE/NAME unless its spec.checkpoint.pvcClaimName is set.
    shared_checkpoints: SharedCheckpoints = Field(default_factory=SharedCheckpoints)


class AmdGroups(_Settings):
    """The groups a non-root process needs to open ROCm's /dev/kfd and /dev/dri/renderD*:
    the host's video group and its render group, whose GID differs between hosts (`stat -c
    %g /dev/dri/renderD128` on a node). Given as supplementalGroups to engines of amd fleets
    and to trainer pods given amd.com/gpu."""

    video_group: int = Field(44, ge=1)
    # 0: none (the video group alone, where udev rules open the devices to it).
    render_group: int = Field(0, ge=0)

    @property
    def supplemental_groups(self) -> list[int]:
        return [self.video_group, *([self.render_group] if self.render_group else [])]


# In a policy list: anything at all.
ANY = "*"


class Policy(_Settings):
    """What a tenant's spec may ask for beyond the installation's defaults. Closed by default:
    the installation's own images and default runtime class only, and no pool without
    isolation. An administrator opens each by a value (ANY in a list allows anything)."""

    # Image name prefixes a spec may name, e.g. "myorg/" or "myorg/kubestar:".
    allowed_images: list[str] = Field(default_factory=list)
    # RuntimeClass names a SandboxPool may name, e.g. "gvisor".
    allowed_runtime_classes: list[str] = Field(default_factory=list)
    # Whether a SandboxPool may set isolation: Disabled (its calls then reach what the worker
    # reaches: for development clusters with one tenant).
    allow_isolation_disabled: bool = False

    def image_refusal(self, field: str, image: str, own: Collection[str]) -> str | None:
        """Why `image` (a spec's `field`) is not allowed here, or None: empty, one of the
        installation's `own` images, or under an allowed prefix."""
        allowed = self.allowed_images
        if not image or image in own or ANY in allowed or image.startswith(tuple(allowed)):
            return None
        return (
            f"{field} {image!r} is not allowed by this installation (the chart's "
            f"policy.allowedImages: {_listed(allowed)}); use an allowed image or leave the "
            "field empty for the installation's own"
        )

    def runtime_class_refusal(self, field: str, name: str, default: str) -> str | None:
        allowed = self.allowed_runtime_classes
        if not name or name == default or ANY in allowed or name in allowed:
            return None
        return (
            f"{field} {name!r} is not allowed by this installation (the chart's "
            f"policy.allowedRuntimeClasses: {_listed(allowed)}); use one of them or leave the "
            "field empty for the installation's default"
        )

    def isolation_refusal(self, field: str, isolation: str) -> str | None:
        if isolation != "Disabled" or self.allow_isolation_disabled:
            return None
        return (
            f"{field} Disabled is not allowed by this installation (the chart's "
            "policy.allowIsolationDisabled is false): calls without isolation reach what the "
            "worker reaches; use Required"
        )


def _listed(values: list[str]) -> str:
    return ", ".join(values) if values else "none"


class NetworkPolicies(_Settings):
    """NetworkPolicies the operator makes beside each resource's pods: each pod is isolated
    both ways and admits exactly the flows of kubestar's data flow (see
    kubestar.operator.objects.network_policy). Not made with network.hostNetwork: a policy
    does not apply to pods on the host's network."""

    enabled: bool = True
    # The operator's own namespace: its pods may reach the fleets' schedulers (it reads
    # their engines' KV capacity). Selected by the kubernetes.io/metadata.name label, which
    # Kubernetes 1.21+ sets on every namespace.
    operator_namespace: str = ""
    # Who may scrape the metrics ports (sandbox workers and dispatchers, schedulers, and the
    # engines' HTTP port, where vLLM serves /metrics): NetworkPolicy peers, e.g. a
    # namespaceSelector of the monitoring namespace. Empty: the pods of the resource's own
    # namespace.
    metrics_from: list[dict[str, Any]] = Field(default_factory=list)
    # Where the pods that call the Kubernetes API (trainers, schedulers) may reach it:
    # NetworkPolicy peers, e.g. an ipBlock per control-plane address. Empty: any address,
    # on the API server's ports only (443, 6443 and network.apiServerPort).
    api_server_peers: list[dict[str, Any]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _peers(self) -> NetworkPolicies:
        named = {"metricsFrom": self.metrics_from, "apiServerPeers": self.api_server_peers}
        kinds = {"podSelector", "namespaceSelector", "ipBlock"}
        for field, peers in named.items():
            for peer in peers:
                keys = set(peer)
                if not keys or keys - kinds or ("ipBlock" in keys and len(keys) > 1):
                    raise ValueError(
                        f"networkPolicies.{field}: {peer!r} is not a NetworkPolicy peer (a "
                        "podSelector and/or a namespaceSelector, or an ipBlock alone)"
                    )
        return self


class Auth(_Settings):
    """The installation's bearer token (kubestar.common.auth), which the sandbox, the rollout
    schedulers and the engines require of their callers. The chart makes it (a Secret in the
    release's namespace, mounted into the operator's pod); the operator copies it into a
    Secret beside each resource (`NAME-sandbox-auth`, `NAME-fleet-auth`,
    `NAME-trainer-auth`, owned by the resource) and mounts that, read-only, into every pod
    that serves or calls these services."""

    # The file that holds the token (the chart's Secret, mounted). Empty: kubestar's
    # services run without authentication (a development operator outside the chart).
    token_file: str = ""
    # Read from token_file by OperatorSettings.load; never written into the settings file.
    token: str = Field("", exclude=True, repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.token)


class OperatorSettings(_Settings):
    # A RolloutFleet that does not say spec.accelerator gets this one.
    default_accelerator: Literal["amd", "nvidia", "cpu"] = "cpu"
    amd: AmdGroups = Field(default_factory=AmdGroups)
    images: Images = Field(default_factory=Images)
    network: Network = Field(default_factory=Network)
    ports: Ports = Field(default_factory=Ports)
    sandbox: SandboxDefaults = Field(default_factory=SandboxDefaults)
    trainer: TrainerDefaults = Field(default_factory=TrainerDefaults)
    policy: Policy = Field(default_factory=Policy)
    network_policies: NetworkPolicies = Field(default_factory=NetworkPolicies)
    auth: Auth = Field(default_factory=Auth)
    # Namespaces to watch (the operator needs permissions in these only), or, with
    # cluster_wide, every namespace: one of the two is required to run.
    namespaces: list[str] = Field(default_factory=list)
    cluster_wide: bool = False
    # Every resource is reconciled at least this often (children are also watched).
    resync_seconds: float = Field(30.0, gt=0)
    # Ask each fleet's scheduler for its engines' KV capacity (GetSchedulerStatus).
    probe_schedulers: bool = True

    @model_validator(mode="after")
    def _scope(self) -> OperatorSettings:
        if self.cluster_wide and self.namespaces:
            raise ValueError("set namespaces or clusterWide, not both")
        return self

    def scope_problem(self) -> str | None:
        """Why an operator with these settings has nothing to watch, or None."""
        if self.namespaces or self.cluster_wide:
            return None
        return (
            "no namespaces to watch: name them (settings namespaces, or --namespace), or set "
            "clusterWide: true (--cluster-wide) to watch every namespace"
        )

    def gpu_groups(self, resource: str) -> list[int]:
        """supplementalGroups a non-root pod given `resource` GPUs needs to open them."""
        return self.amd.supplemental_groups if resource == "amd.com/gpu" else []

    def metrics_port(self, port: int, serving_port: int) -> int:
        """The metrics port of a pod that serves on `serving_port`: `port` (one of
        ports.*Metrics), or on the host's network serving_port + HOST_NETWORK_METRICS_OFFSET."""
        if self.network.host_network:
            return serving_port + HOST_NETWORK_METRICS_OFFSET
        return port

    def refusal(
        self, field: str, *, image: str = "", runtime_class: str = "", isolation: str = ""
    ) -> str | None:
        """Why the policy does not allow what a spec's `field` asks for, or None."""
        policy = self.policy
        if image:
            return policy.image_refusal(field, image, self.images.own)
        if runtime_class:
            return policy.runtime_class_refusal(
                field, runtime_class, self.sandbox.runtime_class_name
            )
        return policy.isolation_refusal(field, isolation)

    @classmethod
    def load(cls, path: str | Path | None) -> OperatorSettings:
        if not path:
            return cls()
        data = yaml.safe_load(Path(path).read_text()) or {}
        settings = cls.model_validate(data)
        if settings.auth.token_file:
            settings.auth.token = read_token_file(settings.auth.token_file)
        return settings
