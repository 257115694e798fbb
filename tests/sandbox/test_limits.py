"""Unit tests (no server): LimitPolicy.resolve, backend.validate, gRPC message sizes."""

from __future__ import annotations

import math

import pytest
from kubestar.sandbox.backend import validate
from kubestar.sandbox.limits import (
    MAX_MESSAGE_BYTES,
    CallLimits,
    LimitPolicy,
    MiB,
    message_options,
)
from kubestar.v1 import sandbox_pb2 as pb

POLICY = LimitPolicy(
    default=CallLimits(timeout_seconds=5.0, memory_bytes=64 * MiB, output_bytes=1000),
    maximum=CallLimits(timeout_seconds=20.0, memory_bytes=256 * MiB, output_bytes=10_000),
    max_code_bytes=100,
    max_stdin_bytes=50,
)


def execution(
    code: str = "print(1)",
    stdin: str = "",
    timeout_seconds: float = 0.0,
    memory_bytes: int = 0,
    output_bytes: int = 0,
) -> pb.Execution:
    return pb.Execution(
        id="x",
        code=code,
        stdin=stdin,
        limits=pb.ExecutionLimits(
            timeout_seconds=timeout_seconds, memory_bytes=memory_bytes, output_bytes=output_bytes
        ),
    )


class TestResolve:
    def test_zeros_take_the_defaults(self) -> None:
        assert POLICY.resolve(0.0, 0, 0) == POLICY.default

    def test_default_policy_defaults(self) -> None:
        assert LimitPolicy().resolve(0, 0, 0) == CallLimits()

    def test_given_values_are_kept(self) -> None:
        limits = POLICY.resolve(1.5, 32 * MiB, 500)
        assert limits == CallLimits(timeout_seconds=1.5, memory_bytes=32 * MiB, output_bytes=500)
        assert isinstance(limits.timeout_seconds, float)
        assert isinstance(limits.memory_bytes, int)
        assert isinstance(limits.output_bytes, int)

    def test_each_zero_is_filled_on_its_own(self) -> None:
        assert POLICY.resolve(2.0, 0, 0) == CallLimits(2.0, 64 * MiB, 1000)
        assert POLICY.resolve(0.0, MiB, 0) == CallLimits(5.0, MiB, 1000)
        assert POLICY.resolve(0.0, 0, 7) == CallLimits(5.0, 64 * MiB, 7)

    def test_the_maximum_itself_is_allowed(self) -> None:
        assert POLICY.resolve(20.0, 256 * MiB, 10_000) == POLICY.maximum

    def test_integer_timeout_becomes_float(self) -> None:
        limits = POLICY.resolve(3, 0, 0)
        assert limits.timeout_seconds == 3.0
        assert isinstance(limits.timeout_seconds, float)

    @pytest.mark.parametrize(
        ("args", "field"),
        [
            ((-1.0, 0, 0), "timeout_seconds"),
            ((-0.001, 0, 0), "timeout_seconds"),
            ((0.0, -1, 0), "memory_bytes"),
            ((0.0, 0, -5), "output_bytes"),
        ],
    )
    def test_negative_is_rejected_naming_the_field(
        self, args: tuple[float, int, int], field: str
    ) -> None:
        with pytest.raises(ValueError, match=rf"limits\.{field} must not be negative"):
            POLICY.resolve(*args)

    @pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
    def test_non_finite_timeout_is_rejected(self, value: float) -> None:
        with pytest.raises(ValueError, match=r"limits\.timeout_seconds must be a finite number"):
            POLICY.resolve(value, 0, 0)

    @pytest.mark.parametrize(
        ("args", "field"),
        [
            ((20.5, 0, 0), "timeout_seconds"),
            ((0.0, 256 * MiB + 1, 0), "memory_bytes"),
            ((0.0, 0, 10_001), "output_bytes"),
        ],
    )
    def test_over_the_maximum_is_rejected_naming_the_field(
        self, args: tuple[float, int, int], field: str
    ) -> None:
        with pytest.raises(ValueError, match=rf"limits\.{field}=.* exceeds this server's maximum"):
            POLICY.resolve(*args)

    def test_first_bad_field_is_reported(self) -> None:
        with pytest.raises(ValueError, match=r"limits\.timeout_seconds"):
            POLICY.resolve(-1.0, -1, -1)


