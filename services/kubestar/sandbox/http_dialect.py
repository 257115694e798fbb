"""What the sandbox's HTTP dialects (`kubestar.sandbox.sandbox_fusion`,
`kubestar.sandbox.code_judge`) are written with: request fields checked as FastAPI checks them
(bad input is a `FieldError`, answered 422 with the field's path), the error bodies, and the
`Runner` that runs a dialect's calls on the server's backend under its limit policy. The
server that serves them is `kubestar.sandbox.http_front`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kubestar.sandbox.backend import Backend, make_result, validate
from kubestar.sandbox.limits import LimitPolicy, MiB
from kubestar.v1 import sandbox_pb2 as pb

log = logging.getLogger(__name__)

Loc = tuple[str | int, ...]


class FieldError(Exception):
    """Bad input, answered 422 as FastAPI does. `loc` is the field's path in the body."""

    def __init__(self, loc: Loc, message: str, kind: str = "value_error") -> None:
        super().__init__(message)
        self.loc, self.message, self.kind = loc, message, kind


def field_name(loc: Loc) -> str:
    """("submissions", 3, "solution") -> "submissions[3].solution"."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name


def unprocessable(loc: Loc, message: str, kind: str = "value_error") -> web.Response:
    detail = [{"type": kind, "loc": ["body", *loc], "msg": message}]
    return web.json_response({"detail": detail}, status=422)


def detail(message: str, status: int, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"detail": message}, status=status, headers=headers)


# ---- request fields: each check names the field it refuses ---------------------------------


async def json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FieldError(
            (), f"the request body is not valid JSON: {error}", "json_invalid"
        ) from None


def an_object(value: Any, loc: Loc) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        where = field_name(loc) or "the request body"
        raise FieldError(loc, f"{where} must be a JSON object", "dict_type")
    return value


def string(
    body: Mapping[str, Any], name: str, loc: Loc = (), *, required: bool = False
) -> str | None:
    """A string field; None when absent or null (unless required)."""
    value = body.get(name)
    where = (*loc, name)
    if value is None:
        if required:
            raise FieldError(where, f"{field_name(where)}: field required", "missing")
        return None
    if not isinstance(value, str):
        raise FieldError(where, f"{field_name(where)} must be a string", "string_type")
    return value


def number(body: Mapping[str, Any], name: str, default: float, loc: Loc = ()) -> float:
    value = body.get(name, default)
    where = (*loc, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(float(value))
    ):
        raise FieldError(
            where, f"{field_name(where)} must be a number, not {value!r}", "float_type"
        )
    return float(value)


def integer(body: Mapping[str, Any], name: str, default: int, loc: Loc = ()) -> int:
    value = body.get(name, default)
    where = (*loc, name)
    # JSON has one number type: 512.0 is a whole number, as pydantic takes it.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(
            where, f"{field_name(where)} must be an integer, not {value!r}", "int_type"
        )
    return value


def string_list(body: Mapping[str, Any], name: str, loc: Loc = ()) -> list[str]:
    value = body.get(name)
    where = (*loc, name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(where, f"{field_name(where)} must be a list of strings", "list_type")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise FieldError(
                (*where, i), f"{field_name((*where, i))} must be a non-empty string", "string_type"
            )
    return value


def base64_files(body: Mapping[str, Any], name: str, loc: Loc = ()) -> dict[str, bytes]:
    """A dict from a file's path to its content, base64-encoded (null: no file)."""
    value = body.get(name)
    where = (*loc, name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError(
            where, f"{field_name(where)} must be an object of path: base64", "dict_type"
        )
    files: dict[str, bytes] = {}
    for path, content in value.items():
        at = (*where, path)
        if not path:
            raise FieldError(at, f"{field_name(where)} has an empty path", "value_error")
        if content is None:
            continue
        if not isinstance(content, str):
            raise FieldError(at, f"{field_name(where)}[{path!r}] must be a base64 string")
        try:
            files[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise FieldError(at, f"{field_name(where)}[{path!r}] is not valid base64") from None
    return files


# ---- running calls ------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """A dialect's limits for one call, in the dialect's own field names (for errors)."""

    timeout_seconds: float = 0.0  # 0: the server's default
    timeout_field: str = ""
    memory_bytes: int = 0  # 0: the server's default
    memory_field: str = ""


class Runner:
    """Runs a dialect's calls on the server's backend, under its limit policy."""

    def __init__(self, backend: Backend, policy: LimitPolicy) -> None:
        self.backend = backend
        self.policy = policy

    def check_limits(self, limits: Limits, loc: Loc = ()) -> None:
        """Refuse limits over this server's ceilings, naming the dialect's field."""
        ceiling = self.policy.maximum
        timeout = limits.timeout_seconds
        if limits.timeout_field and not 0 < timeout <= ceiling.timeout_seconds:
            where = (*loc, limits.timeout_field)
            raise FieldError(
                where,
                f"{field_name(where)}={timeout:g} must be more than 0 and at "
                f"most this sandbox's maximum of {ceiling.timeout_seconds:g} seconds",
            )
        if limits.memory_field and limits.memory_bytes > ceiling.memory_bytes:
            where = (*loc, limits.memory_field)
            raise FieldError(
                where,
                f"{field_name(where)}={limits.memory_bytes // MiB} exceeds this sandbox's "
                f"maximum of {ceiling.memory_bytes // MiB} MB",
            )

    def execution(self, code: str, stdin: str, limits: Limits) -> pb.Execution:
        """The call, or ValueError naming `code` or `stdin` (too large, a NUL byte)."""
        execution = pb.Execution(
            id=f"http-{uuid.uuid4().hex[:16]}",
            # An empty program runs, and succeeds, as `python empty.py` does; the backend
            # refuses empty code (a gRPC client's mistake), so it runs `pass` instead.
            code=code if code.strip() else "pass",
            stdin=stdin,
            limits=pb.ExecutionLimits(
                timeout_seconds=limits.timeout_seconds, memory_bytes=limits.memory_bytes
            ),
        )
        validate(execution, self.policy)
        return execution

    async def run(self, execution: pb.Execution) -> pb.ExecutionResult:
        try:
            return await self.backend.execute(execution)
        except Exception as error:  # a backend answers every call; this is the last guard
            log.exception("sandbox http call failed")
            return make_result(
                execution.id, pb.EXECUTION_STATUS_INTERNAL, f"internal error: {error}"
            )


def seconds(result: pb.ExecutionResult) -> float:
    return result.wall_ms / 1000.0
