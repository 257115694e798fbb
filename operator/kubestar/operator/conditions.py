"""Conditions that tell the truth (pure): what is wrong with a resource's pods, and the
condition list with transition times kept when nothing changed. Conditions themselves are
built with kubestar.api.conditions.condition, as the trainer builds its own."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubestar.api.conditions import Condition, ConditionType, Reason, condition, now

# Container waiting reasons that mean "this will not start by itself".
IMAGE_REASONS = {
    Reason.IMAGE_PULL_BACK_OFF,
    Reason.ERR_IMAGE_PULL,
    Reason.ERR_IMAGE_NEVER_PULL,
    Reason.INVALID_IMAGE_NAME,
}
STUCK_WAITING = {
    *IMAGE_REASONS,
    Reason.CRASH_LOOP_BACK_OFF,
    Reason.CREATE_CONTAINER_CONFIG_ERROR,
    Reason.CREATE_CONTAINER_ERROR,
    Reason.RUN_CONTAINER_ERROR,
}
# Reasons a kubestar container states itself, as the first word of its termination message
# ("IsolationUnavailable: ..."): more precise than the crash loop or the exit code.
STATED_REASONS = {
    Reason.ISOLATION_UNAVAILABLE,
    Reason.ACCELERATOR_UNAVAILABLE,
    Reason.CHECKPOINT_VOLUME_FULL,
    Reason.TOO_FEW_PROBLEMS,
}
# Stated reasons no retry of the pod can fix: a trainer that states one has failed.
FINAL_REASONS = {
    Reason.CHECKPOINT_VOLUME_FULL,
    Reason.TOO_FEW_PROBLEMS,
    Reason.ACCELERATOR_UNAVAILABLE,
}
# Worst first: the reason a condition shows when several pods have problems.
SEVERITY = [
    Reason.ISOLATION_UNAVAILABLE,
    Reason.ACCELERATOR_UNAVAILABLE,
    Reason.CHECKPOINT_VOLUME_FULL,
    Reason.TOO_FEW_PROBLEMS,
    Reason.OOM_KILLED,
    Reason.CRASH_LOOP_BACK_OFF,
    Reason.IMAGE_PULL_BACK_OFF,
    Reason.ERR_IMAGE_PULL,
    Reason.ERR_IMAGE_NEVER_PULL,
    Reason.INVALID_IMAGE_NAME,
    Reason.CREATE_CONTAINER_CONFIG_ERROR,
    Reason.CREATE_CONTAINER_ERROR,
    Reason.RUN_CONTAINER_ERROR,
    Reason.INSUFFICIENT_GPU,
    Reason.UNSCHEDULABLE,
    Reason.CONTAINER_ERROR,
]
GPU_RESOURCES = ("amd.com/gpu", "nvidia.com/gpu")
# A condition turning False for these reasons is progress, not trouble (Normal events).
QUIET_REASONS = {
    Reason.PROGRESSING,
    Reason.CREATING,
    Reason.WAITING_FOR_DEPENDENCIES,
    Reason.STARTING,
    Reason.SUCCEEDED,
    Reason.FINISHED,
}


@dataclass(frozen=True)
class Problem:
    pod: str
    reason: str
    message: str


# A stated reason's message names what is missing and why: longer than the kubelet's lines.
STATED_MESSAGE_LIMIT = 1000


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def stated_reason(terminated: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) a container wrote in its termination message, if it names one of
    STATED_REASONS."""
    reason, _, message = (terminated.get("message") or "").strip().partition(": ")
    return (reason, message) if reason in STATED_REASONS and message else None