class TestValidate:
    def test_valid_call_returns_resolved_limits(self) -> None:
        limits = validate(execution(timeout_seconds=2.0, output_bytes=99), POLICY)
        assert limits == CallLimits(timeout_seconds=2.0, memory_bytes=64 * MiB, output_bytes=99)

    def test_unset_limits_take_the_defaults(self) -> None:
        assert validate(pb.Execution(id="x", code="pass"), POLICY) == POLICY.default

    @pytest.mark.parametrize("code", ["", " ", "\n\n", " \t\r\n "])
    def test_empty_or_blank_code(self, code: str) -> None:
        with pytest.raises(ValueError, match="code is empty"):
            validate(execution(code=code), POLICY)

    def test_code_at_the_limit_is_accepted(self) -> None:
        validate(execution(code="#" * 100), POLICY)

    def test_code_over_the_limit(self) -> None:
        with pytest.raises(ValueError, match="code is 101 bytes; the maximum is 100"):
            validate(execution(code="#" * 101), POLICY)

    def test_code_size_counts_utf8_bytes(self) -> None:
        code = "#" + "é" * 50  # 51 characters, 101 bytes
        with pytest.raises(ValueError, match="code is 101 bytes"):
            validate(execution(code=code), POLICY)

    def test_nul_byte_in_code(self) -> None:
        with pytest.raises(ValueError, match="code contains a NUL byte"):
            validate(execution(code="print(1)\x00"), POLICY)

    def test_stdin_over_the_limit(self) -> None:
        validate(execution(stdin="x" * 50), POLICY)
        with pytest.raises(ValueError, match="stdin is 51 bytes; the maximum is 50"):
            validate(execution(stdin="x" * 51), POLICY)

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"timeout_seconds": -1.0}, "limits.timeout_seconds"),
            ({"timeout_seconds": math.nan}, "limits.timeout_seconds"),
            ({"timeout_seconds": 1e9}, "limits.timeout_seconds"),
            ({"memory_bytes": -1}, "limits.memory_bytes"),
            ({"memory_bytes": 2**40}, "limits.memory_bytes"),
            ({"output_bytes": -1}, "limits.output_bytes"),
            ({"output_bytes": 2**30}, "limits.output_bytes"),
        ],
    )
    def test_bad_limits_name_the_field(self, kwargs: dict[str, float], field: str) -> None:
        with pytest.raises(ValueError) as raised:
            validate(execution(**kwargs), POLICY)  # type: ignore[arg-type]
        assert field in str(raised.value)

    def test_code_is_checked_before_limits(self) -> None:
        with pytest.raises(ValueError, match="code is empty"):
            validate(execution(code="", timeout_seconds=-1.0), POLICY)


class TestMessageSize:
    def test_the_largest_result_fits_in_a_message(self) -> None:
        policy = LimitPolicy()
        # stdout and stderr at the ceiling, each byte invalid UTF-8 (a 3-byte U+FFFD)
        largest = pb.ExecutionResult(
            id="x" * 64,
            stdout="\ufffd" * policy.maximum.output_bytes,
            stderr="\ufffd" * policy.maximum.output_bytes,
            message="m" * 200,
            executor="worker/executor-0/light",
        )
        assert largest.ByteSize() <= policy.max_result_bytes <= MAX_MESSAGE_BYTES
        sizes = dict(message_options(policy))
        assert sizes["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
        assert sizes["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES

    def test_higher_ceilings_raise_the_message_size(self) -> None:
        policy = LimitPolicy(maximum=CallLimits(output_bytes=64 * MiB))
        sizes = dict(message_options(policy))
        assert sizes["grpc.max_receive_message_length"] == policy.max_result_bytes
        assert policy.max_result_bytes > 2 * 3 * 64 * MiB
