"""`kubestar sandbox`: serve the code sandbox, or run code through one."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import click
from kubestar.api.errors import KubestarError
from kubestar.cli.errors import describe
from kubestar.cli.options import auth_token_file_option
from kubestar.common import logs
from kubestar.common.auth import load_token
from kubestar.sandbox.client import Call, SandboxClient, result_to_dict
from kubestar.sandbox.executor import DEFAULT_WARMUP, UID_RANGE_SIZE, ExecutorConfig, uid_base_for
from kubestar.sandbox.limits import CallLimits, LimitPolicy, MiB
from kubestar.sandbox.metrics import status_label
from kubestar.sandbox.server import ServerConfig, serve
from kubestar.v1 import sandbox_pb2 as pb


@click.group()
def sandbox() -> None:
    """The sandbox service that runs the model's Python."""


@sandbox.command("serve")
@click.option(
    "--listen", default="127.0.0.1:50051", show_default=True, help="gRPC address to bind."
)
@click.option(
    "--executors",
    default=4,
    show_default=True,
    help="Pre-warmed executor processes (a worker's capacity).",
)
@click.option(
    "--worker",
    "workers",
    multiple=True,
    metavar="HOST:PORT",
    help="Dispatch to these workers instead of running calls here (repeatable).",
)
@click.option(
    "--preload",
    default="numpy,sympy",
    show_default=True,
    help="Modules every executor imports once, comma-separated.",
)
@click.option(
    "--light/--no-light",
    default=True,
    show_default=True,
    help="Give each executor a light zygote (no preloads) for calls that name none of the "
    "preloaded modules: about twice the calls per CPU second for plain Python.",
)
@click.option(
    "--queue-timeout",
    default=30.0,
    show_default=True,
    help="Seconds a call may wait for an executor before QUEUE_TIMEOUT.",
)
@click.option("--metrics-port", default=0, help="Prometheus metrics port (0: off).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True)
@click.option(
    "--no-isolation",
    is_flag=True,
    help="Run calls without namespaces, for development only. Without it a worker that "
    "cannot isolate its calls refuses to serve.",
)
@click.option(
    "--no-syscall-filter",
    is_flag=True,
    help="Isolate calls without the syscall filter (seccomp), to measure what it costs or to "
    "debug a call with tools it refuses (ptrace); not for serving.",
)
@click.option("--hide", multiple=True, help="Extra path hidden from calls (repeatable).")
@click.option(
    "--uid-base",
    default=61000,
    show_default=True,
    help="As root, executor i of N runs calls as uid UID_BASE+i, its light zygote as UID_BASE+N+i.",
)
@click.option(
    "--uid-range-key",
    default="",
    help="As root, take the uid base from this key (the pod's UID) instead of --uid-base: "
    "pods of a node then run their calls as uids of their own, and the kernel's per-uid "
    "limits (processes, message queues, signals) count each pod's calls apart.",
)
@click.option(
    "--drain-seconds",
    default=30.0,
    show_default=True,
    help="On SIGTERM, how long running calls may finish.",
)
@click.option(
    "--termination-log",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write why the server could not start, in one line, to this file (Kubernetes "
    "shows it in the pod's status: the container's terminationMessagePath).",
)
@click.option(
    "--http-listen",
    default="",
    metavar="HOST:PORT",
    help="Also serve SandboxFusion's HTTP API (POST /run_code, GET /v1/ping) and code-judge's "
    "(POST /run/long-batch, /run/batch, /run) at HOST:PORT, on the same executors or workers, "
    "limits and token (off by default).",
)
@click.option(
    "--call-timeout",
    default=CallLimits.timeout_seconds,
    show_default=True,
    help="Seconds a call may run when it does not set its own time limit (a gRPC call's "
    "limits.timeout_seconds 0, an HTTP call without run_timeout); a SandboxPool's "
    f"spec.limits.timeoutSeconds. At most {LimitPolicy.maximum.timeout_seconds:g}.",
)
@click.option(
    "--call-memory-mib",
    default=CallLimits.memory_bytes // MiB,
    show_default=True,
    help="MiB a call may allocate when it does not set its own memory limit; a SandboxPool's "
    f"spec.limits.memoryMib. At most {LimitPolicy.maximum.memory_bytes // MiB}.",
)
@click.option(
    "--call-max-output-bytes",
    default=CallLimits.output_bytes,
    show_default=True,
    help="Bytes a call may write to stdout, and to stderr, when it does not set its own "
    "output limit; a SandboxPool's spec.limits.outputBytes. At most "
    f"{LimitPolicy.maximum.output_bytes}.",
)
@auth_token_file_option()
@click.option("--log-level", default="info", show_default=True)
def serve_command(
    listen: str,
    executors: int,
    workers: tuple[str, ...],
    preload: str,
    light: bool,
    queue_timeout: float,
    metrics_port: int,
    metrics_address: str,
    no_isolation: bool,
    no_syscall_filter: bool,
    hide: tuple[str, ...],
    uid_base: int,
    uid_range_key: str,
    drain_seconds: float,
    termination_log: str | None,
    http_listen: str,
    call_timeout: float,
    call_memory_mib: int,
    call_max_output_bytes: int,
    auth_token_file: str | None,
    log_level: str,
) -> None:
    """Serve the sandbox: a worker (default) or, with --worker, a dispatcher.

    The --call-* limits apply to every call that leaves that limit unset, on a worker and on
    a dispatcher (which sends them on to its workers), over gRPC and the HTTP dialects.
    """
    logs.configure(log_level)
    try:
        policy = call_policy(call_timeout, call_memory_mib, call_max_output_bytes)
    except CallDefaultRefused as error:
        if termination_log:
            write_termination_message(termination_log, error)
        raise
    if uid_range_key and executors * 2 > UID_RANGE_SIZE:
        raise click.UsageError(
            f"--executors {executors} with --uid-range-key: a pod's range holds "
            f"{UID_RANGE_SIZE // 2} executors' uids at most"
        )
    modules = tuple(m for m in preload.split(",") if m)
    if termination_log:
        Path(termination_log).touch()  # there to hide from calls
    executor = ExecutorConfig(
        preload=modules,
        # The default warm-up exercises numpy and sympy: only when they are preloaded.
        warmup=DEFAULT_WARMUP if {"numpy", "sympy"} <= set(modules) else "",
        light=light,
        isolation=not no_isolation,
        syscall_filter=not no_syscall_filter,
        uid_base=uid_base_for(uid_range_key) if uid_range_key else uid_base,
        # Calls must not write the message the operator shows (it would forge a refusal).
        hidden_paths=(*hide, *([termination_log] if termination_log else [])),
        policy=policy,
    )
    config = ServerConfig(
        listen=listen,
        workers=list(workers),
        executors=executors,
        executor=executor,
        queue_timeout=queue_timeout,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        drain_seconds=drain_seconds,
        http_listen=http_listen,
    )
    try:
        config.auth_token = load_token(auth_token_file)
        asyncio.run(serve(config))
    except Exception as error:
        if termination_log:
            write_termination_message(termination_log, error)
        raise


class CallDefaultRefused(KubestarError):
    """A --call-* default that is not a positive value within the sandbox's ceiling."""


def call_policy(timeout_seconds: float, memory_mib: int, output_bytes: int) -> LimitPolicy:
    """The server's limit policy with these defaults for calls that set no limit of their
    own; CallDefaultRefused (one line, naming the flag) for a value out of range."""
    ceiling = LimitPolicy().maximum
    checks = [
        ("--call-timeout", timeout_seconds, ceiling.timeout_seconds, "seconds"),
        ("--call-memory-mib", memory_mib, ceiling.memory_bytes // MiB, "MiB"),
        ("--call-max-output-bytes", output_bytes, ceiling.output_bytes, "bytes"),
    ]
    for flag, value, maximum, unit in checks:
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise CallDefaultRefused(
                f"{flag} {_number(value)} must be more than 0 and at most this sandbox's "
                f"maximum of {_number(maximum)} {unit}"
            )
    return replace(
        LimitPolicy(),
        default=CallLimits(
            timeout_seconds=float(timeout_seconds),
            memory_bytes=memory_mib * MiB,
            output_bytes=output_bytes,
        ),
    )


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def write_termination_message(path: str, error: Exception) -> None:
    """One line: `Reason: message` for errors that name a reason the operator shows as a
    condition (IsolationUnavailable), else the message the CLI prints."""
    reason = getattr(error, "reason", "")
    line = f"{reason}: {describe(error)}" if reason else describe(error)
    try:
        with open(path, "w") as handle:
            handle.write(line + "\n")
    except OSError as failure:  # the error itself is still printed
        click.echo(f"kubestar: cannot write {path}: {failure.strerror}", err=True)


@sandbox.command("exec")
@click.argument("source", type=click.File("r"), default="-")
@click.option("--endpoint", default="127.0.0.1:50051", show_default=True, help="HOST:PORT")
@click.option(
    "--timeout",
    "timeout_seconds",
    default=0.0,
    help="Wall-clock limit in seconds (0: the server's default).",
)
@click.option("--memory-mb", default=0, help="Memory limit in MiB (0: the server's default).")
@click.option("--stdin", "stdin_text", default="", help="Text given to the code on stdin.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def exec_command(
    source: TextIO,
    endpoint: str,
    timeout_seconds: float,
    memory_mb: int,
    stdin_text: str,
    as_json: bool,
) -> None:
    """Run Python from FILE (or - for stdin) in the sandbox and print the result.

    Exits 0 when the call's status is ok, 1 otherwise.
    """
    call = Call(
        code=source.read(),
        id="cli",
        stdin=stdin_text,
        timeout_seconds=timeout_seconds,
        memory_bytes=memory_mb * 1024 * 1024,
    )
    with SandboxClient(endpoint, retries=False) as client:
        result = client.execute(call)
    if as_json:
        click.echo(json.dumps(result_to_dict(result), indent=2))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.status != pb.EXECUTION_STATUS_OK:
            click.echo(f"[{status_label(result.status)}] {result.message}", err=True)
    sys.exit(0 if result.status == pb.EXECUTION_STATUS_OK else 1)
