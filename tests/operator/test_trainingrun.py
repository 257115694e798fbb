"""A TrainingRun end to end against a real API server: it waits for its fleet and pool,
starts the trainer Job with a service account that may patch only its own status, takes the
trainer's progress, fails with the reason when the trainer's pod is OOM-killed, refuses spec
changes it cannot apply, and runs several workers as a Job each, meeting at worker 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kubestar.api.conditions import now
from kubestar.api.v1alpha1 import Activity, TrainingMetrics, TrainingRunStatus
from kubestar.cli.main import cli
from kubestar.common.kube import Connection
from kubestar.training.progress import MetricsLog, StatusPatcher, step_progress
from kubestar.training.telemetry import MetricsLogMirror

from e2e.local_cluster import (
    FakeKubelet,
    LocalCluster,
    OperatorProcess,
    apis,
    core,
    kubestar,
    wait_for,
)
from tests.operator.test_reconcile import (
    COMPONENT,
    INSTANCE,
    condition,
    events,
    example,
    owned_by,
    wait_condition,
)


def phase(cluster: LocalCluster, namespace: str, name: str) -> str:
    run = cluster.api().get(kubestar(namespace, "trainingruns", name)) or {}
    return str((run.get("status") or {}).get("phase", ""))


def wait_phase(
    cluster: LocalCluster, namespace: str, name: str, want: str, timeout: float = 20.0
) -> None:
    wait_for(f"{name} phase {want}", lambda: phase(cluster, namespace, name) == want, timeout)


def ready_dependencies(kubelet: FakeKubelet, namespace: str) -> None:
    for instance, components in (
        ("tiny-fleet", ("engine", "scheduler")),
        ("tiny-sandbox", ("sandbox-worker", "sandbox-dispatcher")),
    ):
        for component in components:
            kubelet.make_ready(namespace, f"{INSTANCE}={instance},{COMPONENT}={component}")


def start_run(
    cluster: LocalCluster, kubelet: FakeKubelet, namespace: str, run: dict[str, Any] | None = None
) -> dict[str, Any]:
    api = cluster.api()
    created = api.create(kubestar(namespace, "trainingruns"), run or example("TrainingRun"))
    name = created["metadata"]["name"]
    wait_phase(cluster, namespace, name, "Pending")
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    path = kubestar(namespace, "trainingruns", name)
    wait_for(
        "the fleet's own reason in the run's DependenciesReady",
        lambda: (
            "RolloutFleet tiny-fleet is not ready (Progressing: 0/1 engines ready"
            in (condition(api.get(path), "DependenciesReady") or {}).get("message", "")
        ),
    )
    assert phase(cluster, namespace, name) == "Provisioning"
    assert api.get(apis("batch/v1", namespace, "jobs", f"{name}-trainer")) is None
    ready_dependencies(kubelet, namespace)
    wait_condition(cluster, path, "DependenciesReady", "True")
    return created


def test_run_lifecycle_to_success(
    cluster: LocalCluster,
    operator: OperatorProcess,
    kubelet: FakeKubelet,
    namespace: str,
    tmp_path: Path,
) -> None:
    api = cluster.api()
    run = start_run(cluster, kubelet, namespace)
    job = wait_for(
        "the trainer Job", lambda: api.get(apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer"))
    )
    assert owned_by(job, run)
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "tiny-cpu-trainer"
    env = {e["name"]: e.get("value", "") for e in pod_spec["containers"][0]["env"]}
    assert env["KUBESTAR_SCHEDULER_ENDPOINT"].startswith("tiny-fleet-scheduler.")
    assert env["KUBESTAR_SANDBOX_ENDPOINT"].startswith("tiny-sandbox-sandbox.")
    config = api.get(core(namespace, "configmaps", "tiny-cpu-run"))
    assert config is not None and "groupSize: 4" in config["data"]["run.yaml"]
    # Checkpoints outlive the pod: a claim of the run's own, made with the chart's RBAC.
    claim = api.get(core(namespace, "persistentvolumeclaims", "tiny-cpu-checkpoints"))
    assert claim is not None and owned_by(claim, run)
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "tiny-cpu-checkpoints"
    assert job["spec"]["backoffLimit"] == 6
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    assert json.loads(json.dumps((api.get(path) or {})["status"]["trainer"])) == (
        "Job/tiny-cpu-trainer"
    )

    # The trainer reports with its own service account's token.
    token = cluster.service_account_token(namespace, "tiny-cpu-trainer")
    credentials = Connection(server=cluster.server, token=token, ca_file=cluster.ca_file)
    patcher = StatusPatcher("tiny-cpu", namespace, credentials)
    (trainer_pod,) = kubelet.make_ready(namespace, f"{INSTANCE}=tiny-cpu,{COMPONENT}=trainer")
    wait_condition(cluster, path, "TrainerReady", "True", "Running")
    patcher.patch({"status": {"phase": "SFT"}})
    wait_for(
        "an SFT event",
        lambda: any(reason == "SFT" for _, reason, _ in events(cluster, namespace, "tiny-cpu")),
    )
    patcher.report(
        TrainingRunStatus(
            phase="Training",
            stage="warmup",
            step=3,
            total_steps=6,
            progress=step_progress(3, 6, 125.0, TrainingMetrics(reward=0.25, accuracy=0.5)),
            metrics=TrainingMetrics(reward=0.25, accuracy=0.5),
            last_checkpoint="step-2",
        )
    )
    wait_for("step 3/6", lambda: (api.get(path) or {})["status"].get("stepSummary") == "3/6")
    table = cluster.kubectl("get", "-n", namespace, "tr", "tiny-cpu").stdout.splitlines()
    assert table[0].split()[:8] == [
        *("NAME", "PHASE", "STAGE", "STEP", "REWARD", "ACCURACY", "PROGRESS", "TIME-LEFT")
    ]
    assert table[1].split()[:8] == [
        *("tiny-cpu", "Training", "warmup", "3/6", "0.25", "0.5", "50", "2m5s")
    ]
    status = (api.get(path) or {})["status"]
    assert status["lastCheckpoint"] == "step-2"
    progress = status["progress"]
    assert progress["estimatedRemainingSeconds"] == 125
    assert progress["metrics"] == [
        {"name": "reward", "value": "0.25"},
        {"name": "accuracy", "value": "0.5"},
    ]
    assert progress["lastUpdateTime"].endswith("Z")
    # ... and may touch nothing else: not the spec, not another run.
    other = example("TrainingRun", "other")
    api.create(kubestar(namespace, "trainingruns"), other)
    with pytest.raises(Exception, match="403"):
        StatusPatcher("other", namespace, credentials).patch({"status": {"phase": "Failed"}})
    from e2e.local_cluster import Api, ApiError

    trainer_api = Api(cluster.server, token, cluster.ca_file)
    with pytest.raises(ApiError) as denied:
        trainer_api.merge_patch(path, {"spec": {"trainer": {"workers": 2}}})
    assert denied.value.status == 403

    with pytest.raises(ApiError) as denied:
        trainer_api.merge_patch(core(namespace, "configmaps", "tiny-cpu-run"), {"data": {}})
    assert denied.value.status == 403

    # Rank 0 keeps the metrics log in the ConfigMap the operator made, with its own token.
    log = MetricsLog(tmp_path / "trainer" / "metrics.jsonl")
    log.path.parent.mkdir()
    log.listen(MetricsLogMirror("tiny-cpu", namespace, credentials))
    log.append({"step": 0, "stage": "sft", "loss": 0.5})
    for step in (1, 2, 3):
        log.append({"step": step, "stage": "warmup", "stage_step": step, "reward": step / 4})

    kubelet.set_status(trainer_pod, kubelet.terminated(trainer_pod, 0, "Completed"))
    wait_phase(cluster, namespace, "tiny-cpu", "Succeeded", timeout=30)
    expected = {"Pending", "Provisioning", "TrainerCreated", "SFT", "Training", "Succeeded"}
    wait_for(
        f"events {sorted(expected)}",
        lambda: expected <= {e[1] for e in events(cluster, namespace, "tiny-cpu")},
    )
    # The run's report from the cluster alone, its trainer gone.
    out = tmp_path / "report"
    flags = ["--run", "tiny-cpu", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)]
    done = CliRunner().invoke(cli, ["report", *flags, "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert (out / "metrics.jsonl").read_text() == log.path.read_text()
    report = (out / "report" / "report.md").read_text()
    assert "Phase **Succeeded**" in report and "## RL steps" in report, report
    # One line naming the flag, no traceback.
    command = [sys.executable, "-m", "kubestar.cli.main", "report", "--run", "nothing"]
    missing = subprocess.run([*command, *flags[2:]], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines() == [
        f"kubestar: error: --run nothing: no TrainingRun nothing in namespace {namespace}"
    ], missing.stderr


def test_trainer_oom_fails_the_run(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    # A development run (checkpoints in an emptyDir): a lost pod is not retried.
    development = example("TrainingRun")
    development["spec"]["checkpoint"] = {"ephemeral": True}
    start_run(cluster, kubelet, namespace, development)
    (pod,) = wait_for(
        "the trainer pod",
        lambda: kubelet.pods(namespace, f"{INSTANCE}=tiny-cpu,{COMPONENT}=trainer"),
    )
    kubelet.set_status(pod, kubelet.terminated(pod, 137, "OOMKilled"))
    wait_phase(cluster, namespace, "tiny-cpu", "Failed", timeout=30)
    run = cluster.api().get(kubestar(namespace, "trainingruns", "tiny-cpu"))
    trainer = condition(run, "TrainerReady")
    assert trainer is not None and trainer["reason"] == "OOMKilled"
    assert "BackoffLimitExceeded" in trainer["message"]
    wait_for(
        "a Warning event Failed",
        lambda: ("Warning", "Failed") in {e[:2] for e in events(cluster, namespace, "tiny-cpu")},
    )


def test_a_full_checkpoint_volume_fails_the_run_without_retries(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """On a server without podFailurePolicy (this one) the Job would retry a trainer that
    states CheckpointVolumeFull, and fill the same volume again: the operator fails the run
    at once and scales the Job to no pods."""
    start_run(cluster, kubelet, namespace)
    api = cluster.api()
    job_path = apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer")
    job = wait_for("the trainer Job", lambda: api.get(job_path))
    assert job["spec"]["backoffLimit"] == 6 and job["spec"].get("parallelism", 1) == 1
    (pod,) = wait_for(
        "the trainer pod",
        lambda: kubelet.pods(namespace, f"{INSTANCE}=tiny-cpu,{COMPONENT}=trainer"),
    )
    full = "checkpoint volume full: /ckpt (PersistentVolumeClaim tiny-cpu-checkpoints): ..."
    kubelet.set_status(pod, kubelet.terminated(pod, 28, "Error", f"CheckpointVolumeFull: {full}"))
    wait_phase(cluster, namespace, "tiny-cpu", "Failed", timeout=30)
    trainer = condition(api.get(kubestar(namespace, "trainingruns", "tiny-cpu")), "TrainerReady")
    assert trainer is not None and trainer["reason"] == "CheckpointVolumeFull", trainer
    assert "PersistentVolumeClaim tiny-cpu-checkpoints" in trainer["message"], trainer
    wait_for(
        "the Job scaled to no pods",
        lambda: (api.get(job_path) or {}).get("spec", {}).get("parallelism") == 0,
    )
    wait_for(
        "a TrainerStopped event",
        lambda: "TrainerStopped" in {e[1] for e in events(cluster, namespace, "tiny-cpu")},
    )


def test_spec_changes_are_refused_while_running(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    api = cluster.api()
    start_run(cluster, kubelet, namespace)
    job_path = apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer")
    job = wait_for("the trainer Job", lambda: api.get(job_path))
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    api.merge_patch(path, {"spec": {"algorithm": {"groupSize": 8}}})
    refused = wait_condition(cluster, path, "SpecAccepted", "False", "SpecChangeRefused")
    assert "spec.algorithm.groupSize" in refused["message"]
    run = api.get(path) or {}
    assert refused["observedGeneration"] == run["metadata"]["generation"]
    config = api.get(core(namespace, "configmaps", "tiny-cpu-run")) or {}
    assert "groupSize: 4" in config["data"]["run.yaml"]
    now = api.get(job_path) or {}  # the same Job, its spec untouched
    assert now["metadata"]["uid"] == job["metadata"]["uid"]
    assert now["metadata"].get("generation") == job["metadata"].get("generation")
    assert now["spec"]["template"] == job["spec"]["template"]
    api.merge_patch(path, {"spec": {"algorithm": {"groupSize": 4}}})
    wait_condition(cluster, path, "SpecAccepted", "True")


def multi_worker_run(name: str, claim: str | None) -> dict[str, Any]:
    run = example("TrainingRun", name)
    run["spec"]["trainer"]["workers"] = 2
    if claim:
        run["spec"]["checkpoint"] = {"pvcClaimName": claim}
    return run


def test_several_workers_need_one_checkpoint_volume(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """Every rank writes its checkpoint shard: without a volume all pods mount, the spec is
    refused with a message naming the field, and no Job starts."""
    api = cluster.api()
    api.create(kubestar(namespace, "trainingruns"), multi_worker_run("alone", None))
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    ready_dependencies(kubelet, namespace)
    path = kubestar(namespace, "trainingruns", "alone")
    refused = wait_condition(cluster, path, "SpecAccepted", "False", "InvalidSpec")
    assert "spec.trainer.workers is 2" in refused["message"]
    assert "pvcClaimName" in refused["message"]
    assert phase(cluster, namespace, "alone") == "Pending"
    assert api.get(apis("batch/v1", namespace, "jobs", "alone-trainer")) is None


def test_several_workers_make_a_job_each_and_meet_at_worker_0(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """trainer.workers 2: two Jobs (worker 0 and 1) with their place in the world, a
    headless Service for worker 0's pod, its address in the run's status (for clusters
    without DNS), and a run that fails when worker 1 does."""
    api = cluster.api()
    api.create(kubestar(namespace, "trainingruns"), multi_worker_run("multi", "shared"))
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    ready_dependencies(kubelet, namespace)

    def job(name: str) -> dict[str, Any]:
        return wait_for(name, lambda: api.get(apis("batch/v1", namespace, "jobs", name)))

    jobs = [job("multi-trainer"), job("multi-trainer-1")]
    environments = [
        {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        for job in jobs
    ]
    assert [env["KUBESTAR_TRAINER_WORKER_INDEX"] for env in environments] == ["0", "1"]
    assert {env["KUBESTAR_TRAINER_WORKERS"] for env in environments} == {"2"}
    rendezvous = {env["KUBESTAR_TRAINER_RENDEZVOUS"] for env in environments}
    assert rendezvous == {f"multi-trainer.{namespace}.svc.cluster.local:29500"}
    service = api.get(core(namespace, "services", "multi-trainer")) or {}
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"]["kubestar.dev/trainer-worker"] == "0"
    path = kubestar(namespace, "trainingruns", "multi")
    status = wait_for("status.trainer", lambda: (api.get(path) or {}).get("status", {}))
    assert status["trainer"] == "Job/multi-trainer,Job/multi-trainer-1"
    assert status["worldSize"] == 2

    selector = f"{INSTANCE}=multi,{COMPONENT}=trainer"
    wait_for("both trainer pods", lambda: len(kubelet.pods(namespace, selector)) == 2)
    # Without cluster DNS, the other workers read worker 0's address from the run's status,
    # with the trainer's own service account.
    token = cluster.service_account_token(namespace, "multi-trainer")
    credentials = Connection(server=cluster.server, token=token, ca_file=cluster.ca_file)
    trainer_view = StatusPatcher("multi", namespace, credentials)
    assert not trainer_view.current().get("rendezvousAddress")
    kubelet.make_ready(namespace, f"{selector},kubestar.dev/trainer-worker=0")
    assert (
        wait_for(
            "worker 0's address in status.rendezvousAddress",
            lambda: trainer_view.current().get("rendezvousAddress"),
        )
        == "127.0.0.1"  # the fake kubelet's pod address
    )
    wait_condition(cluster, path, "TrainerReady", "False", "Starting")
    kubelet.make_ready(namespace, f"{selector},kubestar.dev/trainer-worker=1")
    ready = wait_condition(cluster, path, "TrainerReady", "True", "Running")
    assert ready["message"] == "2 of 2 trainer pods running"
    # Checkpoints outlive the pods (the run's claim): a failed pod is retried, and the run
    # fails only once a worker's Job gives up.
    assert all(job["spec"]["backoffLimit"] == 6 for job in jobs)
    api.merge_patch(
        apis("batch/v1", namespace, "jobs", "multi-trainer-1") + "/status",
        {
            "status": {
                "conditions": [
                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
                ]
            }
        },
    )
    wait_phase(cluster, namespace, "multi", "Failed", timeout=30)
    failed = condition(api.get(path), "TrainerReady") or {}
    assert failed["message"].startswith("worker 1: trainer Job failed")


def test_a_new_run_ignores_the_trainer_job_of_an_earlier_one(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """A run deleted and created again under the same name: the earlier run's failed trainer
    Job, not yet garbage-collected, neither fails the new run nor passes for its trainer."""
    api = cluster.api()
    jobs = apis("batch/v1", namespace, "jobs")
    labels = {INSTANCE: "tiny-cpu", COMPONENT: "trainer", "kubestar.dev/owner-kind": "TrainingRun"}
    api.create(
        jobs,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "tiny-cpu-trainer", "labels": labels},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "trainer", "image": "kubestar:0.1.0"}],
                    },
                },
            },
        },
    )
    api.merge_patch(
        f"{jobs}/tiny-cpu-trainer/status",
        {
            "status": {
                "conditions": [
                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
                ]
            }
        },
    )
    run = api.create(kubestar(namespace, "trainingruns"), example("TrainingRun"))
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    ready_dependencies(kubelet, namespace)
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    conflict = wait_condition(cluster, path, "TrainerReady", "False", "ChildConflict")
    assert "not owned by TrainingRun tiny-cpu" in conflict["message"]
    assert phase(cluster, namespace, "tiny-cpu") == "Provisioning"
    # Once the old Job is gone, this run's own trainer starts.
    api.delete(f"{jobs}/tiny-cpu-trainer")

    def own_job() -> dict[str, Any] | None:
        job = api.get(f"{jobs}/tiny-cpu-trainer")
        return job if job is not None and owned_by(job, run) else None

    job = wait_for("the run's own trainer Job", own_job, timeout=60)
    assert not (job.get("status") or {}).get("conditions")
    wait_condition(cluster, path, "TrainerReady", "False", "Starting")
    assert phase(cluster, namespace, "tiny-cpu") == "Provisioning"


def test_a_service_account_of_the_trainers_name_is_not_adopted(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """Someone's own ServiceAccount named <run>-trainer: the operator neither takes it over
    nor starts the trainer under it; the run says which object is in the way."""
    api = cluster.api()
    accounts = core(namespace, "serviceaccounts")
    api.create(
        accounts,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tiny-cpu-trainer"}},
    )
    api.create(kubestar(namespace, "trainingruns"), example("TrainingRun"))
    api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    api.create(kubestar(namespace, "rolloutfleets"), example("RolloutFleet"))
    ready_dependencies(kubelet, namespace)
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    conflict = wait_condition(cluster, path, "SpecAccepted", "False", "ChildConflict")
    assert "ServiceAccount tiny-cpu-trainer exists and is not owned by" in conflict["message"]
    wait_condition(cluster, path, "DependenciesReady", "True")
    account = api.get(f"{accounts}/tiny-cpu-trainer") or {}
    assert not account["metadata"].get("ownerReferences"), account["metadata"]
    assert api.get(apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer")) is None


def test_a_trainer_pod_refused_by_the_api_server_is_a_condition(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """A quota refuses the trainer's pod: the run says so (FailedCreate, with the API
    server's reason) instead of staying Starting without a word."""
    api = cluster.api()
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-accelerators"},
        "spec": {"hard": {"requests.example.com/accelerator": "0"}},
    }
    api.create(core(namespace, "resourcequotas"), quota)
    run = example("TrainingRun")
    accelerator = {"example.com/accelerator": 1}
    run["spec"]["trainer"]["resources"] = {"requests": accelerator, "limits": accelerator}
    start_run(cluster, kubelet, namespace, run)
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    refused = wait_condition(cluster, path, "TrainerReady", "False", "FailedCreate", timeout=60)
    assert "exceeded quota: no-accelerators" in refused["message"], refused["message"]
    assert phase(cluster, namespace, "tiny-cpu") == "Provisioning"


