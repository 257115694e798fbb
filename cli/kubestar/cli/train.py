"""`kubestar train`: run a TrainingRun on this machine (or, with --in-cluster, in its Job).

The flags become one `kubestar.training.entrypoints.TrainConfig`, which
`kubestar.training.entrypoints.train` runs, with the test-time search of
spec.evaluation.search (`kubestar.search.evaluation.SearchEvaluation`) that the trainer's
layer cannot import.
"""

from __future__ import annotations

import click


@click.command("train")
@click.option(
    "-f",
    "--file",
    "manifest",
    required=True,
    type=click.Path(exists=True),
    help="YAML with a TrainingRun (and, for local runs, its SandboxPool and "
    "RolloutFleet): the same file `kubectl apply -f` takes.",
)
@click.option(
    "--run-dir",
    type=click.Path(),
    default="",
    help="Where metrics, checkpoints, logs and the report go (default runs/NAME).",
)
@click.option("--fresh", is_flag=True, help="Ignore existing checkpoints in the run directory.")
@click.option(
    "--engine-python", default="", help="Python with vLLM for the engines (default: this one)."
)
@click.option(
    "--in-cluster",
    is_flag=True,
    help="Run as the trainer Job of a TrainingRun: services come from the "
    "KUBESTAR_* environment the operator sets, progress goes to the "
    "TrainingRun's status (see kubestar.api.trainer_contract).",
)
@click.option("--log-level", default="warning", show_default=True)
def train(
    manifest: str, run_dir: str, fresh: bool, engine_python: str, in_cluster: bool, log_level: str
) -> None:
    """Train: SFT, then the RL stages, then evaluation and a report.

    Locally this starts the sandbox, the vLLM engines and the rollout scheduler as processes
    on 127.0.0.1, resumes from the run directory's newest checkpoint unless --fresh, and
    writes metrics.jsonl, status.json, evaluation-*.json and report/ (table and plots).
    With trainer.workers x trainer.processesPerWorker N > 1 it trains in N processes (this one
    is rank 0).
    """
    from kubestar.api.v1alpha1 import ManifestError
    from kubestar.search.evaluation import SearchEvaluation
    from kubestar.training.entrypoints import RunRefused, TrainConfig
    from kubestar.training.entrypoints import train as run
    from kubestar.training.local import ServiceFailed

    config = TrainConfig(manifest, run_dir, fresh, engine_python, in_cluster, log_level)
    try:
        run(config, search=SearchEvaluation())
    except (ManifestError, RunRefused, ServiceFailed) as error:
        raise click.ClickException(str(error)) from None
