"""`kubestar report`: a run's report again, several runs side by side, or a run on a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("report")
@click.argument("run_dirs", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where a comparison of several runs goes (default: comparison/ beside the first run); "
    "with --run, the folder the run's metrics and report go to (default: runs/NAME).",
)
@click.option(
    "--run",
    "run_name",
    default="",
    help="A TrainingRun on the cluster: its report from the metrics log its trainer keeps in "
    "the ConfigMap NAME-metrics, with no access to its volume.",
)
@click.option(
    "--namespace", "-n", default="", help="The run's namespace (default: the kubeconfig's)."
)
@click.option("--kubeconfig", default="", help="Default: $KUBECONFIG, else ~/.kube/config.")
def report(
    run_dirs: tuple[Path, ...], out: Path | None, run_name: str, namespace: str, kubeconfig: str
) -> None:
    """Write RUN_DIR/report/ from RUN_DIR/metrics.jsonl; given several run folders (an
    ablation: GRPO-RoC against GRPO from one checkpoint, say), write their comparison: the
    first and last third of each run's steps and one PNG per metric, a line per run. With
    --run NAME, the same report of a TrainingRun on the cluster."""
    from kubestar.training.report import write_comparison, write_report

    if run_name:
        if run_dirs:
            raise click.UsageError("give RUN_DIRS or --run, not both")
        click.echo(f"report: {write_report(_fetch(run_name, namespace, kubeconfig, out))}")
        return
    if not run_dirs:
        raise click.UsageError("give a run's folder (RUN_DIRS) or a TrainingRun (--run NAME)")
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise click.BadParameter(
                f"{run_dir} has no metrics.jsonl: give the folder a run wrote (runs/NAME)",
                param_hint="RUN_DIR",
            )
    if len(run_dirs) == 1:
        click.echo(f"report: {write_report(run_dirs[0])}")
        return
    names = [run_dir.name for run_dir in run_dirs]
    if len(set(names)) < len(names):  # runs of one name in different folders
        names = [str(run_dir) for run_dir in run_dirs]
    folder = out or run_dirs[0].parent / "comparison"
    path = write_comparison(dict(zip(names, run_dirs, strict=True)), folder)
    click.echo(f"comparison: {path}")


def _fetch(name: str, namespace: str, kubeconfig: str, out: Path | None) -> Path:
    """The run's metrics log and status from the cluster, written where a local run's go."""
    from kubestar.common import kube
    from kubestar.training.telemetry import fetch_run

    connection = kube.from_kubeconfig(kubeconfig or None)
    entries, status = fetch_run(connection, name, namespace or connection.namespace)
    folder = out or Path("runs") / name
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(entry) + "\n" for entry in entries)
    (folder / "metrics.jsonl").write_text(lines)
    (folder / "status.json").write_text(json.dumps(status, indent=2))
    return folder
