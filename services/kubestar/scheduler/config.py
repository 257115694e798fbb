"""The scheduler's settings: its policy, how often it watches the engines, when it gives up on
one, and how it cuts long turns into segments."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubestar.scheduler.core import DEFAULT_STARVATION_SECONDS, KV_AWARE, POLICIES


@dataclass
class SchedulerConfig:
    policy: str = KV_AWARE
    # Seconds between /metrics scrapes of a healthy engine, and between probes of a failed one.
    poll_interval: float = 0.2
    probe_interval: float = 1.0
    scrape_timeout: float = 5.0
    # Failed scrapes in a row that take an engine out (a failed turn does it at once).
    failure_threshold: int = 3
    # Scrapes that time out take an engine out only after this long without an answer.
    unresponsive_seconds: float = 30.0
    # The longest one turn may take on an engine.
    request_timeout: float = 3600.0
    # A turn fails after this many engines failed under it.
    max_attempts: int = 4
    starvation_seconds: float = DEFAULT_STARVATION_SECONDS
    # Trajectories whose engine is remembered (oldest forgotten first).
    affinity_limit: int = 100_000
    # How long start() and add_engine() wait for the first probe of an engine.
    startup_timeout: float = 10.0
    # kv-aware: the most new tokens one admission reserves room for; a longer turn runs in
    # segments of this size (0: the whole turn at once). Best a multiple of the block size.
    segment_tokens: int = 256
    # An engine whose weight reload has not finished after this many seconds is taken out
    # (and loads the weights again when it comes back): one stuck engine cannot hang a step.
    weights_reload_timeout: float = 600.0
    # The bearer token the engines require (their kubestar.engine.auth_middleware); "" sends
    # none.
    engine_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.segment_tokens < 0:
            raise ValueError("segment_tokens must be 0 (whole turns) or more")
