"""The user journey, end to end, on a real cluster (see conftest.py for the settings):

helm install -> operator Ready -> kubectl apply a SandboxPool, a RolloutFleet (vLLM on CPU,
SmolLM2-135M-Instruct) and a small TrainingRun -> watch `kubectl get trainingruns` go
through its phases with step and metrics in the status -> Succeeded with a checkpoint ->
delete -> every child garbage-collected -> helm uninstall.

Along the way, while the run is in progress: an invalid TrainingRun is rejected with a
message naming the field; an image that cannot be pulled shows up as a condition; the
operator pod is killed and the run still succeeds; a sandbox worker pod is killed in the
middle of a batch of tool calls and no call is lost; a tool call in the chart's sandbox pod
reaches neither the API server, the scheduler, an engine nor the outside; and a pool whose
isolation the node refuses says IsolationUnavailable instead of becoming Ready.
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import hmac
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubestar.sandbox.executor import UID_RANGES_START

from e2e.tests.conftest import CHART, MANIFESTS, Settings, at_stake, figures, needs, provides
from e2e.tests.faults import (
    COMPONENT,
    INSTANCE,
    Injector,
    activity,
    cost,
    cost_lines,
    metrics_log,
)
from e2e.tests.kube import Obj, Recorder, Tools, Watch, condition, pod_ready, wait_for
from e2e.tests.prometheus import Prometheus, values
from e2e.tests.rehearsal import json_lines as rehearsal_log_lines
from e2e.tests.rehearsal import manifest as rehearsal_manifest
from e2e.tests.rehearsal import prepare_volumes
from tests.real_parts import missing

pytestmark = pytest.mark.journey

RUN, FLEET, POOL = "e2e-run", "e2e-fleet", "e2e-sandbox"
JOURNEY_STEPS = 4  # e2e/manifests/tiny-run.yaml
MANAGED = "app.kubernetes.io/managed-by=kubestar-operator"
CHILD_KINDS = ",".join(
    [
        "deployments",
        "replicasets",
        "statefulsets",
        "jobs",
        "pods",
        "services",
        "configmaps",
        "secrets",
        "serviceaccounts",
        "roles",
        "rolebindings",
    ]
)
# Where the chart's trainer.checkpointDir puts checkpoints in the trainer pod (its default).
CHECKPOINT_DIR = "/var/lib/kubestar/checkpoints"
# An image no node has and no pull can fetch: a registry on a closed local port.
MISSING_IMAGE = "127.0.0.1:9/kubestar/no-such-image:0"


class Journey:
    """What the steps hand on to each other."""

    watch: Watch | None = None
    recorder: Recorder | None = None
    operator_pod: str = ""
    children: list[str] = []
    # When the fleet was scaled to two engines (time.monotonic()).
    scaled_up_at: float = 0.0


def operator_pods(tools: Tools, settings: Settings) -> list[Obj]:
    deployment = tools.kubectl_json(
        "get", "deployment", f"{settings.release}-operator", "-n", settings.system_namespace
    )
    selector = ",".join(
        f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items()
    )
    return [
        pod
        for pod in tools.items("pods", settings.system_namespace, selector)
        if not pod["metadata"].get("deletionTimestamp")
    ]


def run_status(tools: Tools, settings: Settings, name: str = RUN) -> Obj:
    obj = tools.get("trainingrun", name, settings.namespace)
    assert obj is not None, f"TrainingRun {name} is gone"
    status: Obj = obj.get("status") or {}
    return status


def finished_status(tools: Tools, settings: Settings, name: str, what: str, timeout: float) -> Obj:
    """The run's status once it has Succeeded or Failed."""

    def finished() -> Obj | None:
        status = run_status(tools, settings, name)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    return wait_for(
        what,
        finished,
        timeout=timeout,
        interval=2,
        describe=lambda: json.dumps(run_status(tools, settings, name), indent=1),
    )


def describe(tools: Tools, settings: Settings, *what: str) -> str:
    done = tools.kubectl_run("describe", *what, "-n", settings.namespace, check=False)
    return done.stdout[-4000:]


def leader_logged(tools: Tools, settings: Settings, pod: str) -> bool:
    done = tools.kubectl_run("logs", pod, "-n", settings.system_namespace, check=False)
    return "became leader" in done.stdout


def pods_and_images(tools: Tools, settings: Settings) -> str:
    """The test namespace's pods: phase, images and what they wait on (for a timeout)."""
    lines = []
    for pod in tools.items("pods", settings.namespace):
        status = pod.get("status") or {}
        waiting = [
            (c.get("state") or {}).get("waiting", {}).get("reason", "")
            for c in status.get("containerStatuses") or []
        ]
        conditions = [c.get("message", "") for c in status.get("conditions") or []]
        images = [c["image"] for c in pod["spec"]["containers"]]
        deleting = " (deleting)" if pod["metadata"].get("deletionTimestamp") else ""
        lines.append(
            f"{pod['metadata']['name']}{deleting}: {status.get('phase')} {images} "
            f"{[w for w in waiting if w]} {[c for c in conditions if c]}"
        )
    return "\n".join(lines)


def upgrade_args(settings: Settings, *values: str) -> list[str]:
    """`helm upgrade` arguments: the release, keeping its values, with each of `values` set."""
    sets = [arg for value in values for arg in ("--set", value)]
    return [settings.release, str(CHART), "-n", settings.system_namespace, "--reuse-values", *sets]


def run_in_dispatcher(tools: Tools, settings: Settings, script: str, timeout: float) -> Obj:
    """Run a Python script in the pool's dispatcher pod; the JSON its last line prints."""
    output = tools.kubectl_text(
        "exec",
        "-n",
        settings.namespace,
        f"deploy/{POOL}-sandbox",
        "--",
        "python",
        "-c",
        script,
        timeout=timeout,
    )
    result: Obj = json.loads(output.strip().splitlines()[-1])
    return result


# --- the journey ---------------------------------------------------------------------------


@provides("chart")
def test_helm_install_and_operator_ready(
    tools: Tools, settings: Settings, prometheus: Prometheus
) -> None:
    """The chart installs; the suite's Prometheus already watches the namespaces."""
    started = time.monotonic()
    # Namespace-scoped, as the chart installs by default: a Role in each tenant's namespace,
    # which must exist first. The closed policy is opened for one image prefix only: the
    # unpullable image of test_image_that_cannot_be_pulled_is_a_condition.
    tenants = (settings.namespace, settings.tenant_namespace)
    for namespace in tenants:
        tools.kubectl_run("create", "namespace", namespace, check=False)
    out = tools.helm(
        "install",
        settings.release,
        str(CHART),
        "-n",
        settings.system_namespace,
        "--create-namespace",
        *settings.helm_args,
        "--set",
        f"operator.watchNamespaces={{{','.join(tenants)}}}",
        "--set",
        f"policy.allowedImages={{{MISSING_IMAGE.split('/')[0]}/}}",
        "--wait",
        "--timeout",
        "5m",
    )
    settings.installed = True
    (settings.out / "helm-install.txt").write_text(out)
    for crd in ("trainingruns", "rolloutfleets", "sandboxpools"):
        tools.kubectl_text(
            "wait", "--for=condition=Established", f"crd/{crd}.kubestar.dev", "--timeout=60s"
        )
    (pod,) = wait_for(
        "one Ready operator pod",
        lambda: [p for p in operator_pods(tools, settings) if pod_ready(p)],
        timeout=180,
    )
    name = pod["metadata"]["name"]
    wait_for(
        "the operator to become leader",
        lambda: leader_logged(tools, settings, name),
        timeout=180,
        interval=2,
    )
    Journey.operator_pod = name
    settings.notes["helm_install_to_leader_s"] = round(time.monotonic() - started, 1)


@needs("chart")
@provides("fleet", "pool", "run")
def test_apply_pool_fleet_and_run(tools: Tools, settings: Settings, namespace: str) -> None:
    out = tools.kubectl_text("apply", "-n", namespace, "-f", str(MANIFESTS / "tiny-run.yaml"))
    (settings.out / "kubectl-apply.txt").write_text(out)
    assert f"trainingrun.kubestar.dev/{RUN} created" in out, out
    # What a user watches: recorded line by line for the README.
    Journey.watch = Watch(
        tools,
        ["get", "trainingruns", "-n", settings.namespace, "-w"],
        settings.out / "kubectl-get-trainingruns-w.txt",
    )
    Journey.recorder = Recorder(tools, "trainingrun", RUN, settings.namespace)
    Journey.recorder.start()
    # The operator takes it up: conditions and a phase in the status.
    status = wait_for(
        "the operator to write the run's status",
        lambda: (s := run_status(tools, settings)).get("conditions") and s,
        timeout=120,
    )
    assert status["phase"] in ("Pending", "Provisioning", "SFT", "Training")
    spec_accepted = condition({"status": status}, "SpecAccepted")
    assert spec_accepted is not None and spec_accepted["status"] == "True"


SECOND_ENGINE = f"{FLEET}-engine-1"


def engine_port(deployment: Obj) -> int:
    (port,) = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    return int(port["containerPort"])


@needs("chart", "fleet", "run")
def test_a_second_engine_joins_the_run(tools: Tools, settings: Settings) -> None:
    """`kubectl scale` the fleet to two engines as the run starts: on the node's network the
    second is a Deployment of its own, serving on the next port. (Now, not later: a second
    engine takes one to two minutes to start beside a fine-tuning trainer on two cores,
    which might outlast the run's rollouts; joining late with the weights a run has pushed
    is tests/scheduler/test_elastic.py's.)"""
    namespace = settings.namespace
    assert run_status(tools, settings).get("phase") != "Succeeded"
    out = tools.kubectl_text("scale", "rolloutfleet", FLEET, "-n", namespace, "--replicas=2")
    assert "scaled" in out, out
    Journey.scaled_up_at = time.monotonic()
    second = wait_for(
        "the second engine's Deployment",
        lambda: tools.get("deployment", SECOND_ENGINE, namespace),
        timeout=60,
        interval=1,
    )
    first = tools.get("deployment", f"{FLEET}-engine-0", namespace)
    assert first is not None and second["spec"]["replicas"] == 1, second["spec"]
    assert engine_port(second) == engine_port(first) + 1


