"""The report of a run: `run_dir/report/report.md` (per-step table, SFT and evaluation
summaries) and PNG plots of reward, accuracy, tool-error rates, response length and the
update's clip fraction per step; and the comparison of several runs (`write_comparison`).

It reads `run_dir/metrics.jsonl` (one JSON object per line, see TrainingSession): RL steps
carry `step`, `stage` and the step's metrics; an entry with stage `sft` holds the SFT stage's
metrics and one with stage `evaluation` the held-out evaluation (avg@k and pass@k over k
sampled trajectories, and the test-time search's figures under `search_*` keys when the run
asked for it). Missing values are shown as `-` and left out of plots; a run with no steps
still gets a report that says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The metrics log's stages besides the RL stages' names.
SFT = "sft"
EVALUATION = "evaluation"
FILTER = "filter"  # a stage filter's result (progress.stage_filter_entry)
FILTER_KEYS = ("k", "evaluated", "kept")

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
    ("eval_accuracy", "avg@k", ".3f"),
    ("eval_pass_at_k", "pass@k", ".3f"),
    ("eval_samples", "k", ".0f"),
    ("answered_rate", "answered rate", ".3f"),
    ("truncated_rate", "truncated rate", ".3f"),
    ("tool_calls_per_trajectory", "tool calls per trajectory", ".2f"),
    ("tool_error_rate", "tool error rate", ".3f"),
    ("mean_response_tokens", "mean response tokens", ".1f"),
    ("rollouts", "trajectories", ".0f"),
    ("generated_tokens_per_problem", "generated tokens per problem", ".1f"),
    ("seconds", "seconds", ".1f"),
)
# The test-time search's figures beside the greedy ones (spec.evaluation.search); the titles
# start with the search's mode.
SEARCH_KEYS: tuple[tuple[str, str, str], ...] = (
    ("search_accuracy", "accuracy", ".3f"),
    ("search_generated_tokens_per_problem", "generated tokens per problem", ".1f"),
    ("search_seconds", "seconds", ".1f"),
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


def _sampling_description(evaluations: Sequence[dict[str, Any]]) -> str:
    """How the evaluations sampled: greedy decoding, or k trajectories at a temperature (an
    evaluation logged before samples and temperature were recorded counts as greedy)."""
    settings = sorted(
        {
            (int(e.get("eval_samples") or 1), float(e.get("eval_temperature") or 0.0))
            for e in evaluations
        }
    )
    return "; ".join(
        "by greedy decoding"
        if temperature == 0
        else f"by {k} sampled trajectories each at temperature {temperature:g}"
        for k, temperature in settings
    )


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


# (key, title, y label, format) that a comparison of runs shows per step: the paper's
# ablation of GRPO-RoC against GRPO.
COMPARED: tuple[tuple[str, str, str, str], ...] = (
    ("accuracy", "Rollout accuracy", "accuracy", ".3f"),
    (
        "rollout_positive_tool_error_rate",
        "Tool-call error rate of positive rollouts",
        "error rate",
        ".3f",
    ),
    ("mean_response_tokens", "Response length (all rollouts)", "tokens", ".0f"),
    ("reward", "Reward (all rollouts)", "reward", ".3f"),
)


def _points(steps: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of `key` over the steps that have both."""
    return [
        (step, value)
        for entry in steps
        if (value := _number(entry.get(key))) is not None
        and (step := _number(entry.get("step"))) is not None
    ]


def _plot(
    steps: Sequence[dict[str, Any]],
    title: str,
    ylabel: str,
    series: Sequence[tuple[str, str]],
    path: Path,
) -> bool:
    """One line plot of metrics per step, stage boundaries marked; False when no series has
    a value."""
    lines = [(label, _points(steps, key)) for key, label in series]
    return _line_plot(lines, title, ylabel, path, stages=steps)


