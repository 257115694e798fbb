"""How fast the operator turns custom resources into children, against a real API server.

Starts the local control plane of e2e/local (etcd, kube-apiserver, kube-controller-manager
on 127.0.0.1; building the binaries first if they are not cached), applies the CRDs and runs
`kubestar operator run` as a separate process. There is no kubelet, so a fake one marks pods
running and ready as soon as they appear (that is what lets fleets and pools become Ready).

1. One run: `kubectl apply -f examples/tiny-cpu.yaml` (pool + fleet + run), timed from the
   start of kubectl to (a) all 14 children of the three resources created and (b) the
   trainer Job created once the pool's and fleet's pods are ready. Target: (a) < 2 s.
2. Throughput: 100 resources created at once (34 SandboxPools, 33 RolloutFleets, 33
   TrainingRuns that use them), timed to every child created and every status written, then
   to every trainer Job; any resource left without its children or status is "missed".
   Target: no errors, none missed.

    .venv/bin/python bench/operator_bench.py                 # ~1-2 minutes with cached binaries
    .venv/bin/python bench/operator_bench.py --repeat 10 --resources 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
# Run as a script (python bench/operator_bench.py): the repository's e2e package is not
# installed, so make the checkout importable.
sys.path.insert(0, str(ROOT))

from e2e.local_cluster import (  # noqa: E402
    Api,
    FakeKubelet,
    LocalCluster,
    OperatorProcess,
    apis,
    core,
    kubestar,
)

MANAGED = "app.kubernetes.io/managed-by=kubestar-operator"
CHILD_LISTS = [
    ("apps/v1", "statefulsets"),
    ("apps/v1", "deployments"),
    ("v1", "services"),
    ("v1", "configmaps"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("batch/v1", "jobs"),
]
# Children per kind before the trainer starts.
EXPECTED = {"SandboxPool": 4, "RolloutFleet": 6, "TrainingRun": 4}


def list_path(group_version: str, namespace: str, plural: str) -> str:
    if group_version == "v1":
        return core(namespace, plural)
    return apis(group_version, namespace, plural)


LISTER = ThreadPoolExecutor(len(CHILD_LISTS))


def children(api: Api, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """Managed children in a namespace, by owner "Kind/name" (the lists run in parallel)."""
    owners: dict[str, list[dict[str, Any]]] = {}
    lists = LISTER.map(
        lambda gp: (gp[1], api.items(list_path(gp[0], namespace, gp[1]), MANAGED)), CHILD_LISTS
    )
    for plural, items in lists:
        for item in items:
            for ref in item["metadata"].get("ownerReferences") or []:
                owners.setdefault(f"{ref['kind']}/{ref['name']}", []).append(
                    {"kind": plural, "name": item["metadata"]["name"]}
                )
    return owners


def until(check: Callable[[], bool], timeout: float, interval: float = 0.02) -> float | None:
    """Seconds until `check` holds (from the call), or None after `timeout`."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if check():
            return time.perf_counter() - started
        time.sleep(interval)
    return None


class Kubelet(threading.Thread):
    """Marks every managed pod in the watched namespaces running and ready."""

    def __init__(self, api: Api) -> None:
        super().__init__(daemon=True)
        self.fake = FakeKubelet(api)
        self.namespaces: set[str] = set()
        self.done: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for namespace in list(self.namespaces):
                for pod in self.fake.pods(namespace, MANAGED):
                    uid = pod["metadata"]["uid"]
                    component = pod["metadata"]["labels"].get("app.kubernetes.io/component")
                    if uid in self.done or component == "trainer":
                        continue
                    self.fake.set_status(pod, self.fake.running(pod))
                    self.done.add(uid)
            time.sleep(0.05)


def one_run(cluster: LocalCluster, kubelet: Kubelet, index: int) -> dict[str, float | None]:
    api = cluster.api()
    namespace = cluster.namespace(f"bench-one-{index}")
    kubelet.namespaces.add(namespace)
    started = time.perf_counter()
    cluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / "tiny-cpu.yaml"))
    applied = time.perf_counter() - started

    def all_children() -> bool:
        found = children(api, namespace)
        return (
            len(found.get("SandboxPool/tiny-sandbox", [])) >= 4
            and len(found.get("RolloutFleet/tiny-fleet", [])) >= 6
            and len(found.get("TrainingRun/tiny-cpu", [])) >= 4
        )

    waited = until(all_children, 30)
    children_s = None if waited is None else time.perf_counter() - started
    job = until(
        lambda: api.get(apis("batch/v1", namespace, "jobs", "tiny-cpu-trainer")) is not None,
        60,
    )
    job_s = None if job is None else time.perf_counter() - started
    return {
        "kubectl_apply_s": applied,
        "children_s": children_s,
        "operator_s": None if children_s is None else children_s - applied,
        "trainer_job_s": job_s,
    }


