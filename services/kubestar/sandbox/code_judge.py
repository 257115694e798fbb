"""code-judge's dialect (the judge service rStar2-Agent's recipe runs its tool calls on):
`POST /run/long-batch` (and `/run/batch`, the same here), `POST /run` for one submission, and
`GET /ping`.

A batch: `{"sub_id"?, "type": "batch", "submissions": [...]}`, each submission `{"sub_id"?,
"type": "python", "solution", "input"?, "expected_output"?, "options"?}`. The answer:
`{"sub_id", "results": [...]}`, one result per submission in the order sent, each `sub_id`,
`success` (ran and exited 0 and, when `expected_output` is given, printed it: compared with
surrounding whitespace stripped), `run_success` (ran and exited 0), `cost` (seconds), `stdout`,
`stderr` and `reason`: "" (a plain success or failure), `worker_timeout` (the time limit
passed), `queue_timeout` (no executor free in time: ask again, as the recipe does),
`internal_error` (the service failed: no worker reachable, or the code's executor died on
every attempt) or `invalid_input` (not run: a type other than python, a solution or input over
the sandbox's limits). For these last three `stderr` says why (code-judge leaves it null
and logs the reason).

Every submission runs with the sandbox server's default limits (`--call-timeout`,
`--call-memory-mib`, `--call-max-output-bytes`: in a cluster, the SandboxPool's spec.limits),
as code-judge runs each with its own server's (MAX_EXECUTION_TIME, MAX_MEMORY). code-judge
declares `options` (an object of strings) but reads none of it, so nothing in it can change a
limit: an empty or absent `options` is accepted, and a submission that sets any option is
refused (422, naming it) rather than run as if it had not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web
from kubestar.sandbox.http_dialect import (
    FieldError,
    Limits,
    Loc,
    Runner,
    an_object,
    field_name,
    json_body,
    seconds,
    string,
)
from kubestar.sandbox.service import MAX_BATCH
from kubestar.v1 import sandbox_pb2 as pb

TYPE = "python"
REASONS = {
    pb.EXECUTION_STATUS_TIMEOUT: "worker_timeout",
    pb.EXECUTION_STATUS_QUEUE_TIMEOUT: "queue_timeout",
    pb.EXECUTION_STATUS_INTERNAL: "internal_error",
    pb.EXECUTION_STATUS_INVALID: "invalid_input",
}
# Statuses of calls that never ran: their stderr is the reason, in words.
NOT_RUN = (
    pb.EXECUTION_STATUS_QUEUE_TIMEOUT,
    pb.EXECUTION_STATUS_INTERNAL,
    pb.EXECUTION_STATUS_INVALID,
)
# The code-judge fields the backend's messages name by kubestar's names.
RENAMED = {"code": "solution", "stdin": "input"}


def add_routes(app: web.Application, runner: Runner) -> None:
    async def run(request: web.Request) -> web.Response:
        submission = parse_submission(await json_body(request), ())
        return web.json_response(await judge(runner, submission))

    async def run_batch(request: web.Request) -> web.Response:
        return web.json_response(await handle_batch(runner, await json_body(request)))

    async def ping(request: web.Request) -> web.Response:
        return web.json_response("pong")

    app.router.add_post("/run", run)
    app.router.add_post("/run/batch", run_batch)
    app.router.add_post("/run/long-batch", run_batch)
    app.router.add_get("/ping", ping)


def new_id() -> str:
    return str(uuid.uuid4())


def parse_submission(value: Any, loc: Loc) -> dict[str, Any]:
    body = an_object(value, loc)
    check_options(body.get("options"), (*loc, "options"))
    return {
        "sub_id": string(body, "sub_id", loc) or new_id(),
        "type": string(body, "type", loc, required=True),
        "solution": string(body, "solution", loc, required=True),
        "input": string(body, "input", loc),
        "expected_output": string(body, "expected_output", loc),
    }


def check_options(options: Any, where: Loc) -> None:
    """`options`: absent, null or empty (see the module docstring)."""
    if options is None:
        return
    if not (isinstance(options, dict) and all(isinstance(v, str) for v in options.values())):
        raise FieldError(where, f"{field_name(where)} must be an object of strings", "dict_type")
    if options:
        name = next(iter(options))
        raise FieldError(
            (*where, name),
            f"{field_name((*where, name))} is not supported: code-judge reads no options and "
            "runs every submission with its server's limits, as this sandbox does (leave "
            "options empty)",
            "extra_forbidden",
        )


async def handle_batch(runner: Runner, payload: Any) -> dict[str, Any]:
    body = an_object(payload, ())
    batch_id = string(body, "sub_id") or new_id()
    kind = string(body, "type")
    if kind not in (None, "batch"):
        raise FieldError(("type",), f"type must be 'batch', not {kind!r}", "literal_error")
    submissions = body.get("submissions")
    if not isinstance(submissions, list) or not submissions:
        raise FieldError(
            ("submissions",), "submissions must be a non-empty list of submissions", "list_type"
        )
    if len(submissions) > MAX_BATCH:
        raise FieldError(
            ("submissions",),
            f"submissions has {len(submissions)} submissions; the maximum is {MAX_BATCH}: "
            "split the batch",
            "too_long",
        )
    parsed = [parse_submission(s, ("submissions", i)) for i, s in enumerate(submissions)]
    results = await asyncio.gather(*(judge(runner, s) for s in parsed))
    return {"sub_id": batch_id, "results": list(results)}


async def judge(runner: Runner, submission: dict[str, Any]) -> dict[str, Any]:
    sub_id = submission["sub_id"]
    if submission["type"] != TYPE:
        return not_run(
            sub_id,
            "invalid_input",
            f"type {submission['type']!r} is not supported: this sandbox (kubestar) runs "
            f"Python only (type: {TYPE!r})",
        )
    try:
        execution = runner.execution(submission["solution"], submission["input"] or "", Limits())
    except ValueError as error:
        field, _, rest = str(error).partition(" ")
        return not_run(sub_id, "invalid_input", f"{RENAMED.get(field, field)} {rest}")
    started = time.monotonic()
    result = await runner.run(execution)
    if result.status in NOT_RUN:  # the time it waited, as code-judge counts a queue timeout
        return not_run(sub_id, REASONS[result.status], result.message, time.monotonic() - started)
    run_success = result.status == pb.EXECUTION_STATUS_OK
    expected = submission["expected_output"]
    success = run_success and (expected is None or result.stdout.strip() == expected.strip())
    return {
        "sub_id": sub_id,
        "success": success,
        "run_success": run_success,
        "cost": seconds(result),
        "stdout": result.stdout,
        "stderr": result.stderr,
        "reason": REASONS.get(result.status, ""),
    }


def not_run(sub_id: str, reason: str, message: str, cost: float = 0.0) -> dict[str, Any]:
    return {
        "sub_id": sub_id,
        "success": False,
        "run_success": False,
        "cost": cost,
        "stdout": "",
        "stderr": message,
        "reason": reason,
    }
