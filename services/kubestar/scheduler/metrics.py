"""Prometheus metrics of the rollout scheduler.

Each scheduler has its own registry (several can live in one process, e.g. in tests); the
server exposes it with `start_http_server(port, registry=...)`. Per-engine gauges are read
from the scheduler's state at scrape time, so a removed engine simply disappears.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kubestar.scheduler.core import EngineState
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "kubestar_scheduler"
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _EngineCollector(Collector):
    def __init__(self, engines: Callable[[], Sequence[EngineState]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        gauges: dict[str, tuple[str, Callable[[EngineState], float]]] = {
            "healthy": ("1 while the engine answers and takes turns", lambda e: e.admitting),
            "capacity_tokens": ("KV capacity (blocks x block size)", lambda e: e.capacity_tokens),
            "free_tokens": ("KV tokens the scheduler may still reserve", lambda e: e.free_tokens),
            "reserved_tokens": (
                "KV tokens reserved for turns in flight (prompt + max new tokens)",
                lambda e: e.reserved_tokens,
            ),
            "in_flight": ("Turns the scheduler has running on the engine", lambda e: e.in_flight),
            "kv_usage": ("vllm:kv_cache_usage_perc at the last scrape", lambda e: e.kv_usage),
            "engine_running": ("vllm:num_requests_running", lambda e: e.running),
            "engine_waiting": ("vllm:num_requests_waiting", lambda e: e.waiting),
            "engine_preemptions": ("vllm:num_preemptions_total", lambda e: e.preemptions),
            "affinity_trajectories": (
                "Trajectories whose prefix the engine holds",
                lambda e: len(e.trajectories),
            ),
        }
        engines = list(self._engines())
        for suffix, (documentation, value) in gauges.items():
            family = GaugeMetricFamily(
                f"{PREFIX}_engine_{suffix}", documentation, labels=["engine"]
            )
            for engine in engines:
                family.add_metric([engine.name], float(value(engine)))
            yield family


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge(f"{PREFIX}_queue_length", "Turns waiting for room", registry=r)
        self.admitted = Counter(
            f"{PREFIX}_admitted",
            "Turns sent to an engine (retries included)",
            ["engine"],
            registry=r,
        )
        self.queued = Counter(
            f"{PREFIX}_queued", "Turns that had to wait in the queue on arrival", registry=r
        )
        self.retried = Counter(
            f"{PREFIX}_retried", "Turns sent again after their engine failed", registry=r
        )
        self.segments = Counter(
            f"{PREFIX}_segments",
            "Turn segments that ended with the turn still going (kv-aware: segment_tokens)",
            registry=r,
        )
        self.moved = Counter(
            f"{PREFIX}_moved",
            "Segments restarted on another engine: taken from a much slower one (kv-aware) "
            "or from one taken out of the fleet",
            registry=r,
        )
        self.completed = Counter(f"{PREFIX}_completed", "Turns generated", registry=r)
        self.failed = Counter(
            f"{PREFIX}_failed", "Turns that ended in an error, by reason", ["reason"], registry=r
        )
        self.engine_failures = Counter(
            f"{PREFIX}_engine_failures", "Times an engine was taken out", ["engine"], registry=r
        )
        self.queue_seconds = Histogram(
            f"{PREFIX}_queue_seconds",
            "Time a turn waited for room",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.generate_seconds = Histogram(
            f"{PREFIX}_generate_seconds",
            "Time an engine took for a turn",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.turn_seconds = Histogram(
            f"{PREFIX}_turn_seconds",
            "Time from a turn's arrival to its answer",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.weights_version = Gauge(
            f"{PREFIX}_weights_version", "Policy weights version the engines serve", registry=r
        )
        self.weights_reload_seconds = Histogram(
            f"{PREFIX}_weights_reload_seconds",
            "Time to load new weights on every engine",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )

    def watch_engines(self, engines: Callable[[], Sequence[EngineState]]) -> None:
        self.registry.register(_EngineCollector(engines))