@needs("chart")
@pytest.mark.usefixtures("namespace")
def test_invalid_trainingrun_is_rejected_naming_the_field(tools: Tools, settings: Settings) -> None:
    bad_group = (MANIFESTS / "invalid-run.yaml").read_text()
    done = tools.kubectl_run(
        "apply", "-n", settings.namespace, "-f", "-", input_text=bad_group, check=False
    )
    assert done.returncode != 0, f"an invalid TrainingRun was accepted: {done.stdout}"
    message = done.stderr
    (settings.out / "invalid-run-rejected.txt").write_text(message)
    assert "spec.algorithm.groupSize" in message, message
    assert "greater than or equal to 2" in message, message
    # A missing required field is named too.
    no_stages = re.sub(r"(?ms)^  stages:.*?(?=^  \w)", "", bad_group).replace(
        "groupSize: 1", "groupSize: 2"
    )
    done = tools.kubectl_run(
        "apply", "-n", settings.namespace, "-f", "-", input_text=no_stages, check=False
    )
    # (kubectl checks the schema first: `missing required field "stages" in ...spec`.)
    assert done.returncode != 0, done.stdout
    assert re.search(
        r"(spec\.stages|TrainingRun\.spec\): missing required field \"stages\")", done.stderr
    ), done.stderr
    (settings.out / "invalid-run-rejected.txt").write_text(message + done.stderr)
    assert tools.get("trainingrun", "e2e-invalid", settings.namespace) is None


@needs("chart", "pool")
def test_image_that_cannot_be_pulled_is_a_condition(tools: Tools, settings: Settings) -> None:
    text = (MANIFESTS / "broken-image.yaml").read_text().replace("MISSING_IMAGE", MISSING_IMAGE)
    tools.kubectl_text("apply", "-n", settings.namespace, "-f", "-", input_text=text)
    try:

        def pull_failure() -> Obj | None:
            fleet = tools.get("rolloutfleet", "e2e-broken-fleet", settings.namespace)
            ready = condition(fleet, "Ready")
            if ready and ready["status"] == "False" and "Image" in ready.get("reason", ""):
                return ready
            return None

        ready = wait_for(
            "the broken fleet's Ready condition to name the image pull",
            pull_failure,
            timeout=240,
            interval=2,
            describe=lambda: describe(tools, settings, "rolloutfleet/e2e-broken-fleet"),
        )
        assert ready["reason"] in ("ErrImagePull", "ImagePullBackOff"), ready
        assert MISSING_IMAGE in ready["message"], ready

        # The run that needs that fleet says why it waits, instead of hanging silently.
        def blocked_run_says_why() -> Obj | None:
            status = run_status(tools, settings, "e2e-blocked-run")
            deps = condition({"status": status}, "DependenciesReady")
            return deps if deps and "Image" in deps.get("message", "") else None

        deps = wait_for(
            "the blocked run's DependenciesReady to carry the pull failure",
            blocked_run_says_why,
            timeout=120,
            interval=2,
        )
        assert deps["status"] == "False" and deps["reason"] == "RolloutFleetNotReady", deps
        assert run_status(tools, settings, "e2e-blocked-run")["phase"] in (
            "Pending",
            "Provisioning",
        )
        (settings.out / "image-pull-condition.json").write_text(
            json.dumps({"fleet.Ready": ready, "run.DependenciesReady": deps}, indent=2)
        )
    finally:
        tools.kubectl_run(
            "delete",
            "-n",
            settings.namespace,
            "-f",
            "-",
            "--wait=false",
            input_text=text,
            check=False,
        )


@needs("chart", "run")
def test_operator_killed_mid_run_recovers(
    tools: Tools, settings: Settings, request: pytest.FixtureRequest
) -> None:
    assert Journey.recorder is not None
    wait_for(
        "the run to reach SFT or Training",
        lambda: run_status(tools, settings).get("phase") in ("SFT", "Training", "Succeeded"),
        timeout=settings.run_timeout,
        interval=2,
        describe=lambda: json.dumps(run_status(tools, settings), indent=1),
    )
    phase = run_status(tools, settings)["phase"]
    assert phase != "Succeeded", "the run finished before the operator could be killed"
    # A new operator that never leads leaves the chart broken for the tests after this one.
    with at_stake(request, "chart"):
        (old,) = operator_pods(tools, settings)
        old_name = old["metadata"]["name"]
        tools.kubectl_text(
            "delete", "pod", old_name, "-n", settings.system_namespace, "--wait=false"
        )
        settings.notes["operator_killed_in_phase"] = phase
        (new,) = wait_for(
            "a new Ready operator pod",
            lambda: [
                p
                for p in operator_pods(tools, settings)
                if p["metadata"]["name"] != old_name and pod_ready(p)
            ],
            timeout=240,
            interval=2,
        )
        wait_for(
            "the new operator to become leader",
            lambda: leader_logged(tools, settings, new["metadata"]["name"]),
            timeout=180,
            interval=2,
        )
    Journey.operator_pod = new["metadata"]["name"]


BATCH = r"""
import asyncio, json, sys
from kubestar.sandbox.client import SandboxClient, result_to_dict

async def main() -> None:
    client = SandboxClient("127.0.0.1:{port}", timeout=600)
    calls = [f"import time\ntime.sleep(2)\nprint({{i}} * {{i}})" for i in range({calls})]
    async def one(i, code):
        return i, await client.aexecute(code)
    for done in asyncio.as_completed([one(i, c) for i, c in enumerate(calls)]):
        i, result = await done
        print(json.dumps({{"i": i, **result_to_dict(result)}}), flush=True)
    await client.aclose()

asyncio.run(main())
"""


def metrics_text(tools: Tools, settings: Settings, deployment: str, pod: str = "") -> str:
    """What the Deployment's pod (or `pod`) serves on its metrics port, read inside it."""
    live = tools.get("deployment", deployment, settings.namespace)
    assert live is not None, deployment
    (port,) = [
        p["containerPort"]
        for p in live["spec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == "metrics"
    ]
    script = (
        "import urllib.request;"
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10)"
        ".read().decode())"
    )
    target = f"pod/{pod}" if pod else f"deploy/{deployment}"
    command = ("exec", "-n", settings.namespace, target, "--", "python", "-c", script)
    return tools.kubectl_text(*command)


def dispatcher_metrics(tools: Tools, settings: Settings, pod: str = "") -> dict[str, float]:
    """The pool's dispatcher's counters: those of `pod`, or of a pod of its Deployment."""
    values: dict[str, float] = {}
    for line in metrics_text(tools, settings, f"{POOL}-sandbox", pod).splitlines():
        # Status labels as the sandbox spells them: `ok`, `queue-timeout`, `output-limit`...
        match = re.match(
            r'kubestar_sandbox_(results_total\{status="([\w-]+)"\}|retries_total) (\S+)', line
        )
        if match:
            key = f"results.{match.group(2)}" if match.group(2) else "retries"
            values[key] = float(match.group(3))
    return values


def scheduler_counters(tools: Tools, settings: Settings) -> dict[str, float]:
    """The fleet's scheduler's counters: `admitted.ENGINE` (turns sent to each engine,
    retries included), `moved` (segments restarted on another engine), `retried` (turns sent
    again after their engine failed), `failed.REASON`."""
    values: dict[str, float] = {}
    for line in metrics_text(tools, settings, f"{FLEET}-scheduler").splitlines():
        match = re.match(
            r'kubestar_scheduler_(admitted|moved|retried|failed)_total(?:\{\w+="([^"]+)"\})? (\S+)',
            line,
        )
        if match:
            name, label, value = match.groups()
            values[f"{name}.{label}" if label else name] = float(value)
    return values