def diagnose_pod(pod: Mapping[str, Any]) -> list[Problem]:
    """Why a pod is not (or will not be) running: a reason its container stated on exit
    (IsolationUnavailable, AcceleratorUnavailable, CheckpointVolumeFull), image pulls, crash
    loops, OOM kills, scheduling (with lack of GPUs named as such)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    problems: list[Problem] = []
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for item in containers:
        cname = item.get("name", "?")
        state = item.get("state") or {}
        last = item.get("lastState") or {}
        waiting = state.get("waiting") or {}
        terminated = state.get("terminated") or {}
        last_terminated = last.get("terminated") or {}
        oom = Reason.OOM_KILLED
        stated = stated_reason(terminated) or stated_reason(last_terminated)
        if stated:
            problems.append(
                Problem(
                    name,
                    stated[0],
                    _short(f"container {cname}: {stated[1]}", limit=STATED_MESSAGE_LIMIT),
                )
            )
        elif terminated.get("reason") == oom or last_terminated.get("reason") == oom:
            problems.append(
                Problem(
                    name,
                    oom,
                    f"container {cname} was killed for using more memory than its limit "
                    f"(restarts: {item.get('restartCount', 0)})",
                )
            )
        elif waiting.get("reason") in STUCK_WAITING:
            message = waiting.get("message") or ""
            if waiting["reason"] == Reason.CRASH_LOOP_BACK_OFF and last_terminated:
                # What the container said as it exited (its termination message), if anything.
                said = (last_terminated.get("message") or "").strip()
                message = (
                    f"last exit code {last_terminated.get('exitCode')}"
                    f" ({last_terminated.get('reason', 'Error')}){': ' + said if said else ''};"
                    f" {message}"
                )
            who = f"container {cname}"
            image = item.get("image") or ""
            # The runtime's pull error often names only the registry: say which image.
            if waiting["reason"] in IMAGE_REASONS and image and image not in message:
                who += f" (image {image})"
            problems.append(Problem(name, waiting["reason"], _short(f"{who}: {message}")))
        elif terminated and terminated.get("exitCode", 0) != 0:
            problems.append(
                Problem(
                    name,
                    Reason.CONTAINER_ERROR,
                    _short(
                        f"container {cname} exited with code {terminated.get('exitCode')}: "
                        f"{terminated.get('reason', '')} {terminated.get('message', '')}"
                    ),
                )
            )
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == Reason.UNSCHEDULABLE
        ):
            message = cond.get("message") or ""
            gpus = [g for g in GPU_RESOURCES if re.search(rf"Insufficient {re.escape(g)}", message)]
            if gpus:
                problems.append(
                    Problem(
                        name,
                        Reason.INSUFFICIENT_GPU,
                        _short(f"no node has a free {', '.join(gpus)}: {message}"),
                    )
                )
            else:
                problems.append(Problem(name, Reason.UNSCHEDULABLE, _short(message)))
    return problems


def diagnose(pods: Iterable[Mapping[str, Any]]) -> list[Problem]:
    problems = [p for pod in pods for p in diagnose_pod(pod)]
    rank: dict[str, int] = {reason: i for i, reason in enumerate(SEVERITY)}
    return sorted(problems, key=lambda p: (rank.get(p.reason, len(rank)), p.pod))


def summarize(problems: list[Problem], limit: int = 3) -> tuple[str, str]:
    """(reason, message) for a condition: the worst problem's reason, up to `limit` lines."""
    if not problems:
        return "", ""
    # Pods failing the same way (every worker of a pool on a node that refuses namespaces)
    # make one line that names them all.
    pods_by_problem: dict[tuple[str, str], list[str]] = {}
    for problem in problems:
        pods_by_problem.setdefault((problem.reason, problem.message), []).append(problem.pod)
    lines = [
        f"pod{'s' if len(pods) > 1 else ''} {', '.join(pods)}: {reason}: {message}".rstrip(": ")
        for (reason, message), pods in list(pods_by_problem.items())[:limit]
    ]
    if len(pods_by_problem) > limit:
        lines.append(f"and {len(pods_by_problem) - limit} more")
    return problems[0].reason, "; ".join(lines)


def ready_replicas(workload: Mapping[str, Any] | None) -> int:
    """A Deployment's or StatefulSet's ready pods (0 when it is absent)."""
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


def ready(
    generation: int,
    replicas: int,
    serving: str | None,
    progress: str,
    pods: Sequence[Mapping[str, Any]],
) -> Condition:
    """The Ready condition of a pool or fleet: False (NoReplicas) when spec.replicas is 0;
    True with the message `serving` once all its pods are ready (`serving` None before);
    else False with what is wrong with its pods, or Progressing with `progress`."""
    if replicas == 0:
        return condition(
            ConditionType.READY, False, Reason.NO_REPLICAS, "spec.replicas is 0", generation
        )
    if serving is not None:
        return condition(ConditionType.READY, True, Reason.READY, serving, generation)
    reason, message = summarize(diagnose(pods))
    if reason:
        return condition(ConditionType.READY, False, reason, message, generation)
    return condition(ConditionType.READY, False, Reason.PROGRESSING, progress, generation)


def merge(
    current: Sequence[Mapping[str, Any]] | None,
    updates: Iterable[Condition],
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    """The condition list (as the API server holds it) after `updates`: lastTransitionTime
    changes only when a condition's status does; conditions not updated are kept as they
    are."""
    stamp = timestamp or now()
    by_type: dict[str, dict[str, Any]] = {c["type"]: dict(c) for c in current or []}
    for update in updates:
        new = update.model_dump(mode="json", by_alias=True)
        old = by_type.get(new["type"])
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            new["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            new["lastTransitionTime"] = stamp
        by_type[new["type"]] = new
    return list(by_type.values())


def find(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None


def transitions(
    before: Iterable[Mapping[str, Any]] | None, after: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Conditions whose status or reason changed (each becomes an Event)."""
    old = {c["type"]: (c.get("status"), c.get("reason")) for c in before or []}
    return [c for c in after if old.get(c["type"]) != (c.get("status"), c.get("reason"))]
