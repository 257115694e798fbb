"""Prometheus metrics of a sandbox server (worker or dispatcher)."""

from __future__ import annotations

from kubestar.v1 import sandbox_pb2 as pb
from prometheus_client import Counter, Gauge, Histogram

QUEUE_DEPTH = Gauge("kubestar_sandbox_queue_depth", "Calls waiting for an executor or worker")
IN_FLIGHT = Gauge("kubestar_sandbox_in_flight", "Calls running now")
CAPACITY = Gauge("kubestar_sandbox_capacity", "Calls this server runs at once")
READY_WORKERS = Gauge("kubestar_sandbox_ready_workers", "Workers a dispatcher can reach")
RESULTS = Counter("kubestar_sandbox_results", "Results returned, by status", ["status"])
RETRIES = Counter("kubestar_sandbox_retries", "Calls started again after a worker failed")
EXECUTOR_RESTARTS = Counter("kubestar_sandbox_executor_restarts", "Executors restarted")
ZYGOTE_CALLS = Counter(
    "kubestar_sandbox_zygote_calls",
    "Calls run by executors, by zygote (light: no preloaded modules)",
    ["zygote"],
)
LIGHT_CALLS = ZYGOTE_CALLS.labels("light")
PRELOADED_CALLS = ZYGOTE_CALLS.labels("preloaded")
LATENCY = Histogram(
    "kubestar_sandbox_call_seconds",
    "Time from receiving a call to its result",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def status_label(status: pb.ExecutionStatus) -> str:
    """`EXECUTION_STATUS_OUTPUT_LIMIT` -> `output-limit`, as the CLI and logs spell it."""
    return (
        pb.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_").lower().replace("_", "-")
    )


_RESULTS_BY_STATUS: dict[int, Counter] = {}


def observe_result(result: pb.ExecutionResult, seconds: float) -> None:
    counter = _RESULTS_BY_STATUS.get(result.status)
    if counter is None:  # labels() looks the child up under a lock: once per status
        counter = _RESULTS_BY_STATUS[result.status] = RESULTS.labels(status_label(result.status))
    counter.inc()
    LATENCY.observe(seconds)