@needs("chart", "pool")
def test_sandbox_worker_killed_mid_batch_loses_no_call(
    tools: Tools, settings: Settings, request: pytest.FixtureRequest
) -> None:
    with at_stake(request, "pool"):  # a pool that never serves, or loses its worker for good
        wait_for(
            "the SandboxPool to be Ready",
            lambda: (
                (condition(tools.get("sandboxpool", POOL, settings.namespace), "Ready") or {}).get(
                    "status"
                )
                == "True"
            ),
            timeout=300,
            interval=2,
        )
    calls = 16
    before = dispatcher_metrics(tools, settings)
    (worker,) = tools.items(
        "pods",
        settings.namespace,
        f"app.kubernetes.io/instance={POOL}",
        "app.kubernetes.io/component=sandbox-worker",
    )
    worker_uid = worker["metadata"]["uid"]
    # Tool calls through the dispatcher, run from inside its pod (as the trainer's would come).
    batch = subprocess.Popen(
        [
            tools.kubectl_bin,
            "exec",
            "-i",
            "-n",
            settings.namespace,
            f"deploy/{POOL}-sandbox",
            "--",
            "python",
            "-",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert batch.stdin is not None and batch.stdout is not None
    batch.stdin.write(BATCH.format(port=50051, calls=calls))
    batch.stdin.close()
    results: list[dict[str, Any]] = []
    first = batch.stdout.readline()
    assert first, f"the batch printed nothing: {batch.stderr.read() if batch.stderr else ''}"
    results.append(json.loads(first))
    # Killed while most calls are queued or running on it (1 s grace: no drain to speak of).
    killed_at = time.monotonic()
    tools.kubectl_text(
        "delete",
        "pod",
        worker["metadata"]["name"],
        "-n",
        settings.namespace,
        "--grace-period=1",
        "--wait=false",
    )
    for line in batch.stdout:
        results.append(json.loads(line))
    code = batch.wait(600)
    stderr = batch.stderr.read() if batch.stderr else ""
    settings.notes["sandbox_batch_after_kill_s"] = round(time.monotonic() - killed_at, 1)
    (settings.out / "sandbox-batch.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in results)
    )
    assert code == 0, stderr
    assert len(results) == calls, results
    bad = [r for r in results if r["status"] != "ok" or r["stdout"].strip() != str(r["i"] ** 2)]
    assert not bad, bad
    # The worker really was replaced, and the dispatcher started lost calls again.
    with at_stake(request, "pool"):
        (new_worker,) = wait_for(
            "the replacement worker pod",
            lambda: [
                p
                for p in tools.items(
                    "pods",
                    settings.namespace,
                    f"app.kubernetes.io/instance={POOL}",
                    "app.kubernetes.io/component=sandbox-worker",
                )
                if pod_ready(p)
            ],
            timeout=300,
            interval=2,
        )
    assert new_worker["metadata"]["uid"] != worker_uid
    after = dispatcher_metrics(tools, settings)
    settings.notes["dispatcher_metrics_after_kill"] = after
    for status in ("internal", "queue-timeout"):
        assert after.get(f"results.{status}", 0) == before.get(f"results.{status}", 0), after


# Run in the dispatcher's pod: the targets straight from the pod, then from a tool call.
REACH = r"""
import asyncio, json, socket
from kubestar.sandbox.client import SandboxClient, status_label

TARGETS = json.loads('{targets}')
PROBE = '''
import json, os, socket
targets = json.loads(%r)
# The namespace's interfaces (if_nameindex() asks netlink, which calls cannot open).
lines = open("/proc/net/dev").read().splitlines()[2:]
seen = {{"uid": os.getuid(), "interfaces": sorted(line.split(":")[0].strip() for line in lines)}}
# A system call off the filter's allow-list: personality(PER_LINUX32).
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
seen["personality"] = ctypes.get_errno() if libc.personality(8) == -1 else "allowed"
if seen["interfaces"] == ["lo"]:
    # No interface leads anywhere: the attempt cannot leave this machine.
    targets["outside"] = ["192.0.2.1", 80]
for name, (host, port) in targets.items():
    try:
        socket.create_connection((host, port), timeout=3).close()
        seen[name] = "connected"
    except OSError as error:
        seen[name] = type(error).__name__ + ": " + str(error.strerror)
print(json.dumps(seen))
'''

def direct():
    seen = {{}}
    for name, (host, port) in TARGETS.items():
        try:
            socket.create_connection((host, port), timeout=3).close()
            seen[name] = "connected"
        except OSError as error:
            seen[name] = str(error)
    return seen

async def main():
    client = SandboxClient("127.0.0.1:{port}", timeout=120)
    result = await client.aexecute(PROBE % json.dumps(TARGETS))
    await client.aclose()
    print(json.dumps({{"pod": direct(), "status": status_label(result.status),
                      "call": result.stdout, "stderr": result.stderr}}))

asyncio.run(main())
"""


@needs("chart", "fleet", "pool")
def test_tool_calls_reach_nothing_from_the_sandbox(tools: Tools, settings: Settings) -> None:
    """From a tool call in the chart's sandbox pod (isolation Required, the default), the API
    server, the rollout scheduler, an engine and the dispatcher cannot be reached, though the
    pod itself reaches them; nor can an outside address."""
    pool = tools.get("sandboxpool", POOL, settings.namespace)
    assert pool is not None
    assert pool["status"]["isolation"] == "Required", pool["status"]
    server = tools.kubectl_text(
        "config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}"
    )
    api = re.match(r"https?://\[?([^\]/]+?)\]?:(\d+)", server)
    assert api, server
    fleet, engine_host, engine_port = serving_fleet(tools, settings)
    scheduler_host, scheduler_port = fleet["status"]["schedulerEndpoint"].rsplit(":", 1)
    dispatcher_host = pool["status"]["endpoint"].rsplit(":", 1)[0]
    targets = {
        "api_server": [api.group(1), int(api.group(2))],
        "scheduler": [scheduler_host, int(scheduler_port)],
        "engine": [engine_host, engine_port],
        "dispatcher": [dispatcher_host, 50051],
    }
    script = REACH.format(port=50051, targets=json.dumps(targets))
    seen = run_in_dispatcher(tools, settings, script, timeout=180)
    settings.notes["sandbox_reach"] = seen
    # The pod reaches every target: what a call cannot reach, the isolation keeps from it.
    assert set(seen["pod"].values()) == {"connected"}, seen
    assert seen["status"] == "ok", seen
    call = json.loads(seen["call"])
    assert call["interfaces"] == ["lo"], call
    # A uid of the pod's own range (above 2^20), not one every pod of the node shares.
    assert call["uid"] >= UID_RANGES_START, call
    assert call["personality"] == errno.ENOSYS, call
    for name in [*targets, "outside"]:
        assert call[name] == "OSError: Network is unreachable", (name, call)
    # The zygotes that fork the calls hold no CAP_SYS_ADMIN in the chart's worker pod.
    capabilities = json.loads(
        tools.kubectl_text(
            "exec",
            "-n",
            settings.namespace,
            f"{POOL}-sandbox-worker-0",
            "--",
            "python",
            "-c",
            ZYGOTE_CAPABILITIES,
            timeout=60,
        ).strip()
    )
    settings.notes["zygote_capabilities"] = capabilities
    assert capabilities["container"] & CAP_SYS_ADMIN, capabilities
    assert capabilities["zygotes"], capabilities
    assert not any(cap & CAP_SYS_ADMIN for cap in capabilities["zygotes"]), capabilities


CAP_SYS_ADMIN = 1 << 21
ZYGOTE_CAPABILITIES = r"""
import json, os
def effective(pid):
    fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return int(fields["CapEff"], 16)
zygotes = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():  # this script names zygote.py too
        continue
    try:
        if b"zygote.py" in open(f"/proc/{pid}/cmdline", "rb").read():
            zygotes.append(effective(pid))
    except OSError:
        pass
print(json.dumps({"container": effective(os.getpid()), "zygotes": zygotes}))
"""


CLOSED = r"""
import asyncio, json, urllib.error, urllib.request
import grpc
from kubestar.sandbox.client import SandboxClient
from kubestar.scheduler.client import SchedulerClient

def http(url, token, body=b"{{}}"):
    request = urllib.request.Request(url, data=body)
    if token:
        request.add_header("Authorization", "Bearer " + token)
    try:
        return urllib.request.urlopen(request, timeout=30).status
    except urllib.error.HTTPError as error:
        return error.code

async def rpc(call):
    try:
        await call
        return "OK"
    except grpc.aio.AioRpcError as error:
        return error.code().name

async def main():
    targets = {targets}
    token = open("{token_file}").read().strip()
    seen = {{"token": token}}
    for name, given in {tries}.items():
        given = token if given == "own" else given
        seen[name] = answers = {{}}
        for plane, address in targets.items():
            if plane.endswith("sandbox"):
                client = SandboxClient(address, timeout=60, token=given)
                answers[plane] = await rpc(client.aexecute("print(1)"))
                await client.aclose()
            elif plane == "scheduler":
                client = SchedulerClient(address, timeout=60, token=given)
                answers[plane] = await rpc(client.status())
                await client.close()
            elif plane == "engine":
                answers[plane] = http(address + "/kubestar/v1/weights", given)
            else:  # the OpenAI port: GET /v1/models
                answers[plane] = http(address + "/models", given, body=None)
    print(json.dumps(seen))

asyncio.run(main())
"""


def namespace_token(installation: str, namespace: str) -> str:
    """A namespace's token as docs/security.md says the operator derives it."""
    message = f"kubestar.dev/namespace/{namespace}".encode()
    return hmac.new(installation.encode(), message, hashlib.sha256).hexdigest()


def ready_object(tools: Tools, kind: str, name: str, namespace: str) -> Obj | None:
    found = tools.get(kind, name, namespace) or {}
    ready = condition(found, "Ready") or {}
    return found if ready.get("status") == "True" else None


def serving_fleet(tools: Tools, settings: Settings) -> tuple[Obj, str, int]:
    """The journey's fleet once Ready (the suite may come here before the model has loaded),
    and its engine's host and port."""
    fleet = wait_for(
        "the fleet to be Ready",
        lambda: ready_object(tools, "rolloutfleet", FLEET, settings.namespace),
        timeout=600,
        interval=2,
    )
    engine = tools.items(
        "pods",
        settings.namespace,
        f"app.kubernetes.io/instance={FLEET}",
        "app.kubernetes.io/component=engine",
    )[0]
    port = engine["spec"]["containers"][0]["ports"][0]["containerPort"]
    return fleet, engine["status"].get("podIP") or "127.0.0.1", port


@needs("chart", "fleet", "pool")
def test_tenants_are_refused_by_each_others_planes(tools: Tools, settings: Settings) -> None:
    """Two tenants, each in a namespace of its own: from a pod of each, holding the token the
    operator minted for its namespace, the other tenant's sandbox, rollout scheduler, engine
    weights route and OpenAI port refuse the call, as they refuse one without a token or with
    a wrong one, and serve one with their own namespace's token (the weights route answers
    400 to an empty body: it names no weights)."""
    tenant = settings.tenant_namespace
    tools.kubectl_text("apply", "-n", tenant, "-f", str(MANIFESTS / "tenant-pool.yaml"))
    try:
        fleet, engine_host, engine_port = serving_fleet(tools, settings)
        wait_for(
            "the tenant's pool to be Ready",
            lambda: ready_object(tools, "sandboxpool", "tenant-sandbox", tenant),
            timeout=300,
            interval=2,
        )
        planes = {
            "sandbox": "127.0.0.1:50051",
            "scheduler": fleet["status"]["schedulerEndpoint"],
            "engine": f"http://{engine_host}:{engine_port}",
            "openai": fleet["status"]["openaiEndpoint"],
            "tenant sandbox": "127.0.0.1:50151",
        }
        token_file = "/var/run/secrets/kubestar/auth/token"
        first = CLOSED.format(
            targets=planes,
            token_file=token_file,
            tries={"without": "", "wrong": "x" * 64, "own": "own"},
        )
        seen = run_in_dispatcher(tools, settings, first, timeout=180)
        output = tools.kubectl_text(
            "exec",
            "-n",
            tenant,
            "deploy/tenant-sandbox-sandbox",
            "--",
            "python",
            "-c",
            CLOSED.format(targets=planes, token_file=token_file, tries={"own": "own"}),
            timeout=180,
        )
        seen_by_tenant = json.loads(output.strip().splitlines()[-1])
    finally:
        tools.kubectl_run(
            "delete", "-n", tenant, "sandboxpool", "tenant-sandbox", "--wait=false", check=False
        )
    # The operator's tokens: each derived from the installation's (the chart's Secret, which
    # only the operator mounts) for its namespace.
    chart_secret = tools.kubectl_json(
        "get", "secret", f"{settings.release}-auth", "-n", settings.system_namespace
    )
    installation = base64.b64decode(chart_secret["data"]["token"]).decode()
    assert seen.pop("token") == namespace_token(installation, settings.namespace)
    assert seen_by_tenant.pop("token") == namespace_token(installation, tenant)
    settings.notes["tenants"] = {"first": seen, "second": seen_by_tenant}
    refused = {
        "sandbox": "UNAUTHENTICATED",
        "scheduler": "UNAUTHENTICATED",
        "engine": 401,
        "openai": 401,
        "tenant sandbox": "UNAUTHENTICATED",
    }
    assert seen["without"] == refused, seen
    assert seen["wrong"] == refused, seen
    # Each tenant is served by its own planes only.
    assert seen["own"] == {
        **refused,
        "sandbox": "OK",
        "scheduler": "OK",
        "engine": 400,
        "openai": 200,
    }, seen
    assert seen_by_tenant["own"] == {**refused, "tenant sandbox": "OK"}, seen_by_tenant


HTTP_DIALECTS = r"""
import base64, json, urllib.error, urllib.request
token = open("{token_file}").read().strip()

def post(path, body, auth=True):
    request = urllib.request.Request("{base}" + path, data=json.dumps(body).encode(),
                                     headers={{"Content-Type": "application/json"}})
    if auth:
        basic = base64.b64encode(f"kubestar:{{token}}".encode()).decode()
        request.add_header("Authorization", f"Basic {{basic}}")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, None

status, fusion = post("/run_code", {{"code": "print(6 * 7)", "language": "python"}})
_, judge = post("/run/long-batch", {{"type": "batch", "submissions": [
    {{"type": "python", "solution": "print(int(input()) + 1)", "input": "41",
      "expected_output": "42"}}]}})
refused, _ = post("/run_code", {{"code": "print(1)", "language": "python"}}, auth=False)
print(json.dumps({{"status": status, "fusion": fusion["status"],
                   "stdout": fusion["run_result"]["stdout"],
                   "judge": judge["results"][0]["success"], "refused": refused}}))
"""


@needs("chart", "pool")
def test_the_pool_speaks_sandboxfusion_and_code_judge(tools: Tools, settings: Settings) -> None:
    """From a pod of the namespace, with the token as a URL's Basic credentials (what verl's
    client sends): the pool's dispatcher answers SandboxFusion's /run_code and code-judge's
    /run/long-batch on its HTTP port, and refuses a call without the token."""
    pool = tools.get("sandboxpool", POOL, settings.namespace)
    assert pool is not None
    base = pool["status"].get("httpEndpoint", "")
    assert base.endswith(":8012"), pool["status"]
    script = HTTP_DIALECTS.format(token_file="/var/run/secrets/kubestar/auth/token", base=base)
    seen = run_in_dispatcher(tools, settings, script, timeout=300)
    settings.notes["http_dialects"] = seen
    assert seen == {
        "status": 200,
        "fusion": "Success",
        "stdout": "42\n",
        "judge": True,
        "refused": 401,
    }, seen


OPENAI = r"""
import json, openai
token = open("{token_file}").read().strip()
client = openai.OpenAI(base_url="{base}", api_key=token, max_retries=0)
models = [m.id for m in client.models.list().data]
chat = client.chat.completions.create(
    model=models[0], messages=[{{"role": "user", "content": "What is 3 + 4?"}}],
    max_tokens=16, temperature=0, extra_body={{"return_token_ids": True}},
    extra_headers={{"X-Session-ID": "e2e-openai"}},
)
try:
    openai.OpenAI(base_url="{base}", api_key="wrong", max_retries=0).models.list()
    refused = False
except openai.AuthenticationError:
    refused = True
print(json.dumps({{
    "models": models, "content": chat.choices[0].message.content,
    "token_ids": len(chat.choices[0].model_extra["token_ids"]),
    "completion_tokens": chat.usage.completion_tokens, "refused": refused,
}}))
"""


@needs("chart", "fleet", "pool")
def test_the_fleet_is_one_openai_endpoint(tools: Tools, settings: Settings) -> None:
    """The openai package, from a pod of the namespace, against the fleet's OpenAI-compatible
    API (the scheduler's, in front of the vLLM engine): the model is listed, a chat turn
    comes back with its token ids, and a caller without the installation's token is refused."""
    fleet = tools.get("rolloutfleet", FLEET, settings.namespace)
    assert fleet is not None
    base = fleet["status"].get("openaiEndpoint", "")
    assert base.endswith(":8011/v1"), fleet["status"]
    script = OPENAI.format(token_file="/var/run/secrets/kubestar/auth/token", base=base)
    seen = run_in_dispatcher(tools, settings, script, timeout=300)
    settings.notes["openai_front"] = seen
    assert seen["models"] == ["SmolLM2-135M-Instruct"], seen
    assert seen["token_ids"] == seen["completion_tokens"] >= 1, seen
    assert seen["refused"] is True, seen


@needs("chart", "fleet", "run")
def test_the_fleet_scales_back_to_one_engine_during_a_rollout(
    tools: Tools, settings: Settings, request: pytest.FixtureRequest
) -> None:
    """Once the second engine took turns of the run, scale the fleet back to one while a
    step rolls out: the second engine's pod is deleted, the scheduler stops sending it turns
    at once (its pod is terminating) and sends those in flight to the first, then the pod
    leaves; its Deployment stays at 0. The run goes on: that each step was trained once, on
    turns of the weights it should have, is checked when it succeeds."""
    assert Journey.scaled_up_at, "the fleet was never scaled to two engines"
    namespace = settings.namespace
    second = (f"{INSTANCE}={FLEET}", f"{COMPONENT}=engine", "kubestar.dev/engine-index=1")

    def second_engine_turns() -> tuple[str, float] | None:
        admitted = {
            key.removeprefix("admitted."): value
            for key, value in scheduler_counters(tools, settings).items()
            if key.startswith(f"admitted.{SECOND_ENGINE}-") and value > 0
        }
        return next(iter(admitted.items()), None)

    engine, turns = wait_for(
        "the second engine to take turns of the run",
        second_engine_turns,
        timeout=settings.run_timeout,
        interval=2,
        describe=lambda: json.dumps(
            {"run": run_status(tools, settings), "pods": pods_and_images(tools, settings)},
            indent=1,
        ),
    )
    joined = time.monotonic() - Journey.scaled_up_at
    status = wait_for(
        "a step's rollout",
        lambda: (
            s
            if (s := run_status(tools, settings)).get("phase") == "Succeeded"
            or activity(s).startswith("rolling out step")
            else None
        ),
        timeout=settings.run_timeout,
        interval=0.5,
    )
    during = activity(status)
    assert status["phase"] != "Succeeded", "the run finished before the fleet was scaled down"
    with at_stake(request, "fleet"):
        tools.kubectl_text("scale", "rolloutfleet", FLEET, "-n", namespace, "--replicas=1")
        started = time.monotonic()
        wait_for(
            "the second engine's pod to leave",
            lambda: not tools.items("pods", namespace, *second),
            timeout=180,
            interval=1,
        )
        left = time.monotonic() - started

        engines = [
            p["metadata"]["name"]
            for p in tools.items("pods", namespace, f"{INSTANCE}={FLEET}", f"{COMPONENT}=engine")
        ]

        def scaled_down() -> Obj | None:
            fleet_status = (tools.get("rolloutfleet", FLEET, namespace) or {}).get("status", {})
            last = fleet_status.get("lastScale") or {}
            done = (last.get("fromReplicas"), last.get("toReplicas")) == (2, 1)
            listed = [e["name"] for e in fleet_status.get("engines") or []]
            one = fleet_status.get("readyReplicas") == 1 and listed == engines
            return fleet_status if done and one else None

        fleet_status = wait_for(
            "the fleet's status to list its one engine", scaled_down, timeout=60, interval=1
        )
    assert len(engines) == 1 and fleet_status["lastScale"]["reason"] == "SpecChanged"
    kept = tools.get("deployment", SECOND_ENGINE, namespace)
    assert kept is not None and kept["spec"]["replicas"] == 0, kept
    counters = scheduler_counters(tools, settings)
    settings.notes["elastic_fleet"] = {
        "second_engine": engine,
        "its_turns": turns,
        "first_turn_after_scale_up_seconds": round(joined, 1),
        "scaled_down_during": during,
        "pod_gone_after_scale_down_seconds": round(left, 1),
        "scheduler_counters": counters,
    }
    figures(request.config).append(
        f"elastic fleet: 1 -> 2 engines, the second's first turns {joined:.0f} s after the "
        f"scale ({turns:.0f} turns); 2 -> 1 during '{during}', its pod gone in {left:.0f} s; "
        f"segments moved {counters.get('moved', 0):.0f}, turns retried "
        f"{counters.get('retried', 0):.0f}"
    )
    # Neither scale event cost a turn an attempt: a removed engine's turns move.
    assert counters.get("retried", 0) == 0, counters


@needs("chart", "fleet", "pool", "run")
def test_run_succeeds_with_step_metrics_and_checkpoint(
    tools: Tools, settings: Settings, prometheus: Prometheus
) -> None:
    recorder = Journey.recorder
    assert recorder is not None

    final = finished_status(tools, settings, RUN, "the run to finish", settings.run_timeout)
    time.sleep(3)  # the recorder and the watch see the last change too
    recorder.stop()
    recorder.dump(settings.out / "trainingrun-statuses.jsonl")
    assert final["phase"] == "Succeeded", json.dumps(final, indent=1)

    # The phases, in order (Pending may be too short to see).
    phases = recorder.phases()
    settings.notes["phases"] = phases
    expected = ["Provisioning", "SFT", "Training", "Succeeded"]
    assert [p for p in phases if p in expected] == expected, phases
    # Step and metrics were in the status while it trained, not just at the end.
    training = [s for _, s in recorder.statuses if s.get("phase") == "Training" and s.get("step")]
    assert training, "no status with phase Training and a step was seen"
    assert any((s.get("metrics") or {}).get("reward") is not None for s in training), training
    assert all(s.get("totalSteps") == JOURNEY_STEPS for s in training)

    final = run_status(tools, settings)
    assert final["step"] == final["totalSteps"] == JOURNEY_STEPS, final
    assert final["stepSummary"] == f"{JOURNEY_STEPS}/{JOURNEY_STEPS}"
    # Progress as Kubeflow Trainer reports a TrainJob's, while it trained and at the end.
    assert any(s.get("progress", {}).get("percentage") == 50 for s in training), training
    progress = final["progress"]
    assert progress["percentage"] == 100, progress
    assert progress["estimatedRemainingTimeSummary"] == "0s", progress
    assert "reward" in {metric["name"] for metric in progress["metrics"]}, progress
    metrics = final["metrics"]
    for key in ("reward", "accuracy", "meanResponseTokens", "toolErrorRate"):
        assert metrics.get(key) is not None, metrics
    checkpoint = final.get("lastCheckpoint", "")
    assert checkpoint.startswith(f"{CHECKPOINT_DIR}/{settings.namespace}/{RUN}/"), checkpoint
    # No rollout was thrown away for the installation's own failures (a refused token, a
    # lost call), and the watchdog saw the trainer move from one activity to the next.
    retried = [s["rolloutRetry"] for _, s in recorder.statuses if s.get("rolloutRetry")]
    assert not retried, retried
    healthy = condition({"status": final}, "RolloutsHealthy")
    assert healthy is not None and healthy["status"] == "True", final
    activities = [(s.get("activity") or {}).get("what", "") for _, s in recorder.statuses]
    settings.notes["activities"] = sorted(set(activities) - {""})
    assert any(a.startswith("rolling out step") for a in activities), activities
    assert any(a.startswith("pushing weights") for a in activities), activities
    # The weights reached the engine by broadcast from the trainer's weight server: the
    # fleet's engines mount nothing of the trainers' (the chart has a shared volume).
    fleet_status = (tools.get("rolloutfleet", FLEET, settings.namespace) or {}).get("status", {})
    assert (fleet_status.get("weights") or {}).get("path", "").startswith("broadcast://"), (
        fleet_status
    )
    for engines in tools.items(
        "deployments", settings.namespace, f"{INSTANCE}={FLEET}", f"{COMPONENT}=engine"
    ):
        mounted = [v["name"] for v in engines["spec"]["template"]["spec"]["volumes"]]
        assert "checkpoints" not in mounted, mounted
    settings.notes["weights_source"] = fleet_status["weights"]["path"]

    # The new operator (after the kill) sees the trainer Job complete (the trainer reports
    # Succeeded itself, just before its pod exits).
    def trainer_done() -> Obj | None:
        trainer = condition({"status": run_status(tools, settings)}, "TrainerReady")
        return trainer if trainer and trainer["reason"] == "Succeeded" else None

    wait_for("TrainerReady to say Succeeded", trainer_done, timeout=120, interval=2)
    # Both trainer pods took part: one world of 2, each pod a rank of it.
    assert final.get("worldSize") == 2, final
    for worker, job_name in enumerate((f"{RUN}-trainer", f"{RUN}-trainer-1")):
        job = tools.kubectl_json("get", "job", job_name, "-n", settings.namespace)
        assert job["status"].get("succeeded") == 1, job["status"]
        log = tools.kubectl_text("logs", f"job/{job_name}", "-n", settings.namespace)
        (settings.out / f"{job_name}.log").write_text(log)
        assert f"rank {worker} of 2" in log, log[-2000:]
    if settings.checkpoint_host_dir is not None:
        on_host = settings.checkpoint_host_dir / Path(checkpoint).relative_to(CHECKPOINT_DIR)
        assert on_host.is_dir(), on_host
        assert any(on_host.rglob("*.safetensors")), sorted(on_host.rglob("*"))
        # Each step trained once, through the fleet's scale to two engines and back; every
        # turn of step N sampled from weights N-1, those of the engine that joined late too.
        steps = metrics_log(settings.checkpoint_host_dir, settings.namespace, RUN)
        assert [s["step"] for s in steps] == list(range(1, JOURNEY_STEPS + 1)), steps
        assert [s["oldest_weights_version"] for s in steps] == list(range(JOURNEY_STEPS)), steps
    # Every tool call of the run (SFT and rollouts) got a result: none was lost.
    metrics_after = dispatcher_metrics(tools, settings)
    settings.notes["dispatcher_metrics_end"] = metrics_after
    assert metrics_after.get("results.internal", 0) == 0, metrics_after
    assert metrics_after.get("results.queue-timeout", 0) == 0, metrics_after

    run_was_scraped(tools, settings, prometheus)

    watch = Journey.watch
    assert watch is not None
    wait_for(
        "the watch to print Succeeded",
        lambda: any("Succeeded" in line for line in watch.lines()),
        timeout=30,
    )
    watch.stop()
    lines = watch.lines()
    assert lines[0].split()[:4] == ["NAME", "PHASE", "STAGE", "STEP"], lines[:2]
    assert any(
        re.search(rf"^{RUN}\s+Training\s+\S+\s+\d/{JOURNEY_STEPS}", line) for line in lines
    ), lines


def run_was_scraped(tools: Tools, settings: Settings, prometheus: Prometheus) -> None:
    """Prometheus scraped rank 0 while it trained (the step rising to the last one, the
    reward), the sandbox's call counters and the scheduler's queue; and `kubestar report
    --run` draws the run's report from the cluster alone."""
    where = f'namespace="{settings.namespace}"'
    (step,) = prometheus.query_range(
        f'max(kubestar_trainer_step{{run="{RUN}",{where}}})', prometheus.started
    )
    seen = values(step)
    assert seen == sorted(seen) and seen[-1] == JOURNEY_STEPS and 1 in seen, seen
    rewards = prometheus.query_range(
        f'kubestar_trainer_reward{{run="{RUN}",{where}}}', prometheus.started
    )
    assert rewards and all(0 <= value <= 1 for s in rewards for value in values(s)), rewards
    (calls,) = prometheus.query_range(
        f"sum(kubestar_sandbox_results_total{{{where}}})", prometheus.started
    )
    assert values(calls)[-1] > 0, calls
    queue = prometheus.query_range(
        f"kubestar_scheduler_queue_length{{{where}}}", prometheus.started
    )
    assert queue, "no kubestar_scheduler_queue_length series"
    settings.notes["prometheus_targets"] = sorted(
        {target["labels"].get("component", "") for target in prometheus.targets()}
    )

    out = settings.out / "report-from-cluster"
    report_command = [sys.executable, "-m", "kubestar.cli.main", "report", "--run", RUN]
    tools.run([*report_command, "-n", settings.namespace, "--out", str(out)])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "stage_step" in e] == list(range(1, JOURNEY_STEPS + 1)), (
        logged
    )
    report = (out / "report" / "report.md").read_text()
    assert f"Phase **Succeeded**, step {JOURNEY_STEPS} of {JOURNEY_STEPS}" in report, report


SEARCH_PROBLEMS, SEARCH_CHILDREN = 3, 4


@needs("chart", "fleet", "pool", "run")
def test_search_on_the_fleet_and_the_pool(tools: Tools, settings: Settings) -> None:
    """rStar-Math's MCTS from a pod of the namespace (`kubestar solve --scheduler --sandbox`
    with the installation's token), valued by the reference answers, on the policy the run
    left on the fleet: each expansion is one request of n samples to the fleet's scheduler,
    and each step's program runs in the pool's sandbox."""
    fleet = tools.get("rolloutfleet", FLEET, settings.namespace)
    pool = tools.get("sandboxpool", POOL, settings.namespace)
    assert fleet is not None and pool is not None
    command = [
        "env", "KUBESTAR_AUTH_TOKEN_FILE=/var/run/secrets/kubestar/auth/token",
        "kubestar", "solve", "--mode", "mcts", "--ground-truth",
        "--problems", "basic_arithmetic", "-n", str(SEARCH_PROBLEMS), "--seed", "5",
        "--rollouts", "2", "--children", str(SEARCH_CHILDREN), "--max-depth", "3",
        "--max-step-tokens", "96", "--sampling-seed", "3",
        "--scheduler", fleet["status"]["schedulerEndpoint"],
        "--sandbox", pool["status"]["endpoint"],
        "--model", "SmolLM2-135M-Instruct",
        "--output", "/tmp/trees.jsonl", "--json", "--no-progress",
    ]  # fmt: skip
    exec_in_dispatcher = ["exec", "-n", settings.namespace, f"deploy/{POOL}-sandbox", "--"]
    figures = json.loads(tools.kubectl_text(*exec_in_dispatcher, *command, timeout=900))
    trees = [
        json.loads(line)
        for line in tools.kubectl_text(*exec_in_dispatcher, "cat", "/tmp/trees.jsonl").splitlines()
    ]
    (settings.out / "search-trees.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
    programs = [n for t in trees for n in t["nodes"] if n["code"]]
    settings.notes["search_on_cluster"] = {
        **figures,
        "programs": len(programs),
        "programs_failed": sum(bool(n["code_failed"]) for n in programs),
    }
    assert figures["problems"] == len(trees) == SEARCH_PROBLEMS, figures
    assert figures["generated_tokens"] > 0, figures
    for tree in trees:
        root, *steps = tree["nodes"]
        # The root's expansion: one request of n samples (duplicates dropped); each step that
        # ended its branch (an answer, failed code, unparsable) is valued ("exhausted": one
        # whose own children all ended, which has no value of its own by ground truth).
        first = [n for n in steps if n["parent"] == root["id"]]
        assert 1 <= len(first) <= SEARCH_CHILDREN, tree["nodes"]
        assert tree["requests"] >= 1, tree
        valued = [n for n in first if n["terminal"] not in (None, "exhausted")]
        assert all(n["N"] >= 1 for n in valued), tree["nodes"]
    # Every program a step wrote ran in the pool's sandbox: it has what the tool answered.
    assert all(n["observation"] is not None for n in programs), programs


FAULTS, FULL = "e2e-faults", "e2e-full"
STEPS = 9  # e2e/manifests/faults-run.yaml


def sandbox_answers(tools: Tools, settings: Settings, dispatcher: str) -> float:
    """Tool calls the dispatcher pod `dispatcher` has answered (any status: ok, error,
    timeout...) since it started."""
    metrics = dispatcher_metrics(tools, settings, dispatcher)
    return sum(value for key, value in metrics.items() if key.startswith("results."))


def rollout_step(status: Obj) -> int:
    """The step whose rollout the run's status says is under way, 0 if none is."""
    match = re.fullmatch(r"rolling out step (\d+)", activity(status))
    return int(match.group(1)) if match else 0


def answering_tool_calls(
    faults: Injector,
    tools: Tools,
    settings: Settings,
    dispatcher: str,
    first_step: int,
    last_step: int,
) -> tuple[Obj, bool]:
    """Wait for a rollout of step `first_step` or later in which the dispatcher pod answers
    a tool call, while it is still under way: its status then, and True. The policy calls the
    tool in some trajectories only (and some calls are rejected by the parser, never reaching
    the sandbox): if none is seen before the rollout of `last_step` starts, that rollout's
    status and False (its calls, if any, then meet the deleted dispatcher).

    Only rollouts call the tool, so any rise of the dispatcher's answers comes from one; the
    status is read after the count, so a rise it sees under a rollout happened in it (or at
    the end of the rollout before, seconds earlier)."""
    answered = sandbox_answers(tools, settings, dispatcher)

    def calls_in_a_rollout() -> tuple[Obj, bool] | None:
        nonlocal answered
        now = sandbox_answers(tools, settings, dispatcher)
        status = faults.status()
        rose, answered = now > answered, now
        step = rollout_step(status)
        if step >= first_step and (rose or step >= last_step):
            return status, rose
        return None

    return wait_for(
        f"the dispatcher to answer tool calls in a rollout from step {first_step} on",
        calls_in_a_rollout,
        timeout=settings.run_timeout,
        interval=0.2,
    )


def weights_loaded(scheduler_log: str) -> list[int]:
    """The weights versions a rollout scheduler's log (JSON lines) says it took."""
    versions: list[int] = []
    for line in scheduler_log.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and str(entry.get("msg", "")).startswith(
            ("weights updated", "weights recorded with no engine up")
        ):
            versions.append(int(entry["version"]))
    return versions


def checkpoint_host_dir(settings: Settings) -> Path:
    """The node's checkpoint folder, where the fault tests read the trainer's metrics log
    and mount a small volume: this machine is the node only on the local cluster."""
    if settings.checkpoint_host_dir is None:
        missing(
            "the node's checkpoint folder on this machine (the local cluster; "
            "KUBESTAR_E2E_CHECKPOINT_HOST_DIR, which e2e/local/run.sh sets)"
        )
    return settings.checkpoint_host_dir


@needs("chart", "fleet", "pool")
def test_trainer_scheduler_and_dispatcher_pods_deleted_mid_run_cost_seconds(
    tools: Tools, settings: Settings, request: pytest.FixtureRequest
) -> None:
    """Delete the trainer pod while step 2 rolls out, the scheduler pod while step 4's
    weights are pushed, upgrade the chart to a new kubestar image while step 5 rolls out,
    delete the sandbox dispatcher pod while a later step's tool calls run (at the latest in
    the last step's rollout, if no call reached the sandbox before): the run succeeds,
    each step is in the metrics log once and the status's step never falls, no rollout
    sampled from weights older than the previous step's, the step whose tool calls the
    deleted dispatcher was answering is trained once, the replacement scheduler got the
    weights by a push tried again, the upgrade replaced the operator, scheduler and sandbox
    pods but neither the engine (its image did not change) nor the trainer (Jobs are never
    changed), the fleet's status kept the weights, and the cost of each fault is in the notes
    and the suite's figures."""
    assert settings.upgrade_image, "KUBESTAR_E2E_UPGRADE_IMAGE names no image to upgrade to"
    host_dir = checkpoint_host_dir(settings)
    tools.kubectl_text("apply", "-n", settings.namespace, "-f", str(MANIFESTS / "faults-run.yaml"))
    faults = Injector(tools, settings.namespace, FAULTS)
    recorder = Recorder(tools, "trainingrun", FAULTS, settings.namespace, interval=1.0)
    recorder.start()
    trainer = (f"{INSTANCE}={FAULTS}", f"{COMPONENT}=trainer")
    try:
        status = faults.wait_status(
            "step 2's rollout", lambda s: activity(s) == "rolling out step 2", timeout=600
        )
        first_trainer = faults.running_pod(*trainer)
        faults.delete("trainer", first_trainer, status)
        faults.wait_step(3, timeout=600)

        version = 4
        status = faults.wait_status(
            f"step {version}'s weights push",
            lambda s: activity(s) == f"pushing weights v{version}",
            timeout=300,
        )
        scheduler_selector = (f"{INSTANCE}={FLEET}", f"{COMPONENT}=scheduler")
        scheduler = faults.running_pod(*scheduler_selector)
        faults.delete("scheduler", scheduler, status)

        # Step 5 rolls out with v4: the replacement scheduler got it, by the push's next try
        # or by the trainer's check before the rollout (its log is read before the upgrade
        # replaces that scheduler too). On the host's network the replacement waits for the
        # old pod's ports, so it may start after step 5's rollout did.
        faults.wait_status(
            "step 5's rollout", lambda s: activity(s) == "rolling out step 5", timeout=600
        )

        def replacement_with_weights() -> tuple[str, str] | None:
            for pod in set(faults.running_pods(*scheduler_selector)) - {scheduler}:
                log = tools.kubectl_text("logs", pod, "-n", settings.namespace)
                if version in weights_loaded(log):
                    return pod, log
            return None

        replacement, replacement_log = wait_for(
            f"the replacement scheduler to take weights v{version}",
            replacement_with_weights,
            timeout=300,
            interval=2,
            describe=functools.partial(pods_and_images, tools, settings),
        )
        (settings.out / f"{replacement}.log").write_text(replacement_log)
        status = faults.status()

        # A release of kubestar while step 5 rolls out (or about then): its own image changes
        # everywhere.
        engine_selector = (f"{INSTANCE}={FLEET}", f"{COMPONENT}=engine")
        engine, trainer_pod = faults.running_pod(*engine_selector), faults.running_pod(*trainer)
        repository, tag = settings.upgrade_image.rsplit(":", 1)
        faults.upgrade(
            upgrade_args(
                settings, f"images.kubestar.repository={repository}", f"images.kubestar.tag={tag}"
            ),
            status,
        )

        def upgraded_pod(instance: str, component: str) -> str:
            return wait_for(
                f"the upgraded {component} pod",
                functools.partial(
                    faults.pod_with_image,
                    settings.upgrade_image,
                    f"{INSTANCE}={instance}",
                    f"{COMPONENT}={component}",
                ),
                timeout=300,
                interval=2,
                describe=functools.partial(pods_and_images, tools, settings),
            )

        # In the middle of a step's tool calls: the first rollout from step 6 on in which
        # the upgraded dispatcher answers calls (the policy does not call the tool in every
        # step), at the latest the last step's. The other upgraded pods are waited for
        # after: the run may reach its last rollout while they start.
        dispatcher = upgraded_pod(POOL, "sandbox-dispatcher")
        status, answering = answering_tool_calls(
            faults, tools, settings, dispatcher, first_step=6, last_step=STEPS
        )
        faults.delete("dispatcher", dispatcher, status)
        settings.notes["dispatcher_deleted_answering_calls"] = answering
        upgraded = {
            "sandbox-dispatcher": dispatcher,
            **{c: upgraded_pod(i, c) for i, c in ((FLEET, "scheduler"), (POOL, "sandbox-worker"))},
        }
        settings.notes["upgraded_pods"] = upgraded

        final = finished_status(
            tools, settings, FAULTS, "the run with faults to finish", settings.run_timeout
        )
    finally:
        recorder.stop()
        recorder.dump(settings.out / "faults-statuses.jsonl")
        # The pods' own words, whatever happened (a failed trainer's pod stays in the Job).
        for selector in (trainer, (f"{INSTANCE}={FLEET}",), (f"{INSTANCE}={POOL}",)):
            faults.save_logs(settings.out / "faults-logs", *selector)
    assert final["phase"] == "Succeeded", json.dumps(final, indent=1)
    assert final["step"] == STEPS, final

    steps = metrics_log(host_dir, settings.namespace, FAULTS)
    (settings.out / "faults-metrics.jsonl").write_text(
        "".join(json.dumps(step) + "\n" for step in steps)
    )
    # What each fault cost (bench/RESULTS.md's fault table), kept before the checks below.
    report = cost(faults.faults, steps)
    report["rollout_attempts"] = [s.get("rollout_attempts") for s in steps]
    report["spoiled"] = [s.get("spoiled") for s in steps]
    settings.notes["faults"] = report
    (settings.out / "faults-cost.json").write_text(json.dumps(report, indent=2))
    figures(request.config).extend(cost_lines(report))
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), steps
    # Step N's rollouts sampled from weights N-1 (version 0: the SFT model).
    assert [s["oldest_weights_version"] for s in steps] == list(range(STEPS)), steps
    # The status never went back: its step never fell (a restarted trainer reports the step
    # the run had reached, then its checkpoint's), and its phases came in order, once each.
    seen_steps = [status.get("step", 0) for _, status in recorder.statuses]
    assert seen_steps == sorted(seen_steps), seen_steps
    phases = recorder.phases()
    order = ["Pending", "Provisioning", "SFT", "Training", "Succeeded"]
    assert set(phases) <= set(order), phases
    assert phases == sorted(set(phases), key=order.index), phases

    # The dispatcher was deleted while it answered the step's tool calls: the step is in the
    # log once (above). A deleted dispatcher drains the calls in flight before it exits, so
    # usually nothing is lost; a call that is lost spoils its trajectory, which stays out of
    # the groups, and too many spoiled roll the step out again (both in faults-cost.json).
    # The scheduler's deletion during the push of weights vN: the replacement started with
    # none and got vN again, by the push's next try or by the check before step N+1's
    # rollouts (the trainer counts both in the metrics log; its own log said so above).
    pushed, rolled_out = steps[version - 1], steps[version]
    assert pushed["weights_push_attempts"] > 1 or rolled_out["weights_pushed_again"] > 0, (
        pushed,
        rolled_out,
    )

    # The upgrade replaced what runs kubestar's image and left the engine and the trainer;
    # the scheduler it started got the current weights (from the operator, which keeps them
    # in the fleet's status, or from the trainer's check before a rollout).
    operator = [p["metadata"]["name"] for p in operator_pods(tools, settings) if pod_ready(p)]
    assert operator and operator != [Journey.operator_pod], operator
    assert faults.running_pod(*engine_selector) == engine
    upgraded_log = tools.kubectl_text("logs", upgraded["scheduler"], "-n", settings.namespace)
    (settings.out / f"{upgraded['scheduler']}.log").write_text(upgraded_log)
    loaded = weights_loaded(upgraded_log)
    assert loaded and loaded[0] >= version, upgraded_log[-3000:]
    settings.notes["upgraded_scheduler_weights"] = loaded

    def last_weights() -> Obj | None:
        fleet = tools.get("rolloutfleet", FLEET, settings.namespace) or {}
        weights: Obj = (fleet.get("status") or {}).get("weights") or {}
        return weights if weights.get("version", 0) >= STEPS - 1 else None

    settings.notes["fleet_weights"] = wait_for(
        "the fleet's status.weights to reach the last version pushed",
        last_weights,
        timeout=120,
        interval=2,
    )

    # The deleted pod (gone from the API once it exited) checkpointed step 2; the Job's next
    # pod waited for it to exit, then resumed from that checkpoint.
    # (The trainer reports Succeeded just before its pod exits.)
    wait_for(
        "the faults run's Job to complete",
        lambda: (
            tools.kubectl_json("get", "job", f"{FAULTS}-trainer", "-n", settings.namespace)[
                "status"
            ].get("succeeded")
            == 1
        ),
        timeout=120,
        interval=2,
    )
    (second,) = [p["metadata"]["name"] for p in tools.items("pods", settings.namespace, *trainer)]
    assert second != first_trainer
    assert second == trainer_pod  # the upgrade left the trainer's pod alone
    log = tools.kubectl_text("logs", second, "-n", settings.namespace)
    (settings.out / f"{second}.log").write_text(log)
    assert "waiting for pid" in log and ".trainer-worker-0.lock" in log, log[-3000:]
    assert re.search(r"resuming from \S+/step-000002 \(step 2\)", log), log[-3000:]


@needs("chart", "fleet", "pool")
def test_a_full_checkpoint_volume_fails_the_run_naming_it(tools: Tools, settings: Settings) -> None:
    """A run whose checkpoint claim is a 16 MiB tmpfs fails at its first weights with
    CheckpointVolumeFull naming the claim, and its Job does not retry (Kubernetes 1.20 has
    no podFailurePolicy: the operator stops it)."""
    folder = checkpoint_host_dir(settings).parent / "e2e-full-volume"
    folder.mkdir(exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=1777", "kubestar-e2e-full", str(folder)],
        check=True,
    )
    text = (
        (MANIFESTS / "full-volume-run.yaml")
        .read_text()
        .replace("NAMESPACE", settings.namespace)
        .replace("FOLDER", str(folder))
    )
    try:
        tools.kubectl_text("apply", "-n", settings.namespace, "-f", "-", input_text=text)

        final = finished_status(tools, settings, FULL, "the run on a full volume to fail", 600)
        assert final["phase"] == "Failed", json.dumps(final, indent=1)

        # The trainer reports Failed itself, then exits stating why; the operator shows it.
        def stated() -> Obj | None:
            ready = condition({"status": run_status(tools, settings, FULL)}, "TrainerReady")
            return ready if ready and ready["reason"] == "CheckpointVolumeFull" else None

        ready = wait_for("TrainerReady to say CheckpointVolumeFull", stated, 180, interval=2)
        assert "PersistentVolumeClaim e2e-full-volume" in ready["message"], ready
        settings.notes["checkpoint_volume_full"] = ready["message"]

        # No retry (Kubernetes 1.20 has no podFailurePolicy): the operator set the Job's
        # backoffLimit to 0 when the trainer reported Failed, so the trainer's exit failed the
        # Job (or, had it not exited in time, the Job was scaled to no pods).
        def stopped() -> Obj | None:
            job = tools.kubectl_json("get", "job", f"{FULL}-trainer", "-n", settings.namespace)
            failed = any(
                c.get("type") == "Failed" and c.get("status") == "True"
                for c in job.get("status", {}).get("conditions") or []
            )
            return job if failed or job["spec"].get("parallelism") == 0 else None

        job = wait_for("the full run's Job to fail or be scaled to no pods", stopped, timeout=60)
        pods = tools.items("pods", settings.namespace, f"{INSTANCE}={FULL}")
        assert len(pods) <= 1, [p["metadata"]["name"] for p in pods]
        assert job.get("status", {}).get("failed", 0) <= 1, job["status"]
    finally:
        tools.kubectl_run(
            "delete",
            "-n",
            settings.namespace,
            "-f",
            "-",
            "--wait=true",
            input_text=text,
            check=False,
            timeout=300,
        )
        subprocess.run(["umount", str(folder)], check=False)


@needs("chart", "pool")
def test_a_pool_without_the_isolation_it_needs_is_not_ready(
    tools: Tools, settings: Settings
) -> None:
    """Told to isolate by user namespaces, which this node's runtime refuses to non-root
    containers, the pool's new worker does not serve, and the pool says why. The chart's
    mechanism is set back afterwards: pools made later (the rehearsal's) must serve."""
    installed = json.loads(
        tools.helm("get", "values", settings.release, "-n", settings.system_namespace, "-a",
                   "-o", "json")
    )["sandbox"]["isolationMechanism"]  # fmt: skip
    tools.helm(
        "upgrade",
        *upgrade_args(settings, "sandbox.isolationMechanism=UserNamespace"),
        "--wait",
        "--timeout",
        "5m",
    )
    try:

        def unavailable() -> Obj | None:
            pool = tools.get("sandboxpool", POOL, settings.namespace) or {}
            ready = condition(pool, "Ready") or {}
            return ready if ready.get("reason") == "IsolationUnavailable" else None

        ready = wait_for(
            "the pool to say IsolationUnavailable",
            unavailable,
            timeout=300,
            interval=2,
            describe=lambda: json.dumps(
                tools.get("sandboxpool", POOL, settings.namespace), indent=1
            ),
        )
        settings.notes["isolation_unavailable"] = ready["message"]
        assert ready["status"] == "False", ready
        assert "unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: EPERM" in ready["message"], ready
        workers = tools.items(
            "pods",
            settings.namespace,
            f"app.kubernetes.io/instance={POOL}",
            "app.kubernetes.io/component=sandbox-worker",
        )
        assert workers and not any(pod_ready(pod) for pod in workers), workers
    finally:
        tools.helm(
            "upgrade",
            *upgrade_args(settings, f"sandbox.isolationMechanism={installed}"),
            "--wait",
            "--timeout",
            "5m",
        )


@needs("chart", "fleet", "pool", "run")
def test_delete_collects_every_child(tools: Tools, settings: Settings) -> None:
    def children() -> list[str]:
        items = tools.items(CHILD_KINDS, settings.namespace, MANAGED)
        return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in items)

    before = children()
    Journey.children = before
    (settings.out / "children-before-delete.txt").write_text("\n".join(before) + "\n")
    kinds = {name.split("/")[0] for name in before}
    # The run's ConfigMap/RBAC/Job, the fleet's engine and scheduler, the pool's workers and
    # dispatcher (with their pods and ReplicaSets), each resource's copy of the token.
    expected = {"Job", "ConfigMap", "Role", "StatefulSet", "Deployment", "Service", "Secret"}
    assert expected <= kinds, before
    tools.kubectl_text(
        "delete",
        "trainingrun,rolloutfleet,sandboxpool",
        "--all",
        "-n",
        settings.namespace,
        "--wait=true",
        timeout=300,
    )
    started = time.monotonic()
    wait_for(
        "every child to be garbage-collected",
        lambda: not children(),
        timeout=300,
        interval=2,
        describe=lambda: "\n".join(children()),
    )
    settings.notes["garbage_collection_s"] = round(time.monotonic() - started, 1)
    assert not tools.items("kubestar", settings.namespace)


