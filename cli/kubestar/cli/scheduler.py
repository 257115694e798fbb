"""`kubestar scheduler`: serve the KV-aware rollout scheduler, or talk to one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from google.protobuf.json_format import MessageToDict
from kubestar.cli.options import auth_token_file_option
from kubestar.common import logs
from kubestar.common.auth import load_token
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import POLICIES
from kubestar.scheduler.openai_front import OpenAIFrontConfig
from kubestar.scheduler.server import DiscoveryConfig, ServerConfig, serve

T = TypeVar("T")


def parse_engine(value: str) -> tuple[str, str]:
    """`NAME=URL` (or just `URL`, named after its host and port)."""
    name, sep, url = value.partition("=")
    if not sep:
        url = value
        name = url.split("://", 1)[-1].rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    if not name:
        raise click.BadParameter(f"{value!r}: expected NAME=URL")
    return name, url


@click.group()
def scheduler() -> None:
    """The KV-aware rollout scheduler in front of the vLLM engines."""


@scheduler.command("serve")
@click.option(
    "--listen", default="127.0.0.1:50061", show_default=True, help="gRPC address to bind."
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="NAME=URL",
    help="A vLLM engine's OpenAI server, e.g. e0=http://127.0.0.1:8000 (repeatable).",
)
@click.option(
    "--policy",
    type=click.Choice(list(POLICIES)),
    default="kv-aware",
    show_default=True,
    help="How turns are assigned to engines.",
)
@click.option("--poll-interval", default=0.2, show_default=True, help="Seconds between scrapes.")
@click.option(
    "--starvation-seconds",
    default=5.0,
    show_default=True,
    help="After this long in the queue, a turn that does not fit holds the engine closest to "
    "fitting it (no later turn is admitted there) while the other engines keep admitting.",
)
@click.option(
    "--segment-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="kv-aware: reserve KV room for at most this many new tokens at a time; longer turns "
    "run in segments on the same engine (0: reserve prompt + max new tokens at once).",
)
@click.option("--max-attempts", default=4, show_default=True, help="Engines a turn may fail on.")
@click.option(
    "--request-timeout", default=3600.0, show_default=True, help="Longest turn, in seconds."
)
@click.option(
    "--weights-reload-timeout",
    default=600.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds an engine may take to load new weights before it is taken out.",
)
@click.option(
    "--k8s-selector",
    default="",
    help="Also discover engines: ready pods with these labels (in a pod: its service account; "
    "else $KUBECONFIG or ~/.kube/config).",
)
@click.option("--k8s-namespace", default="default", show_default=True)
@click.option(
    "--k8s-port",
    default=8000,
    show_default=True,
    help="The engines' HTTP port, where a pod names none `http`.",
)
@click.option("--k8s-interval", default=5.0, show_default=True, help="Seconds between lists.")
@click.option("--metrics-port", default=0, help="Prometheus metrics port (0: off).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True)
@click.option(
    "--drain-seconds",
    default=30.0,
    show_default=True,
    help="On SIGTERM, how long queued and running turns may finish.",
)
@click.option(
    "--openai-listen",
    default="",
    help="Also serve the OpenAI-compatible API (/v1/models, /v1/completions, "
    "/v1/chat/completions) at HOST:PORT; needs --tokenizer.",
)
@click.option(
    "--tokenizer",
    default="",
    help="The served model (a folder or a model name kubestar resolves): its tokenizer and "
    "chat template, for the OpenAI API.",
)
@click.option(
    "--served-model-name",
    default="",
    help="The model's name in the OpenAI API (default: the --tokenizer folder's name).",
)
@auth_token_file_option()
@click.option("--log-level", default="info", show_default=True)
def serve_command(
    listen: str,
    engines: tuple[str, ...],
    policy: str,
    poll_interval: float,
    starvation_seconds: float,
    segment_tokens: int,
    max_attempts: int,
    request_timeout: float,
    weights_reload_timeout: float,
    k8s_selector: str,
    k8s_namespace: str,
    k8s_port: int,
    k8s_interval: float,
    metrics_port: int,
    metrics_address: str,
    drain_seconds: float,
    openai_listen: str,
    tokenizer: str,
    served_model_name: str,
    auth_token_file: str | None,
    log_level: str,
) -> None:
    """Serve the scheduler for a fleet of engines (static list and/or Kubernetes pods).

    With a token (--auth-token-file) its callers must send it, and it sends it to the
    engines (`kubestar engine serve --auth-token-file`): one token per installation.
    """
    logs.configure(log_level)
    token = load_token(auth_token_file)
    openai = None
    if openai_listen:
        if not tokenizer:
            raise click.UsageError("--openai-listen needs --tokenizer (the served model)")
        from kubestar.engine.models import ModelNotFound, resolve_model

        try:
            folder = str(resolve_model(tokenizer))
        except ModelNotFound:  # a hub name: transformers finds it in its cache or the hub
            folder = tokenizer
        openai = OpenAIFrontConfig(
            listen=openai_listen,
            model_name=served_model_name or Path(tokenizer).name,
            tokenizer=folder,
        )
    config = ServerConfig(
        listen=listen,
        engines=[parse_engine(e) for e in engines],
        scheduler=SchedulerConfig(
            policy=policy,
            poll_interval=poll_interval,
            starvation_seconds=starvation_seconds,
            segment_tokens=segment_tokens,
            max_attempts=max_attempts,
            request_timeout=request_timeout,
            weights_reload_timeout=weights_reload_timeout,
            engine_token=token,
        ),
        discovery=DiscoveryConfig(k8s_selector, k8s_namespace, k8s_port, k8s_interval)
        if k8s_selector
        else None,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        drain_seconds=drain_seconds,
        auth_token=token,
        openai=openai,
    )
    asyncio.run(serve(config))


endpoint_option = click.option(
    "--endpoint", default="127.0.0.1:50061", show_default=True, help="The scheduler, HOST:PORT."
)


def _call(endpoint: str, call: Callable[[SchedulerClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with SchedulerClient(endpoint, timeout=None) as client:
            return await call(client)

    return asyncio.run(run())


def _echo(message: Any) -> None:
    click.echo(json.dumps(MessageToDict(message), indent=2))


@scheduler.command("status")
@endpoint_option
def status_command(endpoint: str) -> None:
    """Print the engines, their capacity and use, and the queue (JSON)."""
    _echo(_call(endpoint, lambda c: c.status()))


@scheduler.command("add-engine")
@endpoint_option
@click.argument("engine", metavar="NAME=URL")
def add_engine_command(endpoint: str, engine: str) -> None:
    """Add an engine at run time."""
    name, url = parse_engine(engine)
    _call(endpoint, lambda c: c.add_engine(name, url))


@scheduler.command("remove-engine")
@endpoint_option
@click.argument("name")
def remove_engine_command(endpoint: str, name: str) -> None:
    """Take an engine out (its turns in flight go elsewhere)."""
    _call(endpoint, lambda c: c.remove_engine(name))


@scheduler.command("update-weights")
@endpoint_option
@click.argument("weights_path")
@click.option("--version", type=int, default=None, help="Weights version (default: the next one).")
def update_weights_command(endpoint: str, weights_path: str, version: int | None) -> None:
    """Make every engine load the weights in WEIGHTS_PATH (a Hugging Face folder)."""
    _echo(_call(endpoint, lambda c: c.update_weights(weights_path, version)))
