"""SandboxFusion's dialect (bytedance/SandboxFusion), as verl's sandbox-fusion reward utilities
and tools call it: `POST /run_code` and `GET /v1/ping`.

A request: `code`, `language`, `run_timeout` (seconds; absent: the server's default,
`--call-timeout`, which the operator sets to the SandboxPool's spec.limits.timeoutSeconds),
`compile_timeout` (no compile step for Python: checked, then unused), `memory_limit_MB` (-1, 0
or absent: the server's default, `--call-memory-mib`: spec.limits.memoryMib), `stdin`,
`files` (path -> base64 content, written into the call's working directory before the code
runs) and `fetch_files` (paths read back after it ran, returned base64 in
`files`). Python only: any other language is answered `SandboxError`, saying so.

The answer's `status`: `Success` (ran and exited 0), `Failed` (the code failed: non-zero exit,
a time limit, the memory or output limit) or `SandboxError` (the sandbox failed, not the code).
`run_result` has `status` `Finished` or `TimeLimitExceeded`, `execution_time` (seconds),
`return_code` (null after a time limit, as SandboxFusion gives it), `stdout` and `stderr`
(strings, never null); it is null when nothing ran (another language, no executor free in
time, no worker reachable: a `SandboxError` whose `message` says which). `compile_result` is
null (Python compiles nothing first).

`run_result.status` `Error` is SandboxFusion's for a command the sandbox itself failed to run
to an end (its process could not be started or waited for): the answer is then a
`SandboxError` whose `message` is that run's `stderr`, and the run's other fields are null.
Here that is a call the sandbox tried to run and lost on every attempt (its executor or worker
died, or refused it, each time: the result counts attempts).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from kubestar.sandbox.http_dialect import (
    FieldError,
    Limits,
    Runner,
    an_object,
    base64_files,
    integer,
    json_body,
    number,
    seconds,
    string,
    string_list,
)
from kubestar.sandbox.limits import MiB
from kubestar.v1 import sandbox_pb2 as pb

# SandboxFusion's default compile timeout (checked, then unused).
DEFAULT_TIMEOUT_SECONDS = 10.0
LANGUAGE = "python"

# What the call wrapped for `files`/`fetch_files` runs: it writes the files into its working
# directory, runs the code as the script it is (its own `__main__` namespace, filename
# `<tool_call>`, and a traceback that starts at the code, with no frame of this wrapper), then
# writes what `fetch_files` names, hex-encoded (no module but `os` and `sys` is imported: the
# light executor imported nothing), between two markers on stderr that the server takes out.
# A call that ends with os._exit() or is killed fetches nothing.
_WRAPPER = """\
import os as _os, sys as _sys
_cwd = _os.getcwd()
for _name, _data in {files!r}:
    _path = _os.path.join(_cwd, _name)
    _os.makedirs(_os.path.dirname(_path), exist_ok=True)
    with open(_path, "wb") as _file:
        _file.write(_data)
_main = {{"__name__": "__main__", "__builtins__": __builtins__}}
try:
    exec(compile({code!r}, "<tool_call>", "exec"), _main)
except BaseException as _error:
    _error.__traceback__ = _error.__traceback__.tb_next
    raise
finally:
    _fetched = []
    for _index, _name in enumerate({fetch!r}):
        _path = _os.path.join(_cwd, _name)
        try:
            if _os.path.isfile(_path):
                with open(_path, "rb") as _file:
                    _fetched.append("%d:%s" % (_index, _file.read().hex()))
        except OSError:
            pass
    _sys.__stderr__.write({opening!r} + ";".join(_fetched) + {closing!r})
    _sys.__stderr__.flush()