REHEARSAL = "rehearsal"


@needs("chart")
def test_the_papers_recipe_rehearsed_at_small_scale(
    tools: Tools, settings: Settings, namespace: str, request: pytest.FixtureRequest
) -> None:
    """e2e/manifests/paper-rehearsal.yaml, the shape of examples/paper-amd.yaml made small:
    the model from a claim, SFT from the user's file, three stages with a length ramp and a
    k-of-k filter, 2 trainer pods x 2 processes, sampled evaluation. It succeeds, and its
    status, metrics log and pods' logs show each part did what its field says."""
    root = checkpoint_host_dir(settings).parent / "e2e-rehearsal"
    volumes = prepare_volumes(root)
    text = rehearsal_manifest(namespace, volumes)
    # The node pool the manifest's podOverrides select (every node here: the cluster has one).
    tools.kubectl_text("label", "nodes", "--all", f"{POOL_LABEL}=rehearsal", "--overwrite")
    tools.kubectl_text("apply", "-n", settings.namespace, "-f", "-", input_text=text)
    recorder = Recorder(tools, "trainingrun", REHEARSAL, settings.namespace)
    recorder.start()
    try:
        final = finished_status(
            tools, settings, REHEARSAL, "the rehearsal to finish", settings.run_timeout
        )
        recorder.stop()
        recorder.dump(settings.out / "rehearsal-statuses.jsonl")
        assert final["phase"] == "Succeeded", json.dumps(final, indent=1)
        # The final status may come after the recorder's last poll; an evaluation may pass
        # between two polls unseen.
        phases = recorder.phases()
        if phases[-1:] != [final["phase"]]:
            phases.append(final["phase"])
        expected = ["SFT", "Training", "Succeeded"]
        assert [p for p in phases if p in expected] == expected, phases
        check_rehearsal(tools, settings, final, request.config)
        check_overrides_reached_pods(tools, settings)
    finally:
        recorder.stop()
        tools.kubectl_run(
            "delete", "-n", settings.namespace, "-f", "-", "--wait=true",
            input_text=text, check=False, timeout=300,
        )  # fmt: skip
        tools.kubectl_run("label", "nodes", "--all", f"{POOL_LABEL}-", check=False)
        shutil.rmtree(root, ignore_errors=True)


