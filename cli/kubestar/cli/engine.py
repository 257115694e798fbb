"""`kubestar engine` and `kubestar model`: run a vLLM rollout engine, prepare offline models."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import click
from kubestar.cli.options import auth_token_file_option
from kubestar.common.auth import ENV_TOKEN_FILE, read_token_file
from kubestar.engine.launch import EngineProcess, EngineSettings


@click.group()
def engine() -> None:
    """vLLM rollout engines (OpenAI-compatible API and Prometheus /metrics)."""


@engine.command("serve")
@click.option(
    "--model",
    default="SmolLM2-135M-Instruct",
    show_default=True,
    help="Model folder, or an embedded name (SmolLM2-135M-Instruct, tiny-random-llama).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True)
@click.option("--max-model-len", default=4096, show_default=True)
@click.option("--kv-cache-bytes", default=0, help="KV cache size (0: vLLM's default).")
@click.option("--tensor-parallel-size", default=1, show_default=True)
@click.option("--gpu-memory-utilization", default=0.9, show_default=True)
@click.option(
    "--device", type=click.Choice(["cpu", "cuda", "rocm"]), default="cpu", show_default=True
)
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help="vLLM's --dtype. auto: on CPU float32 where the CPU lacks bf16 instructions "
    "(vLLM-CPU would emulate them), else the model's own.",
)
@click.option(
    "--ready-timeout",
    default=0.0,
    help="Exit with an error when vLLM is not serving after this many seconds (0: wait; in "
    "a pod the kubelet's startup probe decides).",
)
@auth_token_file_option(
    "A file holding the installation's bearer token: every request but /health, /ping and "
    f"/metrics must then carry it [env: {ENV_TOKEN_FILE}; neither: no authentication]."
)
@click.option("--print-command", is_flag=True, help="Print the vLLM command and exit.")
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    model: str,
    host: str,
    port: int,
    max_model_len: int,
    kv_cache_bytes: int,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    device: str,
    max_num_seqs: int,
    dtype: str,
    ready_timeout: float,
    auth_token_file: str | None,
    print_command: bool,
    extra_args: tuple[str, ...],
) -> None:
    """Serve one engine until interrupted. Arguments after -- go to vLLM unchanged."""
    from kubestar.engine.models import resolve_model

    if auth_token_file:
        read_token_file(auth_token_file)  # a file vLLM cannot use fails here, in one line

    settings = EngineSettings(
        model=str(resolve_model(model)),
        host=host,
        port=port,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        device=device,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        extra_args=list(extra_args),
        auth_token_file=auth_token_file or "",
    )
    if print_command:
        click.echo(" ".join(settings.command()))
        return
    # vLLM's output is the engine's log (`kubectl logs`).
    process = EngineProcess(settings, inherit_output=True)
    process.start(wait=False)

    class Stop(Exception):
        pass

    def request_stop(*_: object) -> None:
        # Also while vLLM is still starting (a pod deleted before its engine was ready).
        raise Stop

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    code: int | None = 0
    try:
        process.wait_ready(ready_timeout or math.inf)
        click.echo(f"engine ready at {settings.url} (model {settings.model})", err=True)
        while process.process is not None and process.process.poll() is None:
            time.sleep(0.5)
        code = process.process.poll() if process.process else 0
    except Stop:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        process.stop()
    sys.exit(code or 0)


@click.group()
def model() -> None:
    """Models that work offline."""


@model.command("prepare")
@click.argument("name", default="SmolLM2-135M-Instruct")
def prepare(name: str) -> None:
    """Convert an embedded model into a Hugging Face folder in the cache; print its path."""
    from kubestar.engine.models import resolve_model

    click.echo(os.fspath(resolve_model(name)))
