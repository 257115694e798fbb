"""The trainer contract: what the operator gives the trainer pod, and how it reports back.

The trainer Job (or each pod of the RayJob) runs

    kubestar train -f /etc/kubestar/run.yaml --in-cluster

with this environment (names are the constants below):

| variable | value |
|---|---|
| KUBESTAR_TRAININGRUN_NAME / _NAMESPACE | the TrainingRun whose status it patches |
| KUBESTAR_RUN_CONFIG | /etc/kubestar/run.yaml: the TrainingRun manifest (spec with defaults) |
| KUBESTAR_SCHEDULER_ENDPOINT | HOST:PORT of the fleet's rollout scheduler (gRPC) |
| KUBESTAR_SANDBOX_ENDPOINT | HOST:PORT of the pool's sandbox dispatcher (gRPC) |
| KUBESTAR_SANDBOX_LIMITS | JSON of the pool's per-call limits (timeoutSeconds, memoryMib, ...) |
| KUBESTAR_CHECKPOINT_DIR | where checkpoints go (a PVC when spec.checkpoint.pvcClaimName is set; |
|   | else checkpointDir/NAMESPACE/NAME on trainer.sharedCheckpoints, mounted by the engines too) |
| KUBESTAR_RAY_ADDRESS | "" for a local `ray.init()`, "auto" inside a KubeRay RayJob |
| KUBESTAR_TRAINER_WORKERS | spec.trainer.workers |

Its service account may `get` its own TrainingRun and `get`/`patch` that run's `status`
subresource, nothing else (a Role limited by resourceNames). It reports with
`StatusPatcher.report(status)` (a `kubestar.training.progress.Reporter`), which sends a JSON
merge patch of the fields the trainer owns: `phase` (Evaluating, SFT, Training, Succeeded,
Failed: kubestar.api.conditions.TRAINER_PHASES), `stage`, `step`, `totalSteps`, `progress`,
`metrics`, `lastCheckpoint`, `estimatedSecondsLeft`. The operator owns `conditions`,
`observedGeneration`, `stepSummary`, `trainer` and the phases Pending and Provisioning; it
also sets Succeeded or Failed from the Job's outcome when the trainer could not.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubestar.api.conditions import TRAINER_PHASES
from kubestar.api.v1alpha1 import API_VERSION, TrainingRunStatus

log = logging.getLogger(__name__)

ENV_NAME = "KUBESTAR_TRAININGRUN_NAME"
ENV_NAMESPACE = "KUBESTAR_TRAININGRUN_NAMESPACE"
ENV_RUN_CONFIG = "KUBESTAR_RUN_CONFIG"
ENV_SCHEDULER = "KUBESTAR_SCHEDULER_ENDPOINT"
ENV_SANDBOX = "KUBESTAR_SANDBOX_ENDPOINT"
ENV_SANDBOX_LIMITS = "KUBESTAR_SANDBOX_LIMITS"
ENV_CHECKPOINT_DIR = "KUBESTAR_CHECKPOINT_DIR"
ENV_RAY_ADDRESS = "KUBESTAR_RAY_ADDRESS"
ENV_WORKERS = "KUBESTAR_TRAINER_WORKERS"

CONFIG_DIR = "/etc/kubestar"
RUN_CONFIG = f"{CONFIG_DIR}/run.yaml"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

TRAINER_FIELDS = (
    "phase",
    "stage",
    "step",
    "totalSteps",
    "progress",
    "metrics",
    "lastCheckpoint",
    "estimatedSecondsLeft",
)


@dataclass(frozen=True)
class TrainerEnvironment:
    name: str
    namespace: str
    run_config: str
    scheduler_endpoint: str
    sandbox_endpoint: str
    sandbox_limits: dict[str, Any]
    checkpoint_dir: str
    ray_address: str
    workers: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TrainerEnvironment:
        values = dict(os.environ if env is None else env)
        return cls(
            name=values[ENV_NAME],
            namespace=values.get(ENV_NAMESPACE, "default"),
            run_config=values.get(ENV_RUN_CONFIG, RUN_CONFIG),
            scheduler_endpoint=values.get(ENV_SCHEDULER, ""),
            sandbox_endpoint=values.get(ENV_SANDBOX, ""),
            sandbox_limits=json.loads(values.get(ENV_SANDBOX_LIMITS) or "{}"),
            checkpoint_dir=values.get(ENV_CHECKPOINT_DIR, ""),
            ray_address=values.get(ENV_RAY_ADDRESS, ""),
            workers=int(values.get(ENV_WORKERS, "1")),
        )


def trainer_patch(status: TrainingRunStatus) -> dict[str, Any]:
    """The merge patch body for a status: only the fields the trainer owns."""
    data = status.model_dump(mode="json", by_alias=True)
    body = {key: data[key] for key in TRAINER_FIELDS}
    if body["phase"] not in TRAINER_PHASES:
        del body["phase"]
    return {"status": body}


class StatusPatcher:
    """Patches the TrainingRun's status subresource (in cluster: the pod's service account)."""

    def __init__(
        self,
        name: str,
        namespace: str,
        server: str = "",
        token: str = "",
        ca_file: str | None = None,
        insecure: bool = False,
        timeout: float = 10.0,
    ) -> None:
        if not server:
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            ca_file = ca_file or str(SA_DIR / "ca.crt")
        self.url = (
            f"{server.rstrip('/')}/apis/{API_VERSION}/namespaces/{namespace}"
            f"/trainingruns/{name}/status"
        )
        self._token = token
        self._context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        if insecure:
            self._context = ssl._create_unverified_context()
        self.timeout = timeout

    @classmethod
    def in_cluster(cls, env: TrainerEnvironment | None = None) -> StatusPatcher:
        env = env or TrainerEnvironment.from_env()
        return cls(env.name, env.namespace)

    def _token_value(self) -> str:
        # Projected tokens rotate: read the file each time.
        if self._token:
            return self._token
        return (SA_DIR / "token").read_text().strip()

    def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={
                "Content-Type": "application/merge-patch+json",
                "Authorization": f"Bearer {self._token_value()}",
                "Accept": "application/json",
            },
        )
        with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result

    def report(self, status: TrainingRunStatus) -> None:
        """Best effort: a failed patch is logged, never raised (training goes on)."""
        try:
            self.patch(trainer_patch(status))
        except (urllib.error.URLError, OSError, ValueError) as error:
            log.warning("status patch failed: %s", error)