POOL_LABEL = "e2e.kubestar.dev/pool"  # e2e/manifests/paper-rehearsal.yaml's podOverrides


def check_overrides_reached_pods(tools: Tools, settings: Settings) -> None:
    """The podOverrides of the rehearsal's fleet (engine) and run (trainer) are in their
    pods as the API server holds them, beside what kubestar sets (its own env and
    tolerations stay), and the pods ran on the labelled node."""
    for instance, component in (("rehearsal-fleet", "engine"), (REHEARSAL, "trainer")):
        pods = tools.items(
            "pods", settings.namespace, f"{INSTANCE}={instance}", f"{COMPONENT}={component}"
        )
        assert pods, f"no {component} pod of {instance}"
        for pod in pods:
            spec = pod["spec"]
            assert spec.get("nodeSelector", {}).get(POOL_LABEL) == "rehearsal", spec
            tolerations = spec.get("tolerations") or []
            assert {
                "key": "e2e.kubestar.dev/dedicated",
                "operator": "Exists",
                "effect": "NoSchedule",
            } in tolerations, tolerations
            container = spec["containers"][0]
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            assert env.get("E2E_POOL") == "rehearsal", env
            assert len(env) > 1, env  # kubestar's own variables stay
            assert spec.get("nodeName"), pod["metadata"]["name"]
    settings.notes["rehearsal_overrides_read_back"] = True


