"""`kubestar report`: a run's report again, or several runs side by side."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument(
    "run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path)
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where a comparison of several runs goes (default: comparison/ beside the first run).",
)
def report(run_dirs: tuple[Path, ...], out: Path | None) -> None:
    """Write RUN_DIR/report/ from RUN_DIR/metrics.jsonl; given several run folders (an
    ablation: GRPO-RoC against GRPO from one checkpoint, say), write their comparison: the
    first and last third of each run's steps and one PNG per metric, a line per run."""
    from kubestar.training.report import write_comparison, write_report

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
