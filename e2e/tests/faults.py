"""Fault injection for the journey: delete a pod of the run's, or upgrade the chart, when its
status says it is at a known point, and read what the trainer wrote in its metrics log (on the
node's checkpoint folder) to see that each step happened once, on the previous step's
weights, and how long each fault cost."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.tests.kube import CommandFailed, Obj, Tools, pod_ready, wait_for

INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"


def activity(status: Obj) -> str:
    return str((status.get("activity") or {}).get("what", ""))


@dataclass
class Fault:
    """One pod deleted (or the chart upgraded) at a known point of the run, and its cost."""

    name: str
    pod: str  # "" for an upgrade
    when: str  # the trainer's activity when the pod was deleted
    at: float  # Unix seconds
    action: str = "pod deleted"
    # The step in progress at the fault: its number, seconds from the fault to its end, and
    # its duration (against the median step without a fault).
    step: int = 0
    seconds_to_step_done: float = 0.0
    step_seconds: float = 0.0
    # Seconds between the end of a step and the start of the next, for the first step begun
    # after the fault (a restarted trainer's pod start and resume; normally the checkpoint).
    gap_before_next_step: float | None = None


@dataclass
class Injector:
    tools: Tools
    namespace: str
    run: str
    faults: list[Fault] = field(default_factory=list)

    def status(self) -> Obj:
        obj = self.tools.get("trainingrun", self.run, self.namespace)
        assert obj is not None, f"TrainingRun {self.run} is gone"
        status: Obj = obj.get("status") or {}
        if status.get("phase") in ("Failed", "Succeeded"):
            raise AssertionError(
                f"{self.run} ended ({status['phase']}) while the test waited on it: "
                f"{json.dumps(status)}"
            )
        return status

    def wait_status(self, what: str, probe: Callable[[Obj], bool], timeout: float) -> Obj:
        """Poll the run's status quickly (an activity can last two seconds)."""

        def reached() -> Obj | None:
            status = self.status()
            return status if probe(status) else None

        return wait_for(what, reached, timeout=timeout, interval=0.2)

    def running_pods(self, *selectors: str) -> list[str]:
        """The running pods of `selectors` that are not being deleted."""
        return [
            str(pod["metadata"]["name"])
            for pod in self.tools.items("pods", self.namespace, *selectors)
            if not pod["metadata"].get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") == "Running"
        ]

    def save_logs(self, out: Path, *selectors: str) -> None:
        """Every container log of the pods of `selectors` (the one before a restart too)
        into `out`, as POD.log: what a failed run's pods said, before the namespace goes.
        Called in a `finally`: a failure to list the pods is written down, never raised over
        the test's own failure."""
        out.mkdir(parents=True, exist_ok=True)
        try:
            pods = self.tools.items("pods", self.namespace, *selectors)
        except (CommandFailed, subprocess.TimeoutExpired) as error:
            with (out / "unlisted.txt").open("a") as unlisted:
                unlisted.write(f"{','.join(selectors)}: {error}\n")
            return
        for pod in pods:
            name = pod["metadata"]["name"]
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            runs: list[tuple[str, list[str]]] = [("", [])]
            if any(status.get("restartCount") for status in statuses):
                runs.append((".previous", ["--previous"]))
            for suffix, previous in runs:
                result = self.tools.kubectl_run(
                    "logs", name, "-n", self.namespace, "--all-containers", *previous, check=False
                )
                (out / f"{name}{suffix}.log").write_text(result.stdout + result.stderr)

    def running_pod(self, *selectors: str) -> str:
        pods = self.running_pods(*selectors)
        assert len(pods) == 1, pods
        return pods[0]

    def delete(self, name: str, pod: str, status: Obj) -> Fault:
        self.tools.kubectl_text("delete", "pod", pod, "-n", self.namespace, "--wait=false")
        fault = Fault(name, pod, activity(status), time.time())
        self.faults.append(fault)
        return fault

    def upgrade(self, helm_args: list[str], status: Obj) -> Fault:
        """`helm upgrade` with `helm_args`, recorded as a fault from its start."""
        fault = Fault("chart", "", activity(status), time.time(), "upgraded")
        self.tools.helm("upgrade", *helm_args, "--wait", "--timeout", "5m")
        self.faults.append(fault)
        return fault

    def pod_with_image(self, image: str, *selectors: str) -> str | None:
        """The one ready pod of `selectors` (serving, not only started), once every pod of them
        runs `image`."""
        pods = [
            pod
            for pod in self.tools.items("pods", self.namespace, *selectors)
            if not pod["metadata"].get("deletionTimestamp")
        ]
        running = [p for p in pods if pod_ready(p)]
        if len(pods) != 1 or len(running) != 1:
            return None
        images = {c["image"] for c in running[0]["spec"]["containers"]}
        return str(running[0]["metadata"]["name"]) if images == {image} else None

    def wait_step(self, step: int, timeout: float) -> None:
        self.wait_status(
            f"{self.run} to finish step {step}", lambda s: s.get("step", 0) >= step, timeout
        )


def metrics_log(checkpoint_host_dir: Path, namespace: str, run: str) -> list[dict[str, Any]]:
    """The RL steps of the run's metrics log (in the run folder on the checkpoint volume)."""
    path = checkpoint_host_dir / namespace / run / "run" / "metrics.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if "stage_step" in e]


def cost(faults: list[Fault], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What each fault cost, from the step log's times (`time` is when a step was done)."""
    hit: set[int] = set()
    for fault in faults:
        done = [s for s in steps if s["time"] > fault.at]
        if not done:
            continue
        fault.step = done[0]["step"]
        fault.seconds_to_step_done = round(done[0]["time"] - fault.at, 1)
        fault.step_seconds = round(done[0]["step_seconds"], 1)
        hit.add(fault.step)
        for before, after in itertools.pairwise(steps):
            if after["time"] - after["step_seconds"] > fault.at:
                start = after["time"] - after["step_seconds"]
                fault.gap_before_next_step = round(start - before["time"], 1)
                hit.add(after["step"])
                break
    clean = [s for s in steps[1:] if s["step"] not in hit]
    gaps = [
        after["time"] - after["step_seconds"] - before["time"]
        for before, after in itertools.pairwise(steps)
        if after["step"] not in hit
    ]
    return {
        "median_step_seconds_without_fault": (
            round(statistics.median(s["step_seconds"] for s in clean), 1) if clean else None
        ),
        "median_gap_seconds_without_fault": round(statistics.median(gaps), 1) if gaps else None,
        "faults": [fault.__dict__ for fault in faults],
    }


def cost_lines(report: dict[str, Any]) -> list[str]:
    """The cost of each fault as bench/RESULTS.md's fault table gives it: seconds from the
    kill to the next completed step in the metrics log, that step's duration and the gap
    before the first step begun after the kill, against the steps without a fault."""
    median_step = report["median_step_seconds_without_fault"]
    median_gap = report["median_gap_seconds_without_fault"]
    lines = [
        f"faults: step without a fault (median) {median_step} s, gap between steps "
        f"(median) {median_gap} s"
    ]
    for fault in report["faults"]:
        lines.append(
            f"  {fault['name']} {fault['action']} ({fault['when']}): to next completed step "
            f"(step {fault['step']}) {fault['seconds_to_step_done']} s; step {fault['step']} "
            f"took {fault['step_seconds']} s; gap before the next step begun after the kill "
            f"{fault['gap_before_next_step']} s"
        )
    return lines
