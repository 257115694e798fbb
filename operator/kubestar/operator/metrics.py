"""Prometheus metrics of the operator (`--metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "kubestar_operator_reconciles_total",
    "Reconciles by resource kind and result (ok, error).",
    ["kind", "result"],
)
RECONCILE_SECONDS = Histogram(
    "kubestar_operator_reconcile_seconds",
    "Time one reconcile takes.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CHILD_APPLIES = Counter(
    "kubestar_operator_child_applies_total",
    "Child objects by kind and action (created, updated, unchanged, conflict).",
    ["kind", "action"],
)
STATUS_PATCHES = Counter(
    "kubestar_operator_status_patches_total", "Status subresource patches.", ["kind"]
)
EVENTS = Counter("kubestar_operator_events_total", "Kubernetes Events posted.", ["kind", "type"])
TRANSITIONS = Counter(
    "kubestar_operator_phase_transitions_total",
    "TrainingRun phase transitions.",
    ["phase"],
)
QUEUE_DEPTH = Gauge("kubestar_operator_queue_depth", "Resources waiting to be reconciled.")
IN_FLIGHT = Gauge("kubestar_operator_reconciles_in_flight", "Reconciles running now.")
RESOURCES = Gauge("kubestar_operator_resources", "Resources the operator knows, by kind.", ["kind"])
READY = Gauge(
    "kubestar_operator_resources_ready",
    "Resources whose Ready condition is True (pools, fleets), by kind.",
    ["kind"],
)
RUN_PHASES = Gauge("kubestar_operator_trainingruns", "TrainingRuns by phase.", ["phase"])
LEADER = Gauge("kubestar_operator_leader", "1 while this replica holds the leader lease.")