def manifests(count: int) -> list[dict[str, Any]]:
    docs = {
        d["kind"]: d
        for d in yaml.safe_load_all((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        if d
    }
    out: list[dict[str, Any]] = []
    pairs = count // 3
    kinds = (
        ["SandboxPool"] * (count - 2 * pairs) + ["RolloutFleet"] * pairs + ["TrainingRun"] * pairs
    )
    counters = {"SandboxPool": 0, "RolloutFleet": 0, "TrainingRun": 0}
    for kind in kinds:
        i = counters[kind]
        counters[kind] += 1
        doc = json.loads(json.dumps(docs[kind]))
        doc["metadata"]["name"] = {
            "SandboxPool": f"pool-{i}",
            "RolloutFleet": f"fleet-{i}",
            "TrainingRun": f"run-{i}",
        }[kind]
        if kind == "TrainingRun":
            doc["spec"]["rolloutFleetRef"]["name"] = f"fleet-{i}"
            doc["spec"]["sandboxPoolRef"]["name"] = f"pool-{i}"
        out.append(doc)
    return out


def throughput(
    cluster: LocalCluster, kubelet: Kubelet, operator: OperatorProcess, count: int
) -> dict[str, Any]:
    api = cluster.api()
    namespace = cluster.namespace("bench-many")
    docs = manifests(count)
    plural = {
        "SandboxPool": "sandboxpools",
        "RolloutFleet": "rolloutfleets",
        "TrainingRun": "trainingruns",
    }
    errors_before = _errors(operator)
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda d: api.create(kubestar(namespace, plural[d["kind"]]), d), docs))
    created_s = time.perf_counter() - started

    def missing() -> list[str]:
        found = children(api, namespace)
        statuses = {}
        for kind, name in plural.items():
            for item in api.items(kubestar(namespace, name)):
                statuses[f"{kind}/{item['metadata']['name']}"] = item.get("status") or {}
        lacking = []
        for doc in docs:
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            status = statuses.get(key, {})
            if len(found.get(key, [])) < EXPECTED[doc["kind"]] or not status.get("conditions"):
                lacking.append(key)
        return lacking

    state: dict[str, list[str]] = {"missing": []}

    def settled() -> bool:
        state["missing"] = missing()
        return not state["missing"]

    waited = until(settled, 120, 0.5)
    all_s = None if waited is None else time.perf_counter() - started
    kubelet.namespaces.add(namespace)
    runs = [d["metadata"]["name"] for d in docs if d["kind"] == "TrainingRun"]

    def jobs_done() -> bool:
        jobs = {
            j["metadata"]["name"] for j in api.items(apis("batch/v1", namespace, "jobs"), MANAGED)
        }
        return all(f"{run}-trainer" in jobs for run in runs)

    jobs_wait = until(jobs_done, 180, 0.5)
    jobs_s = None if jobs_wait is None else time.perf_counter() - started
    operator.wait_idle(settle=1.0, timeout=60)
    children_total = sum(len(v) for v in children(api, namespace).values())
    return {
        "resources": count,
        "create_s": created_s,
        "all_children_and_status_s": all_s,
        "resources_per_s": count / all_s if all_s else None,
        "all_trainer_jobs_s": jobs_s,
        "children": children_total,
        "missed": missing() if all_s is None else [],
        "reconcile_errors": _errors(operator) - errors_before,
    }