def test_a_trainer_whose_activity_does_not_move_on_is_stalled(
    cluster: LocalCluster, operator: OperatorProcess, kubelet: FakeKubelet, namespace: str
) -> None:
    """The watchdog: the trainer reports what it does and waits on; when that has not
    changed for spec.resilience.stallSeconds the run's Stalled condition turns True naming
    it, and False once the trainer moves on."""
    run = example("TrainingRun")
    run["spec"]["resilience"] = {"stallSeconds": 10}
    start_run(cluster, kubelet, namespace, run)
    path = kubestar(namespace, "trainingruns", "tiny-cpu")
    kubelet.make_ready(namespace, f"{INSTANCE}=tiny-cpu,{COMPONENT}=trainer")
    wait_condition(cluster, path, "TrainerReady", "True", "Running")
    token = cluster.service_account_token(namespace, "tiny-cpu-trainer")
    credentials = Connection(server=cluster.server, token=token, ca_file=cluster.ca_file)
    patcher = StatusPatcher("tiny-cpu", namespace, credentials)
    waiting_on = "the rollout scheduler tiny-fleet-scheduler:50061"
    rolling_out = Activity(what="rolling out step 4", waiting_on=waiting_on, since=now())
    patcher.report(TrainingRunStatus(phase="Training", step=3, activity=rolling_out))
    moving = wait_condition(cluster, path, "Stalled", "False", "MakingProgress")
    assert moving["message"] == f"rolling out step 4, waiting on {waiting_on}"
    stalled = wait_condition(cluster, path, "Stalled", "True", "NoProgress", timeout=40)
    assert "spec.resilience.stallSeconds is 10" in stalled["message"]
    assert stalled["message"].endswith(f"rolling out step 4, waiting on {waiting_on}")
    updating = Activity(what="updating the policy on step 4", waiting_on="the trainer")
    patcher.report(TrainingRunStatus(phase="Training", step=3, activity=updating))
    wait_condition(cluster, path, "Stalled", "False", "MakingProgress")
