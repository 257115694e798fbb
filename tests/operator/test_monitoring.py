"""The chart's monitoring: PodMonitors, a ServiceMonitor and the Grafana dashboard, off by
default; every series the dashboard queries is one kubestar (or its vLLM engines) exports.
make e2e runs each query against a real Prometheus scraping a real run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubestar.operator.metrics
import kubestar.sandbox.metrics
from kubestar.scheduler.core import EngineState
from kubestar.scheduler.metrics import SchedulerMetrics
from kubestar.scoring.metrics import ScoringMetrics
from kubestar.training.telemetry import TrainerMetrics
from prometheus_client import REGISTRY, CollectorRegistry

from tests.operator.support import CHART
from tests.operator.test_auth import render

DASHBOARD = CHART / "dashboards" / "kubestar.json"
# vLLM's own series, which its engines serve on their port (the scheduler reads the same).
VLLM_SERIES = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def series(registry: CollectorRegistry) -> set[str]:
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def exported_series() -> set[str]:
    scheduler = SchedulerMetrics()
    scheduler.watch_engines(lambda: [EngineState(name="engine-0")])
    names = series(REGISTRY)  # the sandbox's and the operator's
    for registry in (scheduler.registry, TrainerMetrics("r").registry, ScoringMetrics().registry):
        names |= series(registry)
    assert kubestar.sandbox.metrics.RESULTS and kubestar.operator.metrics.RECONCILES
    return names


def test_every_series_the_dashboard_queries_is_exported() -> None:
    queries = dashboard_queries()
    named = {
        name
        for query in queries
        for name in re.findall(r"\b(?:kubestar_[a-z_]+|vllm:[a-z_:]+)", query)
    }
    missing = named - exported_series() - VLLM_SERIES
    assert not missing, sorted(missing)
    # A row per plane, and the training row reads the trainer's series.
    rows = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    assert rows == ["Training", "Rollout", "Sandbox", "Faults"]
    assert {"kubestar_trainer_step", "kubestar_trainer_reward"} <= named


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def test_monitors_and_the_dashboard_are_off_by_default(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert not by_kind(docs, "PodMonitor") and not by_kind(docs, "ServiceMonitor")
    assert not [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard")
    ]
    # Without them, Prometheus finds the operator by its annotations.
    (deployment,) = by_kind(docs, "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"


def test_monitors_select_the_watched_namespaces_and_each_port(tmp_path: Path) -> None:
    docs = render(
        tmp_path,
        "monitoring.podMonitors.enabled=true",
        "monitoring.podMonitors.labels.release=prom",
        "monitoring.serviceMonitor.enabled=true",
        "operator.watchNamespaces={a,b}",
    )
    monitors = {d["metadata"]["name"]: d for d in by_kind(docs, "PodMonitor")}
    assert sorted(monitors) == ["kubestar-components", "kubestar-engines"]
    for monitor in monitors.values():
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    engines = monitors["kubestar-engines"]["spec"]
    assert engines["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert [e["port"] for e in engines["podMetricsEndpoints"]] == ["http"]
    components = monitors["kubestar-components"]["spec"]
    assert [e["port"] for e in components["podMetricsEndpoints"]] == ["metrics"]
    (service_monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("metrics")]
    labels = service_monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= service["metadata"]["labels"].items()

    everywhere = render(
        tmp_path, "monitoring.podMonitors.enabled=true", "operator.clusterWide=true"
    )
    for monitor in by_kind(everywhere, "PodMonitor"):
        assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_the_dashboard_configmap_is_what_grafanas_sidecar_loads(tmp_path: Path) -> None:
    docs = render(
        tmp_path, "monitoring.dashboard.enabled=true", "monitoring.dashboard.namespace=grafana"
    )
    (dashboard,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard")
    ]
    assert dashboard["metadata"]["namespace"] == "grafana"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kubestar.json"]) == json.loads(DASHBOARD.read_text())
