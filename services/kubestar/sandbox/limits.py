"""Per-call limits and the server's defaults and ceilings for them."""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1024 * 1024
# What every sandbox server and client lets one gRPC message be, sent or received, instead of
# gRPC's default receive limit of 4 MiB (an over-size message fails the whole call or stream
# it travels on: on the dispatcher's stream to a worker, every call running there). It holds
# the largest result the default ceilings allow (see LimitPolicy.max_result_bytes); a policy
# with higher ceilings raises it (message_options).
MAX_MESSAGE_BYTES = 256 * MiB
# A result's fields besides its output (id, message, executor name, numbers), with room.
RESULT_OVERHEAD_BYTES = 64 * 1024
# UTF-8 bytes one output byte may become: the worker decodes output as UTF-8, replacing each
# invalid byte with U+FFFD (3 bytes).
DECODED_BYTES_PER_OUTPUT_BYTE = 3


@dataclass(frozen=True)
class CallLimits:
    """Limits of one call, after defaults were applied and ceilings checked."""

    timeout_seconds: float = 10.0
    memory_bytes: int = 512 * MiB
    output_bytes: int = 64 * 1024


@dataclass(frozen=True)
class LimitPolicy:
    """What a server applies when a request leaves a limit at zero, and the most it allows."""

    default: CallLimits = CallLimits()
    maximum: CallLimits = CallLimits(
        timeout_seconds=300.0, memory_bytes=8192 * MiB, output_bytes=16 * MiB
    )
    max_code_bytes: int = 1 * MiB
    max_stdin_bytes: int = 4 * MiB
    # Limits of the whole call process tree, not negotiable per request.
    max_processes: int = 32
    max_file_bytes: int = 64 * MiB
    max_open_files: int = 256

    @property
    def max_result_bytes(self) -> int:
        """The largest ExecutionResult a call within this policy can produce: stdout and
        stderr both at the output ceiling, every byte invalid UTF-8."""
        output = 2 * self.maximum.output_bytes * DECODED_BYTES_PER_OUTPUT_BYTE
        return output + RESULT_OVERHEAD_BYTES

    def resolve(self, timeout_seconds: float, memory_bytes: int, output_bytes: int) -> CallLimits:
        """Fill zeros with defaults; raise ValueError naming the field for bad values."""
        values = {
            "timeout_seconds": timeout_seconds,
            "memory_bytes": memory_bytes,
            "output_bytes": output_bytes,
        }
        resolved: dict[str, float | int] = {}
        for name, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"limits.{name} must be a finite number, got {value}")
            if value < 0:
                raise ValueError(f"limits.{name} must not be negative, got {value}")
            ceiling = getattr(self.maximum, name)
            if value > ceiling:
                raise ValueError(f"limits.{name}={value} exceeds this server's maximum {ceiling}")
            resolved[name] = value if value else getattr(self.default, name)
        return CallLimits(
            timeout_seconds=float(resolved["timeout_seconds"]),
            memory_bytes=int(resolved["memory_bytes"]),
            output_bytes=int(resolved["output_bytes"]),
        )


# What a sandbox server accepts, checked before anything is parsed or run.
# One request message: a batch of calls larger than this fails whole (RESOURCE_EXHAUSTED,
# before parsing); split it.
MAX_REQUEST_BYTES = 64 * MiB
# A call's id: ids are echoed in results and logged.
MAX_ID_BYTES = 256


def message_options(policy: LimitPolicy | None = None) -> list[tuple[str, int]]:
    """gRPC options of a sandbox server or channel: messages up to MAX_MESSAGE_BYTES, or the
    largest result `policy` allows if that is more."""
    size = max(MAX_MESSAGE_BYTES, (policy or LimitPolicy()).max_result_bytes)
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


def server_message_options(policy: LimitPolicy | None = None) -> list[tuple[str, int]]:
    """A server receives requests (up to MAX_REQUEST_BYTES) and sends results (up to the
    largest the policy allows)."""
    size = max(MAX_MESSAGE_BYTES, (policy or LimitPolicy()).max_result_bytes)
    return [
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", size),
    ]