def _errors(operator: OperatorProcess) -> float:
    return sum(
        v
        for k, v in operator.metrics().items()
        if k.startswith("kubestar_operator_reconciles_total") and 'result="error"' in k
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="One-run measurements.")
    parser.add_argument("--resources", type=int, default=100)
    parser.add_argument("--json", default="", help="Also write the results here.")
    args = parser.parse_args()

    reason = LocalCluster.ensure_binaries()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kubestar-bench-") as tmp:
        cluster = LocalCluster(Path(tmp))
        cluster.start()
        try:
            cluster.apply_crds()
            operator = OperatorProcess(
                cluster.kubeconfig,
                {"resyncSeconds": 30, "probeSchedulers": False, "clusterWide": True},
                Path(tmp) / "operator.log",
                leader_election=True,
                lease_namespace="default",
            ).start()
            kubelet = Kubelet(cluster.api())
            kubelet.start()
            try:
                results = run_all(cluster, kubelet, operator, args)
            finally:
                kubelet.stop.set()
                operator.stop()
        finally:
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results["ok"] else 1


def run_all(
    cluster: LocalCluster, kubelet: Kubelet, operator: OperatorProcess, args: argparse.Namespace
) -> dict[str, Any]:
    print(
        f"control plane up in {cluster.startup_seconds:.1f} s (Kubernetes 1.20.2, "
        f"127.0.0.1:{cluster.port}); machine: {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    cluster.kubectl("api-resources")  # kubectl caches discovery: not part of the timings
    ones = [one_run(cluster, kubelet, i) for i in range(args.repeat)]
    print("\none run (pool + fleet + run from examples/tiny-cpu.yaml), seconds from kubectl:")
    print(f"{'':>6} {'kubectl':>8} {'children':>9} {'(operator)':>10} {'trainer Job':>12}")
    for i, one in enumerate(ones):
        print(
            f"{i:>6} {_fmt(one['kubectl_apply_s'])} {_fmt(one['children_s'], 9)} "
            f"{_fmt(one['operator_s'], 10)} {_fmt(one['trainer_job_s'], 12)}"
        )
    child_times = [o["children_s"] for o in ones if o["children_s"] is not None]
    job_times = [o["trainer_job_s"] for o in ones if o["trainer_job_s"] is not None]
    operator_times = [o["operator_s"] for o in ones if o["operator_s"] is not None]
    median_children = statistics.median(child_times) if child_times else None
    print(
        f"{'median':>6} {_fmt(statistics.median(o['kubectl_apply_s'] or 0 for o in ones))} "
        f"{_fmt(median_children, 9)} "
        f"{_fmt(statistics.median(operator_times) if operator_times else None, 10)} "
        f"{_fmt(statistics.median(job_times) if job_times else None, 12)}"
    )
    one_ok = median_children is not None and len(child_times) == len(ones) and median_children < 2.0
    print(
        f"all children within 2 s of kubectl (median): {'yes' if one_ok else 'NO'}, "
        f"{median_children or 0:.3f} s = {(2.0 / median_children) if median_children else 0:.1f}x"
        f" under the target; worst {_fmt(max(child_times) if child_times else None).strip()} s"
    )

    many = throughput(cluster, kubelet, operator, args.resources)
    print(f"\n{many['resources']} resources created at once (in {many['create_s']:.2f} s):")
    print(
        f"  every child and status:   {_fmt(many['all_children_and_status_s']).strip()} s "
        f"({many['resources_per_s'] or 0:.1f} resources/s, {many['children']} children)"
    )
    print(
        f"  every trainer Job:        {_fmt(many['all_trainer_jobs_s']).strip()} s "
        "(after the fake kubelet made their pods ready)"
    )
    print(
        f"  reconcile errors: {many['reconcile_errors']:.0f}; missed: {len(many['missed'])}"
        + (f" {many['missed'][:5]}" if many["missed"] else "")
    )
    metrics = operator.metrics()
    reconciles = sum(
        v for k, v in metrics.items() if k.startswith("kubestar_operator_reconcile_seconds_count")
    )
    seconds = sum(
        v for k, v in metrics.items() if k.startswith("kubestar_operator_reconcile_seconds_sum")
    )
    print(
        f"  operator: {reconciles:.0f} reconciles, mean {1000 * seconds / max(reconciles, 1):.1f}"
        " ms each"
    )
    many_ok = (
        not many["missed"]
        and many["reconcile_errors"] == 0
        and many["all_trainer_jobs_s"] is not None
    )
    return {
        "one_run": ones,
        "throughput": many,
        "ok": one_ok and many_ok,
        "reconciles": reconciles,
        "reconcile_seconds": seconds,
    }


def _fmt(value: float | None, width: int = 8) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    sys.exit(main())
