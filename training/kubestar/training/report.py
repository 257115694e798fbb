"""The report of a run: `run_dir/report/report.md` (per-step table, SFT and evaluation
summaries) and PNG plots of reward, accuracy, tool-error rates, response length and the
update's clip fraction per step.

It reads `run_dir/metrics.jsonl` (one JSON object per line, see TrainingSession): RL steps
carry `step`, `stage` and the step's metrics; an entry with stage `sft` holds the SFT stage's
metrics and one with stage `evaluation` the held-out evaluation. Missing values are shown as
`-` and left out of plots; a run with no steps still gets a report that says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SFT = "sft"
EVALUATION = "evaluation"

# (key, column title, format) of the per-step table.
STEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "step", "d"),
    ("stage", "stage", "s"),
    ("reward", "reward", ".3f"),
    ("kept", "kept", ".0f"),
    ("kept_reward", "kept reward", ".3f"),
    ("accuracy", "accuracy", ".3f"),
    ("tool_calls_per_trajectory", "tool calls/traj", ".2f"),
    ("tool_error_rate", "tool err", ".3f"),
    ("positive_tool_error_rate", "tool err (kept +)", ".3f"),
    ("mean_response_tokens", "resp tokens", ".0f"),
    ("train_clip_fraction", "clip frac", ".3f"),
    ("answered_rate", "answered", ".2f"),
    ("tokens_per_second", "tokens/s", ".1f"),
    ("step_seconds", "step s", ".1f"),
)
EVALUATION_KEYS: tuple[tuple[str, str, str], ...] = (
    ("eval_accuracy", "accuracy", ".3f"),
    ("answered_rate", "answered rate", ".3f"),
    ("truncated_rate", "truncated rate", ".3f"),
    ("tool_calls_per_trajectory", "tool calls per trajectory", ".2f"),
    ("tool_error_rate", "tool error rate", ".3f"),
    ("mean_response_tokens", "mean response tokens", ".1f"),
    ("rollouts", "trajectories", ".0f"),
)
EVALUATION_POINTS = {"start": "initial policy", "sft": "after SFT", "end": "after RL"}
SFT_KEYS: tuple[tuple[str, str, str], ...] = (
    ("examples", "examples", ".0f"),
    ("error_fix_examples", "examples that fix an error", ".0f"),
    ("epochs", "epochs", ".0f"),
    ("steps", "optimizer steps", ".0f"),
    ("initial_loss", "loss at the first step", ".4f"),
    ("first_epoch_loss", "loss, first epoch", ".4f"),
    ("loss", "loss, last epoch", ".4f"),
    ("tokens", "trained (assistant) tokens", ".0f"),
    ("learning_rate", "learning rate", ".2e"),
    ("seconds", "seconds", ".1f"),
)
# (file, title, y label, [(key, legend)]) of the plots.
PLOTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "reward.png",
        "Reward",
        "reward",
        (("reward", "all rollouts"), ("kept_reward", "kept by RoC")),
    ),
    ("accuracy.png", "Accuracy (all rollouts)", "accuracy", (("accuracy", "accuracy"),)),
    (
        "tool_error_rate.png",
        "Tool-call error rate",
        "error rate",
        (
            ("tool_error_rate", "all rollouts"),
            ("rollout_positive_tool_error_rate", "positive rollouts"),
            ("positive_tool_error_rate", "kept positive trajectories"),
        ),
    ),
    (
        "response_tokens.png",
        "Response length",
        "tokens",
        (
            ("mean_response_tokens", "mean, all rollouts"),
            ("kept_response_tokens", "mean, kept trajectories"),
        ),
    ),
    (
        "clip_fraction.png",
        "Clipped tokens (the update's ratio outside [1 - clipLow, 1 + clipHigh])",
        "fraction of tokens",
        (("train_clip_fraction", "clip fraction"),),
    ),
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The entries of a metrics.jsonl; unreadable lines are skipped."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            entries.append(value)
    return entries


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "s":
        return str(value)
    number = _number(value)
    if number is None:
        return "-"
    if fmt == "d":
        return str(int(number))
    return format(number, fmt)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _summary(entry: dict[str, Any], keys: Sequence[tuple[str, str, str]]) -> list[str]:
    rows = [[title, _cell(entry.get(key), fmt)] for key, title, fmt in keys if key in entry]
    known = {key for key, _, _ in keys} | {"step", "stage", "time"}
    rows += [
        [key, _cell(value, ".4g")]
        for key, value in sorted(entry.items())
        if key not in known and _number(value) is not None
    ]
    return _table(["metric", "value"], rows)


def _plot(
    steps: Sequence[dict[str, Any]],
    title: str,
    ylabel: str,
    series: Sequence[tuple[str, str]],
    path: Path,
) -> bool:
    """One line plot of metrics per step; False when no series has a value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = False
    lowest = math.inf
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for key, label in series:
            points = [
                (float(entry["step"]), value)
                for entry in steps
                if (value := _number(entry.get(key))) is not None
                and _number(entry.get("step")) is not None
            ]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
            drawn = True
            lowest = min(lowest, *ys)
        if not drawn:
            return False
        if lowest >= 0:  # rates, rewards and lengths: from zero
            axes.set_ylim(bottom=0)
        xs_all = [x for e in steps if (x := _number(e.get("step"))) is not None]
        axes.set_xlim(min(xs_all) - 0.6, max(xs_all) + 0.6)
        # Stage boundaries: a dotted line where the stage changes, its name at the top.
        previous = None
        for entry in steps:
            stage = entry.get("stage")
            step = _number(entry.get("step"))
            if stage != previous and step is not None:
                if previous is not None:
                    axes.axvline(step - 0.5, color="grey", linestyle=":", linewidth=1)
                axes.annotate(
                    str(stage),
                    xy=(step - 0.5, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -12),
                    textcoords="offset points",
                    fontsize=8,
                    color="grey",
                )
                previous = stage
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        if len(series) > 1:
            axes.legend(fontsize=8)
        from matplotlib.ticker import MaxNLocator

        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        figure.tight_layout()
        figure.savefig(path)
        return True
    finally:
        plt.close(figure)


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report/` (report.md and the plots); returns the path of report.md."""
    run_dir = Path(run_dir)
    folder = run_dir / "report"
    folder.mkdir(parents=True, exist_ok=True)
    entries = read_metrics(run_dir / "metrics.jsonl")
    sft = [e for e in entries if e.get("stage") == SFT]
    evaluations = [e for e in entries if e.get("stage") == EVALUATION]
    steps = sorted(
        (e for e in entries if e.get("stage") not in (SFT, EVALUATION)),
        key=lambda e: _number(e.get("step")) or 0.0,
    )

    lines = [f"# Training report: {run_dir.name}", ""]
    status = _status(run_dir)
    if status:
        lines += [status, ""]
    if not entries:
        lines += ["No metrics yet: `metrics.jsonl` is missing or empty.", ""]

    if sft:
        lines += ["## Non-reasoning SFT", "", *_summary(sft[-1], SFT_KEYS), ""]

    if steps:
        lines += ["## RL steps", ""]
        lines += _table(
            [title for _, title, _ in STEP_COLUMNS],
            [[_cell(entry.get(key), fmt) for key, _, fmt in STEP_COLUMNS] for entry in steps],
        )
        lines.append("")
        lines += _stage_summary(steps)

    if evaluations:
        lines += ["## Evaluation", "", "Held-out problems, greedy decoding.", ""]
        lines += _table(
            ["when", "after step", *(title for _, title, _ in EVALUATION_KEYS)],
            [
                [
                    _point(entry),
                    _cell(entry.get("step"), "d"),
                    *(_cell(entry.get(key), fmt) for key, _, fmt in EVALUATION_KEYS),
                ]
                for entry in evaluations
            ],
        )
        lines.append("")
        lines += _family_table(evaluations)

    plotted: list[tuple[str, str]] = []
    if steps:
        try:
            for name, title, ylabel, series in PLOTS:
                if _plot(steps, title, ylabel, series, folder / name):
                    plotted.append((name, title))
        except ImportError:
            lines += ["Plots need matplotlib: pip install 'kubestar[training]'.", ""]
    if plotted:
        lines += ["## Plots", ""]
        lines += [f"![{title}]({name})" for name, title in plotted]
        lines.append("")

    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def _point(entry: dict[str, Any]) -> str:
    """When an evaluation ran, as the report says it."""
    point = str(entry.get("point", "end"))
    if point == "step":
        return f"after step {_cell(entry.get('step'), 'd')}"
    return EVALUATION_POINTS.get(point, "-")


def _family_table(evaluations: Sequence[dict[str, Any]]) -> list[str]:
    """Accuracy per problem family at each evaluation, when the problems came from several."""
    families = sorted({family for entry in evaluations for family in entry.get("families") or {}})
    if not families:
        return []
    points = [_point(entry) for entry in evaluations]
    rows = [
        [
            family,
            *(_cell((entry.get("families") or {}).get(family), ".3f") for entry in evaluations),
        ]
        for family in families
    ]
    return ["Accuracy per family:", "", *_table(["family", *points], rows), ""]


def _stage_summary(steps: Sequence[dict[str, Any]]) -> list[str]:
    """Per stage: steps, and the mean of the first and last few steps' accuracy and reward."""
    stages: dict[str, list[dict[str, Any]]] = {}
    for entry in steps:
        stages.setdefault(str(entry.get("stage")), []).append(entry)
    rows = []
    for name, entries in stages.items():
        window = max(1, min(3, len(entries) // 2))

        def mean(part: Sequence[dict[str, Any]], key: str) -> float | None:
            values = [v for e in part if (v := _number(e.get(key))) is not None]
            return sum(values) / len(values) if values else None

        rows.append(
            [
                name,
                str(len(entries)),
                _cell(mean(entries[:window], "accuracy"), ".3f"),
                _cell(mean(entries[-window:], "accuracy"), ".3f"),
                _cell(mean(entries[:window], "reward"), ".3f"),
                _cell(mean(entries[-window:], "reward"), ".3f"),
                _cell(sum(_number(e.get("step_seconds")) or 0.0 for e in entries), ".0f"),
            ]
        )
    return [
        "### Per stage (first vs last steps)",
        "",
        *_table(
            ["stage", "steps", "acc first", "acc last", "reward first", "reward last", "seconds"],
            rows,
        ),
        "",
    ]


def _status(run_dir: Path) -> str:
    """One line from status.json (phase, steps), when the run wrote one."""
    path = run_dir / "status.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(status, dict):
        return ""
    phase = status.get("phase", "?")
    step, total = status.get("step"), status.get("totalSteps", status.get("total_steps"))
    checkpoint = status.get("lastCheckpoint", status.get("last_checkpoint"))
    text = f"Phase **{phase}**, step {step} of {total}."
    if checkpoint:
        text += f" Last checkpoint: `{checkpoint}`."
    return text
