"""Pod diagnosis, conditions and the TrainingRun's phase decisions (pure)."""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any, cast

import pytest
from kubestar.api import conditions, trainer_contract
from kubestar.api.conditions import (
    TERMINAL_PHASES,
    TRAINER_PHASES,
    ConditionType,
    Phase,
    Reason,
    condition,
)
from kubestar.api.v1alpha1 import (
    RolloutFleetSpec,
    SandboxPoolSpec,
    TrainingRunSpec,
    TrainingRunStatus,
)
from kubestar.operator import conditions as cond
from kubestar.operator import reconciler, rolloutfleet
from kubestar.operator import trainingrun as tr
from kubestar.operator.reconciler import Context, EngineProbe, SchedulerProbe, status_fields
from kubestar.operator.rolloutfleet import fleet_status
from kubestar.operator.sandboxpool import pool_status
from kubestar.operator.settings import OperatorSettings
from kubestar.sandbox.executor import IsolationUnavailable
from kubestar.training import progress

from tests.operator.support import parent


def pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {}}, "status": status}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {
        "name": "main",
        "state": {"waiting": {"reason": reason, "message": message}},
        "restartCount": 3,
    }


def test_image_pull_backoff_is_named() -> None:
    problems = cond.diagnose(
        [
            pod(
                "p",
                containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "nope:1"')],
            )
        ]
    )
    assert [p.reason for p in problems] == ["ImagePullBackOff"]
    reason, message = cond.summarize(problems)
    assert reason == "ImagePullBackOff"
    assert message == 'pod p: ImagePullBackOff: container main: Back-off pulling image "nope:1"'
    # A pull error that names only the registry gets the image from the container's status.
    status = waiting("ErrImagePull", 'Get "http://127.0.0.1:9/v2/": connection refused')
    status["image"] = "127.0.0.1:9/team/engine:1"
    (problem,) = cond.diagnose([pod("p", containerStatuses=[status])])
    assert problem.message.startswith("container main (image 127.0.0.1:9/team/engine:1): Get "), (
        problem.message
    )


def test_crash_loop_reports_the_last_exit() -> None:
    status = waiting("CrashLoopBackOff", "back-off 40s restarting failed container")
    status["lastState"] = {"terminated": {"exitCode": 2, "reason": "Error"}}
    (problem,) = cond.diagnose([pod("p", containerStatuses=[status])])
    assert problem.reason == "CrashLoopBackOff"
    assert "last exit code 2" in problem.message


def test_oom_killed_wins_over_crash_loop() -> None:
    status = waiting("CrashLoopBackOff")
    status["lastState"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    other = pod("q", containerStatuses=[waiting("CrashLoopBackOff")])
    problems = cond.diagnose([other, pod("p", containerStatuses=[status])])
    assert problems[0].reason == "OOMKilled" and problems[0].pod == "p"


def test_pending_for_lack_of_gpus() -> None:
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient amd.com/gpu.",
    }
    (problem,) = cond.diagnose([pod("engine-0", conditions=[unschedulable])])
    assert problem.reason == "InsufficientGPU"
    assert "amd.com/gpu" in problem.message
    cpu_only = dict(unschedulable, message="0/1 nodes are available: 1 Insufficient cpu.")
    (problem,) = cond.diagnose([pod("x", conditions=[cpu_only])])
    assert problem.reason == "Unschedulable"


def test_healthy_pods_have_no_problems() -> None:
    running = {"name": "main", "state": {"running": {}}, "ready": True}
    ready = {"type": "Ready", "status": "True"}
    assert cond.diagnose([pod("p", containerStatuses=[running], conditions=[ready])]) == []


