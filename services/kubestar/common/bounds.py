"""What one gRPC server of kubestar's (sandbox, rollout scheduler) takes on at once, whoever
its clients are: refusals happen before a request is parsed or any work starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceBounds:
    """What one server takes on at once, whoever the clients are."""

    # RPCs in progress (a stream counts once); more are refused with RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 4096
    # HTTP/2 streams one connection may have open.
    max_concurrent_streams: int = 1024
    # RPCs arrived that the server has not yet taken up (gRPC's Python server takes them up
    # one at a time, so a burst waits here a moment). Beyond it gRPC drops them, answering
    # CANCELLED, which a client cannot tell from an RPC cancelled while it ran, so it does not
    # ask again: gRPC's default (dropping at random from 1,000) lost one RPC of a 1,400-RPC
    # burst in about three. Well above the RPCs in progress, whose bound refuses retryably.
    max_pending_rpcs: int = 16_384
    # Calls of one stream (the sandbox's ExecuteStream) running or queued at once; the
    # stream's next request is not read until one finishes (gRPC flow control then slows
    # the client).
    max_in_flight_per_stream: int = 4096
    # The server pings an idle connection this often and drops it when no answer comes in
    # keepalive_timeout_ms; clients may ping at most every min_ping_interval_ms (more often
    # is answered with GOAWAY).
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    min_ping_interval_ms: int = 10_000

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.server.max_pending_requests", self.max_pending_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", self.max_pending_rpcs),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]
