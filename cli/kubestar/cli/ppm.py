"""`kubestar ppm`: train the process preference model on preference pairs, and serve it to
search over gRPC.

The flags become one settings object the library runs: `ppm train` a
`kubestar.search.entrypoints.PpmTrainConfig` (`train_ppm`), `ppm serve` a
`kubestar.scoring.server.ServerConfig` (`serve`).
"""

from __future__ import annotations

import asyncio
import json

import click
from kubestar.cli.options import auth_token_file_option, library_errors
from kubestar.common import logs
from kubestar.common.auth import load_token

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
model_option = click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="A model folder or a model name kubestar resolves (the policy's model: the PPM must "
    "read token ids with the policy's tokenizer).",
)
device_option = click.option(
    "--device", default="auto", show_default=True, help="cuda, cpu, ... (auto: a GPU if any)."
)


@click.group()
def ppm() -> None:
    """The process preference model that values search steps."""


@ppm.command("train")
@click.option(
    "--pairs",
    "pairs_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="JSONL of preference pairs: prompt, chosen, rejected (text, or token ids in "
    "prompt_ids, chosen_ids, rejected_ids).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="The PPM folder to write (new, or a PPM folder to replace).",
)
@model_option
@click.option(
    "--learning-rate", type=click.FloatRange(min=0, min_open=True), default=7e-6, show_default=True
)
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="Pairs/step."
)
@click.option(
    "--micro-batch-size",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Pairs per forward pass (gradients accumulate over a batch).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Longer sequences keep their last tokens.",
)
@click.option(
    "--held-out",
    type=click.FloatRange(min=0, max=0.5),
    default=0.05,
    show_default=True,
    help="Fraction of the pairs kept out of training to measure pair accuracy on.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@device_option
@click.option("--log-level", default="warning", show_default=True)
def train_command(
    pairs_file: str,
    out: str,
    model: str,
    learning_rate: float,
    epochs: int,
    batch_size: int,
    micro_batch_size: int,
    max_tokens: int,
    held_out: float,
    seed: int,
    device: str,
    log_level: str,
) -> None:
    """Train a PPM on preference pairs with the Bradley-Terry loss and write it to --out.

    Prints the metrics (loss per epoch, pair accuracy on the training and the held-out
    pairs) as JSON; they are also kept in the folder's ppm.json.
    """
    logs.configure(log_level)
    from kubestar.search.entrypoints import PpmTrainConfig, train_ppm
    from kubestar.search.ppm import PpmTrainSettings

    config = PpmTrainConfig(
        pairs=pairs_file,
        out=out,
        model=model,
        training=PpmTrainSettings(
            learning_rate=learning_rate,
            epochs=epochs,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
            seed=seed,
        ),
        held_out=held_out,
        device=device,
    )
    with library_errors(lambda setting: f"--{setting}"):
        trained = train_ppm(config)
    click.echo(json.dumps(trained, indent=2))


@ppm.command("serve")
@model_option
@click.option(
    "--listen", default="127.0.0.1:50071", show_default=True, help="gRPC address to bind."
)
@device_option
@click.option(
    "--max-batch-sequences",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Sequences per forward pass, gathered from concurrent requests.",
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=1),
    default=65536,
    show_default=True,
    help="Padded tokens per forward pass (rows x the longest row).",
)
@click.option(
    "--max-wait-ms",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="How long a batch waits to fill.",
)
@click.option(
    "--max-sequence-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Longest sequence a request may hold.",
)
@click.option(
    "--max-request-sequences",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Most sequences one request may hold.",
)
@click.option("--metrics-port", default=0, help="Prometheus metrics port (0: off).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True)
@click.option(
    "--drain-seconds",
    default=30.0,
    show_default=True,
    help="On SIGTERM, how long requests in flight may finish.",
)
@auth_token_file_option()
@click.option("--log-level", default="info", show_default=True)
def serve_command(
    model: str,
    listen: str,
    device: str,
    max_batch_sequences: int,
    max_batch_tokens: int,
    max_wait_ms: float,
    max_sequence_tokens: int,
    max_request_sequences: int,
    metrics_port: int,
    metrics_address: str,
    drain_seconds: float,
    auth_token_file: str | None,
    log_level: str,
) -> None:
    """Serve a PPM (a `kubestar ppm train` folder) to search: ScoringService with dynamic
    batching, gRPC health and Prometheus metrics.

    A plain model folder serves with an untrained head (every score about 0): for trying
    the service out. With a token (--auth-token-file) every caller must send it.
    """
    logs.configure(log_level)
    from kubestar.scoring.batcher import BatchingConfig
    from kubestar.scoring.server import ServerConfig, serve

    if max_sequence_tokens > max_batch_tokens:
        raise click.UsageError(
            f"--max-sequence-tokens {max_sequence_tokens} is more than --max-batch-tokens "
            f"{max_batch_tokens}: the longest sequence must fit in a batch"
        )
    config = ServerConfig(
        model=model,
        listen=listen,
        device=device,
        batching=BatchingConfig(max_batch_sequences, max_batch_tokens, max_wait_ms),
        max_sequence_tokens=max_sequence_tokens,
        max_request_sequences=max_request_sequences,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        drain_seconds=drain_seconds,
        auth_token=load_token(auth_token_file),
    )
    asyncio.run(serve(config))