def test_transition_time_kept_when_status_unchanged() -> None:
    ready = ConditionType.READY
    first = cond.merge([], [condition(ready, False, Reason.PROGRESSING)], "t1")
    same = cond.merge(first, [condition(ready, False, Reason.IMAGE_PULL_BACK_OFF, "x")], "t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "ImagePullBackOff"
    assert same[0] == {
        "type": "Ready",
        "status": "False",
        "reason": "ImagePullBackOff",
        "message": "x",
        "lastTransitionTime": "t1",
        "observedGeneration": 0,
    }
    flipped = cond.merge(same, [condition(ready, True, Reason.READY)], "t3")
    assert flipped[0]["lastTransitionTime"] == "t3"
    assert cond.transitions(same, flipped) == flipped


def test_pool_status_counts_capacity_and_surfaces_problems() -> None:
    body = parent("SandboxPool", "pool")
    spec = SandboxPoolSpec(replicas=2, executors_per_pod=4)
    workers = {"status": {"readyReplicas": 2}}
    dispatcher = {"status": {"readyReplicas": 1}}
    status, ready = pool_status(body, spec, workers, dispatcher, [], OperatorSettings())
    assert status.capacity == 8 and ready.status == "True"
    bad = pod("pool-sandbox-worker-1", containerStatuses=[waiting("ImagePullBackOff")])
    status, ready = pool_status(
        body, spec, {"status": {"readyReplicas": 1}}, dispatcher, [bad], OperatorSettings()
    )
    assert ready.status == "False" and ready.reason == "ImagePullBackOff"
    assert status.ready_replicas == 1 and status.capacity == 4


# A worker's termination message as `kubestar sandbox serve --termination-log` writes it.
REFUSED = (
    "sandbox isolation unavailable (worker/executor-0, as uid 65532): user and network "
    "namespaces (without them calls reach the network): unshare(CLONE_NEWUSER|CLONE_NEWNET) "
    "failed: EPERM (Operation not permitted): refused by a seccomp profile"
)


def test_a_worker_that_cannot_isolate_names_what_is_missing() -> None:
    crash_loop = waiting("CrashLoopBackOff", "back-off 20s restarting failed container")
    crash_loop["name"] = "worker"
    crash_loop["lastState"] = {
        "terminated": {
            "exitCode": 1,
            "reason": "Error",
            "message": f"{IsolationUnavailable.reason}: {REFUSED}\n",
        }
    }
    just_exited = {
        "name": "worker",
        "state": {"terminated": {"exitCode": 1, "message": f"IsolationUnavailable: {REFUSED}"}},
    }
    oom = waiting("CrashLoopBackOff")
    oom["lastState"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    pods = [
        pod("pool-sandbox-worker-0", containerStatuses=[crash_loop]),
        pod("pool-sandbox-worker-1", containerStatuses=[just_exited]),
        pod("pool-sandbox-worker-2", containerStatuses=[oom]),
    ]
    spec = SandboxPoolSpec(replicas=3)
    status, ready = pool_status(
        parent("SandboxPool", "pool"),
        spec,
        {"status": {"readyReplicas": 0}},
        {"status": {"readyReplicas": 1}},
        pods,
        OperatorSettings(),
    )
    assert (ready.status, ready.reason) == ("False", Reason.ISOLATION_UNAVAILABLE)
    assert IsolationUnavailable.reason == Reason.ISOLATION_UNAVAILABLE  # the worker's word
    # Workers failing the same way are one line; the worker's own words, whole.
    first, second = ready.message.split("; ")[:2]
    assert first == (
        "pods pool-sandbox-worker-0, pool-sandbox-worker-1: IsolationUnavailable: "
        f"container worker: {REFUSED}"
    )
    assert second.startswith("pod pool-sandbox-worker-2: OOMKilled: ")
    assert status.isolation == "Required" and status.capacity == 0
    # A termination message that names no reason kubestar states stays a crash loop, and
    # the message is passed on.
    crash_loop["lastState"]["terminated"]["message"] = "127.0.0.1:50052: port in use\n"
    (problem,) = cond.diagnose([pod("p", containerStatuses=[crash_loop])])
    assert problem.reason == Reason.CRASH_LOOP_BACK_OFF
    assert "last exit code 1 (Error): 127.0.0.1:50052: port in use; back-off" in problem.message


def test_pool_without_isolation_says_so() -> None:
    spec = SandboxPoolSpec.model_validate({"isolation": "Disabled"})
    status, ready = pool_status(
        parent("SandboxPool", "pool"),
        spec,
        {"status": {"readyReplicas": 1}},
        {"status": {"readyReplicas": 1}},
        [],
        OperatorSettings(),
    )
    assert ready.status == "True" and "calls are not isolated" in ready.message
    assert status.isolation == "Disabled"


def test_fleet_status_reports_engines_and_kv_capacity() -> None:
    body = parent("RolloutFleet", "f")
    spec = RolloutFleetSpec(replicas=2)
    ready_cond = {"type": "Ready", "status": "True"}
    engines = [
        {
            "metadata": {
                "name": f"f-engine-{i}",
                "labels": {"app.kubernetes.io/component": "engine"},
            },
            "status": {"conditions": [ready_cond]},
        }
        for i in range(2)
    ]
    # On the host's network each engine is a Deployment of its own: their ready pods add up.
    status, ready = fleet_status(
        body,
        spec,
        [{"status": {"readyReplicas": 1}}, {"status": {"readyReplicas": 1}}],
        {"status": {"readyReplicas": 1}},
        engines,
        {"f-engine-0": EngineProbe(4096, 0.25), "f-engine-1": EngineProbe(8192, 0.0)},
        OperatorSettings(),
    )
    assert ready.status == "True"
    assert status.kv_capacity_tokens == 12288
    # As written: what the scheduler did not report is left out.
    assert status_fields(status)["engines"][0] == {
        "name": "f-engine-0",
        "ready": True,
        "kvCapacityTokens": 4096,
        "kvUsage": 0.25,
    }
    # The scheduler took one out (its reload hung): named, and the fleet still serves.
    stuck = "loading weights v3 from /w did not finish in 600 s"
    probes = {"f-engine-0": EngineProbe(4096, 0.25), "f-engine-1": EngineProbe(8192, 0.0, stuck)}
    status, ready = fleet_status(
        body,
        spec,
        [{"status": {"readyReplicas": 2}}],
        {"status": {"readyReplicas": 1}},
        engines,
        probes,
        OperatorSettings(),
    )
    assert (ready.status, ready.reason) == ("True", "EnginesTakenOut")
    assert ready.message == f"taken out by the scheduler: f-engine-1: {stuck}"
    assert status.engines[1].taken_out == stuck
    # Both out: the fleet does not serve.
    probes["f-engine-0"] = EngineProbe(4096, 0.25, stuck)
    _, ready = fleet_status(
        body,
        spec,
        [{"status": {"readyReplicas": 2}}],
        {"status": {"readyReplicas": 1}},
        engines,
        probes,
        OperatorSettings(),
    )
    assert (ready.status, ready.reason) == ("False", "EnginesTakenOut")


def test_the_fleet_reports_the_weights_served() -> None:
    served = SchedulerProbe({}, 4, "/c/weights/v000004")
    restarted = SchedulerProbe({}, 0, "")
    recorded = {"version": 3, "path": "/c/weights/v000003"}
    # What the scheduler serves wins; a scheduler that serves nothing, or is not asked,
    # leaves the record as it is.
    assert rolloutfleet.served_weights(recorded, served) == {"version": 4, "path": served[2]}
    assert rolloutfleet.served_weights(recorded, restarted) == recorded
    assert rolloutfleet.served_weights(recorded, None) == recorded
    assert rolloutfleet.served_weights(None, restarted) is None


SPEC = TrainingRunSpec.model_validate(
    {
        "rolloutFleetRef": {"name": "f"},
        "sandboxPoolRef": {"name": "p"},
        "stages": [
            {
                "name": "s",
                "maxResponseTokens": 64,
                "steps": 1,
                "dataset": {"generator": "basic_arithmetic"},
            }
        ],
    }
)


def ready_obj(kind: str, name: str, ok: bool, reason: str = "Ready") -> dict[str, Any]:
    body = parent(kind, name)
    ready = condition(ConditionType.READY, ok, reason, "why")
    body["status"] = {"conditions": [ready.model_dump(mode="json", by_alias=True)]}
    return body


def test_dependencies() -> None:
    deps, exist = tr.dependencies(SPEC, "team", None, ready_obj("SandboxPool", "p", True), 1)
    assert not exist and deps.reason == "RolloutFleetNotFound"
    deps, exist = tr.dependencies(
        SPEC,
        "team",
        ready_obj("RolloutFleet", "f", False, "InsufficientGPU"),
        ready_obj("SandboxPool", "p", True),
        1,
    )
    assert exist and deps.reason == "RolloutFleetNotReady"
    assert "InsufficientGPU" in deps.message
    deps, _ = tr.dependencies(
        SPEC, "team", ready_obj("RolloutFleet", "f", True), ready_obj("SandboxPool", "p", True), 1
    )
    assert deps.status == "True"


def test_phase_decisions() -> None:
    ok = condition(ConditionType.DEPENDENCIES_READY, True, Reason.READY)
    waiting_deps = condition(
        ConditionType.DEPENDENCIES_READY, False, Reason.ROLLOUT_FLEET_NOT_READY
    )
    absent = tr.Outcome("absent")
    assert tr.decide("Pending", 1, None, waiting_deps, False, absent).phase == "Pending"
    decision = tr.decide("Pending", 1, None, waiting_deps, True, absent)
    assert decision.phase == "Provisioning" and not decision.start
    decision = tr.decide("Provisioning", 1, None, ok, True, absent)
    assert decision.start and decision.phase == "Provisioning"
    # The trainer's own phases are kept while its workload runs.
    running = tr.Outcome("running", "Running")
    assert tr.decide("Training", 1, None, ok, True, running).phase == "Training"
    failed = tr.Outcome("failed", "OOMKilled", "trainer Job failed")
    decision = tr.decide("Training", 1, None, ok, True, failed)
    assert decision.phase == "Failed"
    trainer = next(c for c in decision.conditions if c.type == "TrainerReady")
    assert trainer.reason == "OOMKilled"
    # Terminal phases stick; nothing is started again.
    decision = tr.decide("Succeeded", 1, None, ok, True, absent)
    assert decision.phase == "Succeeded" and not decision.start
    refused = ("SpecChangeRefused", "cannot change spec.algorithm.groupSize")
    decision = tr.decide("Training", 2, refused, ok, True, running)
    assert decision.phase == "Training"
    assert decision.conditions[0].reason == "SpecChangeRefused"


def test_a_trainer_that_reported_failed_is_given_time_to_say_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer reports Failed, then exits writing why in its termination message. Its Job
    is not scaled to no pods (which would kill it first) while its pod still runs, for up
    to TRAINER_EXIT_GRACE_SECONDS; once the pod has failed, TrainerReady carries its words."""
    ok = condition(ConditionType.DEPENDENCIES_READY, True, Reason.READY)
    run = {"metadata": {"namespace": "team", "name": "r", "generation": 1}}
    job = {"metadata": {"uid": "u", "name": "r-trainer"}, "status": {"active": 1}}
    owner = {"ownerReferences": [{"uid": "u"}]}
    running = {"metadata": {"name": "r-trainer-x", **owner}, "status": {"phase": "Running"}}
    observed = tr.Observed(accepted=None, job_names=["r-trainer"], jobs=[job], pods=[running])
    ctx = Context(kube=cast(Any, None), settings=OperatorSettings())
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    # Still exiting: the run is over, the Job is left alone.
    decision = tr.decide("Failed", 1, None, ok, True, tr.workers_outcome([job], [running]))
    trainer = next(c for c in decision.conditions if c.type == "TrainerReady")
    assert (decision.phase, trainer.reason) == ("Failed", Reason.FINISHED)
    assert tr.trainer_exiting(ctx, run, observed)
    clock[0] += tr.TRAINER_EXIT_GRACE_SECONDS - 1
    assert tr.trainer_exiting(ctx, run, observed)
    # A trainer that does not exit in time is stopped.
    clock[0] += 2
    assert not tr.trainer_exiting(ctx, run, observed)

    # It exited stating why: the reason shows, and the Job may be scaled (no retry).
    message = "checkpoint volume full: /ckpt (PersistentVolumeClaim full): 1 KiB free"
    failed = {
        "metadata": {"name": "r-trainer-x", **owner},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {
                            "exitCode": 28,
                            "message": f"CheckpointVolumeFull: {message}\n",
                        }
                    },
                }
            ],
        },
    }
    ctx.exiting.clear()
    exited = tr.Observed(accepted=None, job_names=["r-trainer"], jobs=[job], pods=[failed])
    assert not tr.trainer_exiting(ctx, run, exited)
    decision = tr.decide("Failed", 1, None, ok, True, tr.workers_outcome([job], [failed]))
    trainer = next(c for c in decision.conditions if c.type == "TrainerReady")
    assert (trainer.status, trainer.reason) == ("False", "CheckpointVolumeFull")
    assert message in trainer.message


def test_job_outcomes() -> None:
    assert tr.job_outcome(None, []).state == "absent"
    assert tr.job_outcome({"status": {"active": 1}}, []).state == "starting"
    complete = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert tr.job_outcome(complete, []).state == "succeeded"
    failed = {
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
        }
    }
    oom = pod(
        "t",
        containerStatuses=[
            {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
        ],
    )
    outcome = tr.job_outcome(failed, [oom])
    assert outcome.state == "failed" and outcome.reason == "OOMKilled"
    assert "BackoffLimitExceeded" in outcome.message


def test_admission_keeps_the_spec_the_trainer_started_with() -> None:
    settings = OperatorSettings()
    accepted = SPEC.model_dump(mode="json", by_alias=True)
    job = {"metadata": {"name": "r-trainer", "uid": "j"}}
    never = tr.Observed(None, ["r-trainer"], [None])
    running = tr.Observed(accepted, ["r-trainer"], [job])
    invalid = (Reason.INVALID_SPEC, "spec.stages: required")
    # Invalid and never started: nothing to go on with.
    assert tr.admitted_spec(invalid, never, settings) == tr.Admission(None, invalid)
    # Invalid, or changed, once the trainer runs: refused, and the run keeps its spec.
    kept = tr.admitted_spec(invalid, running, settings)
    assert kept.spec == SPEC and kept.problem is not None
    assert kept.problem[1].endswith("(the trainer keeps the spec it started with)")
    changed = SPEC.model_copy(
        update={"algorithm": SPEC.algorithm.model_copy(update={"group_size": 8})}
    )
    refused = tr.admitted_spec(changed, running, settings)
    assert refused.spec == SPEC and refused.problem is not None
    assert refused.problem[0] == Reason.SPEC_CHANGE_REFUSED
    assert "spec.algorithm.groupSize" in refused.problem[1]
    assert tr.admitted_spec(SPEC, running, settings) == tr.Admission(SPEC)
    assert tr.admitted_spec(SPEC, never, settings) == tr.Admission(SPEC)


def test_the_run_status_names_the_trainer_once_it_exists() -> None:
    run = parent("TrainingRun", "r")
    run["status"] = {"step": 3, "totalSteps": 12}
    never = tr.Observed(None, ["r-trainer"], [None])
    # As written: camelCase, the trainer's fields only once there is a trainer.
    assert status_fields(tr.run_status(run, Phase.PENDING, SPEC, never)) == {
        "phase": "Pending",
        "observedGeneration": 1,
        "stepSummary": "3/12",
    }
    created = tr.run_status(run, Phase.PROVISIONING, SPEC, never, started=True)
    assert status_fields(created) == {
        "phase": "Provisioning",
        "observedGeneration": 1,
        "stepSummary": "3/12",
        "trainer": "Job/r-trainer",
        "worldSize": 1,
    }


def test_spec_diff_paths() -> None:
    old = SPEC.model_dump(mode="json", by_alias=True)
    new = SPEC.model_copy(
        update={"algorithm": SPEC.algorithm.model_copy(update={"group_size": 8})}
    ).model_dump(mode="json", by_alias=True)
    assert tr.diff_paths(old, new) == ["spec.algorithm.groupSize"]
    assert tr.step_summary({"step": 3, "totalSteps": 10}) == "3/10"
    assert tr.step_summary({}) == ""


# --- One status vocabulary for the operator and the trainer --------------------------------

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "protos" / "kubestar" / "api"
OPERATOR_DIR = ROOT / "operator" / "kubestar" / "operator"
TRAINING_DIR = ROOT / "training" / "kubestar" / "training"
# Words Kubernetes uses too (a Pod's Ready condition, a Job's Failed, a kubelet's waiting
# reasons): the operator compares Kubernetes' own fields with them, so literals are fine there.
KUBERNETES_WORDS = {"Ready", "Failed", "Succeeded", "Running", "Pending", *cond.SEVERITY}


def sources() -> list[Path]:
    return sorted([*API_DIR.glob("*.py"), *OPERATOR_DIR.glob("*.py"), *TRAINING_DIR.glob("*.py")])


def test_one_condition_helper_for_the_operator_and_the_trainer() -> None:
    defined = [
        path.relative_to(ROOT)
        for path in sources()
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "condition"
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert defined == [Path("protos/kubestar/api/conditions.py")]
    # The trainer's progress reporting and the operator's reconcilers use that one.
    for module in (progress, tr, cond, reconciler, rolloutfleet):
        assert vars(module)["condition"] is conditions.condition, module.__name__


def test_no_status_words_spelled_out_in_the_operator_or_the_trainer() -> None:
    """Phases, condition types and reasons are written with kubestar.api's constants."""
    own = {str(word) for enum in (Phase, ConditionType, Reason) for word in enum}
    own -= {str(word) for word in KUBERNETES_WORDS}
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for path in sources()
        if path.name != "conditions.py" or path.parent != API_DIR
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in own
    ]
    assert found == []


def test_phases_are_owned_by_the_operator_or_the_trainer() -> None:
    operator_phases = {Phase.PENDING, Phase.PROVISIONING}
    assert operator_phases | TRAINER_PHASES == set(Phase)
    assert not operator_phases & TRAINER_PHASES
    assert TERMINAL_PHASES <= TRAINER_PHASES
    # The trainer's status patches carry its own phases only.
    for phase in Phase:
        patch = trainer_contract.trainer_patch(TrainingRunStatus(phase=phase))["status"]
        assert ("phase" in patch) == (phase in TRAINER_PHASES), phase


def test_the_trainer_reports_phases_as_the_operator_reads_conditions() -> None:
    status = TrainingRunStatus()
    progress.set_phase(status, Phase.TRAINING, Reason.TRAINING, "GRPO-RoC stages")
    (progressing,) = status.conditions
    assert (progressing.type, progressing.status) == ("Progressing", "True")
    progress.set_phase(status, Phase.FAILED, Reason.TRAINER_ERROR, "RuntimeError: boom")
    (progressing,) = status.conditions
    assert (progressing.status, progressing.reason) == ("False", "TrainerError")
    assert progressing.last_transition_time
    assert trainer_contract.trainer_patch(status)["status"]["phase"] == "Failed"
    merged = cond.merge([], status.conditions, "t1")
    assert cond.find(merged, ConditionType.PROGRESSING) == {
        "type": "Progressing",
        "status": "False",
        "reason": "TrainerError",
        "message": "RuntimeError: boom",
        "lastTransitionTime": "t1",
        "observedGeneration": 0,
    }


def test_workers_outcome() -> None:
    """Several trainer Jobs: one failed fails the run (naming the worker), all completed
    succeed it, and it runs only when every worker runs."""

    def job(uid: str, **status: Any) -> dict[str, Any]:
        return {"metadata": {"uid": uid}, "status": status}

    def pod(owner: str, ready: bool) -> dict[str, Any]:
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        return {
            "metadata": {"ownerReferences": [{"uid": owner}]},
            "status": {"phase": "Running", "conditions": [condition]},
        }

    complete = [{"type": "Complete", "status": "True"}]
    failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
    assert tr.workers_outcome([None, None], []).state == "absent"
    assert tr.workers_outcome([job("a"), None], [pod("a", True)]).state == "starting"
    both = [job("a"), job("b")]
    running = tr.workers_outcome(both, [pod("a", True), pod("b", True)])
    assert running.state == "running" and running.message == "2 of 2 trainer pods running"
    assert tr.workers_outcome(both, [pod("a", True), pod("b", False)]).state == "starting"
    broken = tr.workers_outcome([job("a"), job("b", conditions=failed)], [pod("a", True)])
    assert broken.state == "failed" and broken.message.startswith("worker 1: trainer Job failed")
    done = tr.workers_outcome([job("a", conditions=complete), job("b", conditions=complete)], [])
    assert done.state == "succeeded"
    half = tr.workers_outcome([job("a", conditions=complete), job("b")], [pod("b", True)])
    assert half.state == "running" and half.message == "1 of 2 trainer pods running"


def test_a_refused_pod_is_the_outcome_only_while_the_job_has_none() -> None:
    job = {"metadata": {"uid": "a", "name": "r-trainer"}, "status": {}}
    refused = {"r-trainer": 'pods "r-trainer-x" is forbidden: exceeded quota: q'}
    outcome = tr.workers_outcome([job], [], refused)
    assert outcome.reason == "FailedCreate" and "exceeded quota: q" in outcome.message
    pod = {
        "metadata": {"ownerReferences": [{"uid": "a"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert tr.workers_outcome([job], [pod], refused).state == "running"  # an old event