"""


def add_routes(app: web.Application, runner: Runner) -> None:
    async def run_code(request: web.Request) -> web.Response:
        return web.json_response(await handle_run_code(runner, await json_body(request)))

    async def ping(request: web.Request) -> web.Response:
        return web.json_response("pong")

    app.router.add_post("/run_code", run_code)
    app.router.add_get("/v1/ping", ping)


def response(
    status: str,
    message: str = "",
    run_result: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": files or {},
    }


async def handle_run_code(runner: Runner, payload: Any) -> dict[str, Any]:
    body = an_object(payload, ())
    code = string(body, "code", required=True) or ""
    language = string(body, "language", required=True)
    # Absent: the server's default (--call-timeout: a SandboxPool's spec.limits), where
    # SandboxFusion's own server has 10 s.
    run_timeout = number(body, "run_timeout", 0.0)
    number(body, "compile_timeout", DEFAULT_TIMEOUT_SECONDS)  # checked; Python compiles nothing
    memory_mb = integer(body, "memory_limit_MB", -1)
    stdin = string(body, "stdin") or ""
    files = base64_files(body, "files")
    fetch_files = string_list(body, "fetch_files")
    limits = Limits(
        timeout_seconds=run_timeout,
        timeout_field="run_timeout" if "run_timeout" in body else "",
        memory_bytes=max(memory_mb, 0) * MiB,
        memory_field="memory_limit_MB",
    )
    runner.check_limits(limits)
    if language != LANGUAGE:
        return response(
            "SandboxError",
            f"language {language!r} is not supported: this sandbox (kubestar) runs Python "
            f"only (language: {LANGUAGE!r})",
        )

    marker = secrets.token_hex(8)
    opening, closing = f"<kubestar-files {marker}>", f"</kubestar-files {marker}>"
    wrapped = bool(files or fetch_files)
    if wrapped:
        code = _WRAPPER.format(
            files=sorted(files.items()),
            code=code,
            fetch=fetch_files,
            opening=opening,
            closing=closing,
        )
    try:
        execution = runner.execution(code, stdin, limits)
    except ValueError as error:
        message = str(error)
        field = message.split(" ", 1)[0]
        if wrapped and field == "code":
            field = "files"
            message = f"files: code and files together make {message.removeprefix('code ')}"
        raise FieldError((field,), message) from None
    result = await runner.run(execution)

    stderr, fetched = (
        take_files(result.stderr, opening, closing, fetch_files) if wrapped else (result.stderr, {})
    )
    if result.status == pb.EXECUTION_STATUS_INTERNAL and result.attempts > 0:
        lost = {
            "status": "Error",
            "execution_time": None,
            "return_code": None,
            "stdout": None,
            "stderr": result.message,
        }
        return response("SandboxError", result.message, lost)
    if result.status in (
        pb.EXECUTION_STATUS_QUEUE_TIMEOUT,
        pb.EXECUTION_STATUS_INTERNAL,
        pb.EXECUTION_STATUS_INVALID,
    ):
        return response("SandboxError", result.message)
    timed_out = result.status == pb.EXECUTION_STATUS_TIMEOUT
    run_result = {
        "status": "TimeLimitExceeded" if timed_out else "Finished",
        "execution_time": seconds(result),
        "return_code": None if timed_out else result.exit_code,
        "stdout": result.stdout,
        "stderr": stderr,
    }
    if result.status == pb.EXECUTION_STATUS_OK:
        return response("Success", "", run_result, fetched)
    return response("Failed", result.message, run_result, fetched)


def take_files(
    stderr: str, opening: str, closing: str, names: Sequence[str]
) -> tuple[str, dict[str, str]]:
    """The call's own stderr, and the fetched files (name -> base64) the wrapper wrote into
    it. Nothing is fetched when the markers are missing (the call never got there, or its
    stderr passed the output limit)."""
    start = stderr.rfind(opening)
    end = stderr.find(closing, start + len(opening)) if start >= 0 else -1
    if start < 0 or end < 0:
        return stderr, {}
    files: dict[str, str] = {}
    for entry in stderr[start + len(opening) : end].split(";"):
        index, _, data = entry.partition(":")
        if index.isdigit() and int(index) < len(names):
            try:
                content = bytes.fromhex(data)
            except ValueError:
                continue
            files[names[int(index)]] = base64.b64encode(content).decode("ascii")
    return stderr[:start] + stderr[end + len(closing) :], files