def _line_plot(
    lines: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    title: str,
    ylabel: str,
    path: Path,
    stages: Sequence[dict[str, Any]] = (),
) -> bool:
    """Labelled (step, value) lines in one PNG, with a dotted line where the stage of
    `stages` (entries with step and stage) changes; False when no line has a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drawn = [(label, points) for label, points in lines if points]
    if not drawn:
        return False
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for label, points in drawn:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
        if min(y for _, points in drawn for _, y in points) >= 0:
            axes.set_ylim(bottom=0)  # rates, rewards and lengths: from zero
        xs_all = [x for _, points in drawn for x, _ in points]
        axes.set_xlim(min(xs_all) - 0.6, max(xs_all) + 0.6)
        previous = None
        for entry in stages:
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
        if len(lines) > 1:
            axes.legend(fontsize=8)
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
    steps = _steps(entries)

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

    filters = [e for e in entries if e.get("stage") == FILTER]
    if filters:
        lines += ["## Stage filters", "", "Problems a stage kept: those not solved k of k.", ""]
        lines += _table(
            ["stage", "k", "evaluated", "kept"],
            [
                [str(e.get("filtered_stage")), *(_cell(e.get(key), "d") for key in FILTER_KEYS)]
                for e in filters
            ],
        )
        lines.append("")

    if evaluations:
        modes = sorted({str(e["search_mode"]) for e in evaluations if e.get("search_mode")})
        sampled = _sampling_description(evaluations)
        how = f"{sampled} and by test-time search ({', '.join(modes)})"
        columns = EVALUATION_KEYS
        if modes:
            prefix = modes[0] if len(modes) == 1 else "search"
            columns += tuple((key, f"{prefix} {title}", fmt) for key, title, fmt in SEARCH_KEYS)
        lines += [
            "## Evaluation",
            "",
            f"Held-out problems, {how if modes else sampled}.",
            "",
        ]
        lines += _table(
            ["when", "after step", *(title for _, title, _ in columns)],
            [
                [
                    _point(entry),
                    _cell(entry.get("step"), "d"),
                    *(_cell(entry.get(key), fmt) for key, _, fmt in columns),
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


def _steps(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RL steps among a run's metrics, in step order."""
    return sorted(
        (e for e in entries if e.get("stage") not in (SFT, EVALUATION, FILTER)),
        key=lambda e: _number(e.get("step")) or 0.0,
    )


def trend(steps: Sequence[dict[str, Any]], key: str) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and over the last third of the steps that have it."""
    values = [v for e in steps if (v := _number(e.get(key))) is not None]
    if not values:
        return None, None
    third = max(1, len(values) // 3)
    return sum(values[:third]) / third, sum(values[-third:]) / third


def write_comparison(runs: Mapping[str, Path], folder: Path) -> Path:
    """Runs side by side (an ablation: the same start, steps and problems): `folder/
    comparison.md` with each metric's first- and last-third mean per run and every run's
    held-out evaluations, and one PNG per metric with a line per run. Returns the .md path."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {
        name: read_metrics(Path(run_dir) / "metrics.jsonl") for name, run_dir in runs.items()
    }
    steps = {name: _steps(entries) for name, entries in metrics.items()}
    lines = [f"# Comparison: {', '.join(runs)}", ""]
    lines += ["Per run, the mean over the first third of its RL steps -> the last third.", ""]
    rows = []
    for name, run_steps in steps.items():
        cells = []
        for key, _, _, fmt in COMPARED:
            first, last = trend(run_steps, key)
            cells.append(f"{_cell(first, fmt)} -> {_cell(last, fmt)}")
        rows.append([name, str(len(run_steps)), *cells])
    lines += _table(["run", "steps", *(title for _, title, _, _ in COMPARED)], rows)
    lines.append("")
    held_out = [
        (name, entry)
        for name, entries in metrics.items()
        for entry in entries
        if entry.get("stage") == EVALUATION
    ]
    searched = any(entry.get("search_mode") for _, entry in held_out)
    evaluations = [
        [
            name,
            _point(entry),
            _cell(entry.get("step"), "d"),
            _cell(entry.get("eval_accuracy"), ".3f"),
            *(
                [str(entry.get("search_mode") or "-"), _cell(entry.get("search_accuracy"), ".3f")]
                if searched
                else []
            ),
        ]
        for name, entry in held_out
    ]
    if evaluations:
        search_columns = ["search", "search accuracy"] if searched else []
        how = "Greedy decoding, and test-time search (evaluation.search)" if searched else ""
        lines += ["## Held-out evaluation", "", f"{how or 'Greedy decoding'}.", ""]
        lines += _table(["run", "when", "after step", "accuracy", *search_columns], evaluations)
        lines.append("")
    plots = [
        (
            f"compare_{key}.png",
            title,
            ylabel,
            [(name, _points(s, key)) for name, s in steps.items()],
        )
        for key, title, ylabel, _ in COMPARED
    ]
    plots.append(
        (
            "compare_eval_accuracy.png",
            "Held-out accuracy (avg@k)",
            "accuracy",
            [
                (
                    name,
                    _points([e for e in entries if e.get("stage") == EVALUATION], "eval_accuracy"),
                )
                for name, entries in metrics.items()
            ],
        )
    )
    try:
        drawn = [
            (file, title)
            for file, title, ylabel, run_lines in plots
            if _line_plot(run_lines, title, ylabel, folder / file)
        ]
    except ImportError:
        drawn = []
        lines += ["Plots need matplotlib: pip install 'kubestar[training]'.", ""]
    if drawn:
        lines += ["## Plots", "", *(f"![{title}]({file})" for file, title in drawn), ""]
    path = folder / "comparison.md"
    path.write_text("\n".join(lines))
    return path
