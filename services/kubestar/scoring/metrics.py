"""Prometheus metrics of a scoring server.

Each server has its own registry (several can live in one process, e.g. in tests); the
server exposes it with `start_metrics_server(..., registry)`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "kubestar_scoring"
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144)


class ScoringMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Score requests answered, by gRPC status", ["code"], registry=r
        )
        self.sequences = Counter(f"{PREFIX}_sequences", "Sequences scored", registry=r)
        self.batches = Counter(f"{PREFIX}_batches", "Forward passes of the model", registry=r)
        self.queued = Gauge(
            f"{PREFIX}_queued_sequences", "Sequences waiting for a batch", registry=r
        )
        self.batch_sequences = Histogram(
            f"{PREFIX}_batch_sequences",
            "Sequences per forward pass",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens",
            "Padded tokens per forward pass (rows x the longest row)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_seconds",
            "Time of one forward pass",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_seconds",
            "Time from a Score request's arrival to its answer",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