def check_rehearsal(tools: Tools, settings: Settings, final: Obj, config: pytest.Config) -> None:
    """What the rehearsal's status, metrics log and pods' logs say it did."""
    log = checkpoint_host_dir(settings) / settings.namespace / REHEARSAL / "run" / "metrics.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [e for e in entries if "stage_step" in e]
    # Each stage ran its steps with its own response budget, all four ranks in the world.
    budgets = {"stage1-32": 32, "stage2-48": 48, "stage3-48-hard": 48}
    assert [(e["stage"], e["max_response_tokens"]) for e in steps] == [
        ("stage1-32", 32), ("stage2-48", 48), ("stage3-48-hard", 48), ("stage3-48-hard", 48)
    ], steps  # fmt: skip
    assert all(e["world_size"] == 4 and e["trained_tokens"] > 0 for e in steps), steps
    # SFT trained on the file's four conversations.
    (sft,) = [e for e in entries if e["stage"] == "sft"]
    assert sft["examples"] == 4 and sft["dropped_too_long"] == 0, sft
    # The filter evaluated the stage's six problems (the repeated one read once) and the
    # stage trained on what it says it kept.
    (kept,) = final["stageFilters"]
    assert kept["stage"] == "stage3-48-hard" and kept["k"] == 4 and kept["evaluated"] == 6, kept
    assert 2 <= kept["kept"] <= 6, kept
    # Sampled evaluation: k = 4 at temperature 1, at the start and the end.
    evaluations = final["evaluations"]
    assert [e["point"] for e in evaluations] == ["start", "end"], evaluations
    for evaluation in evaluations:
        assert (evaluation["samples"], evaluation["temperature"]) == (4, 1.0), evaluation
        assert evaluation["problems"] == 2 and evaluation["passAtK"] >= evaluation["accuracy"]
    # Both trainer pods, two ranks each, read the model from its claim and trained every
    # step; rank 0 logged each stage's budget and the problems it kept.
    logs = {}
    for worker, job in enumerate((f"{REHEARSAL}-trainer", f"{REHEARSAL}-trainer-1")):
        text = tools.kubectl_text("logs", f"job/{job}", "-n", settings.namespace)
        (settings.out / f"{job}.log").write_text(text)
        assert f"rank {2 * worker} of 4, model /models/qwen3-coin" in text, text[-2000:]
        logs[worker] = rehearsal_log_lines(text)
    trained = [
        (e["rank"], e["world_size"])
        for w in logs
        for e in logs[w]
        if e.get("msg") == "rank trained"
    ]
    assert sorted(trained) == sorted([(rank, 4) for rank in range(4)] * len(steps)), trained
    started = [e for e in logs[0] if e.get("msg") == "stage"]
    assert [(e["stage"], e["max_response_tokens"]) for e in started] == list(budgets.items())
    assert started[-1]["problems"] == kept["kept"], started
    fleet = tools.kubectl_json("get", "deployment", "-n", settings.namespace, "-l",
                               f"{INSTANCE}=rehearsal-fleet,{COMPONENT}=engine")  # fmt: skip
    (engine,) = fleet["items"]
    command = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--model") + 1] == "/models/qwen3-coin", command
    # Figures for bench/RESULTS.md: seconds per stage, the filter, evaluation.
    per_stage: dict[str, float] = {}
    for entry in steps:
        per_stage[entry["stage"]] = per_stage.get(entry["stage"], 0.0) + entry["step_seconds"]
    seconds = ", ".join(f"{name} {value:.0f} s" for name, value in per_stage.items())
    figures(config).append(
        f"paper rehearsal: {len(steps)} steps ({seconds}); filter kept {kept['kept']} of "
        f"{kept['evaluated']}; SFT {sft['examples']:.0f} conversations in {sft['seconds']:.0f} s; "
        f"avg@4 {evaluations[-1]['accuracy']:.2f}, pass@4 {evaluations[-1]['passAtK']:.2f}"
    )


@needs("chart")
def test_every_dashboard_query_returns_data(settings: Settings, prometheus: Prometheus) -> None:
    """Each panel of the chart's Grafana dashboard, as Grafana would ask for it over the
    suite (the run, the faults, the rehearsal's evaluations), finds data in the Prometheus
    that scraped the suite's pods."""
    dashboard = json.loads((CHART / "dashboards" / "kubestar.json").read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expression = target["expr"].replace("$run", ".*")
            found = prometheus.query_range(expression, prometheus.started)
            if not any(not math.isnan(value) for series in found for value in values(series)):
                empty.append(f"{panel['title']}: {expression}")
    assert not empty, "\n".join(empty)


@needs("chart")
def test_helm_uninstall(tools: Tools, settings: Settings) -> None:
    tools.helm("uninstall", settings.release, "-n", settings.system_namespace, "--wait")
    settings.installed = False
    releases = json.loads(tools.helm("list", "-n", settings.system_namespace, "-o", "json"))
    assert releases == []
    wait_for(
        "the operator pods to go",
        lambda: not tools.items("pods", settings.system_namespace),
        timeout=180,
        interval=2,
    )
    tools.kubectl_text("delete", "namespace", settings.namespace, "--wait=true", timeout=300)
