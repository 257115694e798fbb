"""The run report: report.md and PNG plots from a metrics.jsonl like TrainingSession's."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from kubestar.training.report import PLOTS, write_report

from tests.real_parts import require_modules

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def metrics_file(run_dir: Path, entries: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def session_like_entries() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = [
        {
            "step": 0,
            "stage": "sft",
            "loss": 0.4321,
            "initial_loss": 2.5,
            "first_epoch_loss": 1.25,
            "examples": 64.0,
            "error_fix_examples": 9.0,
            "tokens": 12345.0,
            "seconds": 321.0,
            "epochs": 2.0,
            "steps": 16.0,
            "learning_rate": 5e-5,
        }
    ]
    for step in range(1, 9):
        stage = "warmup" if step <= 5 else "harder"
        entries.append(
            {
                "step": step,
                "stage": stage,
                "stage_step": step if step <= 5 else step - 5,
                "reward": 0.1 * step,
                "kept": 8.0,
                "kept_reward": 0.5,
                "accuracy": 0.05 * step,
                "tool_error_rate": 0.5 - 0.05 * step,
                "positive_tool_error_rate": 0.3 - 0.03 * step,
                "mean_response_tokens": 300.0 - 10 * step,
                "kept_response_tokens": 250.0 - 8 * step,
                "train_clip_fraction": 0.01 * step,  # as GrpoTrainer.update logs it
                "tokens_per_second": 150.0 + step,
                "step_seconds": 60.0 + step,
                "tool_calls_per_trajectory": 1.25,
                "answered_rate": 0.75,
            }
        )
    entries.insert(
        0,
        {"step": 0, "stage": "evaluation", "point": "start", "eval_accuracy": 0.0},
    )
    # The second stage's filter, logged before its first step.
    filtered = {
        "step": 5,
        "stage": "filter",
        "filtered_stage": "harder",
        "k": 4,
        "evaluated": 16,
        "kept": 9,
    }
    entries.insert(next(i for i, e in enumerate(entries) if e["stage"] == "harder"), filtered)
    entries.insert(
        2,
        {"step": 0, "stage": "evaluation", "point": "sft", "eval_accuracy": 0.5, "rollouts": 30.0},
    )
    entries.append(
        {
            "step": 8,
            "stage": "evaluation",
            "point": "end",
            "eval_accuracy": 0.5667,
            "eval_pass_at_k": 0.8,
            "eval_samples": 4,
            "eval_temperature": 1.0,
            "answered_rate": 0.9,
            "tool_calls_per_trajectory": 1.1,
            "tool_error_rate": 0.125,
            "mean_response_tokens": 180.5,
            "truncated_rate": 0.1,
            "rollouts": 30.0,
        }
    )
    return entries


def test_report_has_the_table_summaries_and_plots(tmp_path: Path) -> None:
    require_modules("matplotlib")
    run_dir = tmp_path / "tiny-run"
    metrics_file(run_dir, session_like_entries())
    (run_dir / "status.json").write_text(
        json.dumps({"phase": "Succeeded", "step": 8, "totalSteps": 8})
    )
    path = write_report(run_dir)
    assert path == run_dir / "report" / "report.md"
    text = path.read_text()
    assert text.startswith("# Training report: tiny-run")
    assert "Phase **Succeeded**, step 8 of 8." in text

    # SFT summary
    assert "## Non-reasoning SFT" in text
    assert "| loss, last epoch | 0.4321 |" in text
    assert "| examples that fix an error | 9 |" in text

    # One table row per RL step, in order, with the step's numbers.
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 8 |"))]
    assert rows[0].startswith(
        "| 1 | warmup | 0.100 | 8 | 0.500 | 0.050 | 1.25 | 0.450 | 0.270 | 290 | 0.010 |"
    )
    assert rows[-1].startswith("| 8 | harder | 0.800 | 8 | 0.500 | 0.400 |")
    body = text.split("## RL steps")[1].split("###")[0]
    assert sum(1 for line in body.splitlines() if line.startswith("| ") and "warmup" in line) == 5
    assert "| harder | 3 |" in text  # per-stage summary

    # Evaluations: one row per point, in the order they ran.
    evaluation = text.split("## Evaluation")[1].split("##")[0]
    rows = [line for line in evaluation.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| initial policy",
        "| after SFT",
        "| after RL",
    ]
    assert rows[1].startswith("| initial policy | 0 | 0.000 | - | - | - |")
    assert rows[3].startswith(
        "| after RL | 8 | 0.567 | 0.800 | 4 | 0.900 | 0.100 | 1.10 | 0.125 | 180.5 |"
    )
    # Entries logged without samples or temperature were greedy.
    assert "by greedy decoding; by 4 sampled trajectories each at temperature 1." in evaluation

    # The stage filter is a table of its own, not a step.
    assert "| harder | 4 | 16 | 9 |" in text.split("## Stage filters")[1]

    # Plots: every one written, linked from the report, a real PNG of a sensible size.
    for name, title, _, _ in PLOTS:
        image = run_dir / "report" / name
        width, height = png_size(image)
        assert (width, height) == (700, 400)
        assert image.stat().st_size > 5_000
        assert f"![{title}]({name})" in text


def test_plot_of_the_tool_error_rates_draws_both_series(tmp_path: Path) -> None:
    require_modules("matplotlib")
    from matplotlib.image import imread

    run_dir = tmp_path / "run"
    metrics_file(run_dir, session_like_entries())
    write_report(run_dir)
    pixels = imread(run_dir / "report" / "tool_error_rate.png")
    # Matplotlib's default first two colours (blue, orange) are both on the canvas.
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    assert ((blue > 0.6) & (red < 0.25)).sum() > 200
    assert ((red > 0.9) & (green > 0.4) & (green < 0.6) & (blue < 0.2)).sum() > 200


def test_missing_values_and_an_empty_run(tmp_path: Path) -> None:
    require_modules("matplotlib")
    empty = tmp_path / "empty"
    empty.mkdir()
    text = write_report(empty).read_text()
    assert "No metrics yet" in text
    assert not list((empty / "report").glob("*.png"))

    sparse = tmp_path / "sparse"
    metrics_file(
        sparse,
        [
            {"step": 1, "stage": "s", "reward": 0.5, "accuracy": math.nan},
            {"step": 2, "stage": "s", "reward": None},
        ],
    )
    with (sparse / "metrics.jsonl").open("a") as handle:
        handle.write("not json\n")
    text = write_report(sparse).read_text()
    assert "| 1 | s | 0.500 | - |" in text and "| 2 | s | - | - |" in text
    written = {p.name for p in (sparse / "report").glob("*.png")}
    assert written == {"reward.png"}  # the only metric with a value
    assert "## Evaluation" not in text and "## Non-reasoning SFT" not in text


def test_accuracy_per_family_when_the_problems_came_from_several(tmp_path: Path) -> None:
    run_dir = tmp_path / "mixed"
    metrics_file(
        run_dir,
        [
            {
                "step": 0,
                "stage": "evaluation",
                "point": "sft",
                "eval_accuracy": 0.25,
                "families": {"gcd": 0.5, "leg_counting:max_animals=4": 0.0},
            },
            {
                "step": 2,
                "stage": "evaluation",
                "point": "step",
                "eval_accuracy": 0.5,
                "families": {"gcd": 0.5, "leg_counting:max_animals=4": 0.5},
            },
            {
                "step": 4,
                "stage": "evaluation",
                "point": "end",
                "eval_accuracy": 0.5,
                "families": {"gcd": 0.75, "leg_counting:max_animals=4": 0.25},
            },
        ],
    )
    text = write_report(run_dir).read_text()
    assert "| family | after SFT | after step 2 | after RL |" in text
    assert "| gcd | 0.500 | 0.500 | 0.750 |" in text
    assert "| leg_counting:max_animals=4 | 0.000 | 0.500 | 0.250 |" in text
    assert "| after step 2 | 2 | 0.500 |" in text
    # One family: no per-family table.
    metrics_file(run_dir, [{"step": 0, "stage": "evaluation", "point": "end", "eval_accuracy": 1}])
    assert "Accuracy per family" not in write_report(run_dir).read_text()


def ablation_arm(positive_errors: list[float], tokens: list[float]) -> list[dict[str, Any]]:
    """An arm's metrics: RL steps with the given positive-rollout tool-error rates and
    response lengths, and a held-out evaluation at the end."""
    entries: list[dict[str, Any]] = [
        {
            "step": step,
            "stage": "rl",
            "accuracy": 0.5,
            "reward": 0.5,
            "rollout_positive_tool_error_rate": error,
            "mean_response_tokens": length,
        }
        for step, (error, length) in enumerate(zip(positive_errors, tokens, strict=True), 1)
    ]
    entries.append(
        {"step": len(entries), "stage": "evaluation", "point": "end", "eval_accuracy": 0.4}
    )
    return entries


def test_comparison_of_two_arms_tabulates_thirds_and_plots_a_line_per_run(tmp_path: Path) -> None:
    require_modules("matplotlib")
    from kubestar.training.report import COMPARED, write_comparison
    from matplotlib.image import imread

    metrics_file(tmp_path / "grpo-roc", ablation_arm([0.3, 0.3, 0.2, 0.2, 0.1, 0.1], [300] * 6))
    metrics_file(tmp_path / "grpo", ablation_arm([0.3] * 6, [300, 300, 320, 320, 400, 400]))
    path = write_comparison(
        {"grpo-roc": tmp_path / "grpo-roc", "grpo": tmp_path / "grpo"}, tmp_path / "ablation"
    )
    text = path.read_text()
    # First third (steps 1-2) -> last third (steps 5-6), per run.
    assert "| grpo-roc | 6 | 0.500 -> 0.500 | 0.300 -> 0.100 | 300 -> 300 |" in text
    assert "| grpo | 6 | 0.500 -> 0.500 | 0.300 -> 0.300 | 300 -> 400 |" in text
    assert "| grpo-roc | after RL | 6 | 0.400 |" in text
    for key, *_ in COMPARED:
        assert f"(compare_{key}.png)" in text
    pixels = imread(tmp_path / "ablation" / "compare_rollout_positive_tool_error_rate.png")
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    assert ((blue > 0.6) & (red < 0.25)).sum() > 200  # the first run's line
    assert ((red > 0.9) & (green > 0.4) & (green < 0.6) & (blue < 0.2)).sum() > 200  # the second's


def test_report_command_compares_runs_and_names_a_folder_without_metrics(tmp_path: Path) -> None:
    require_modules("matplotlib")
    from click.testing import CliRunner
    from kubestar.cli.main import cli

    metrics_file(tmp_path / "a", ablation_arm([0.2] * 3, [100] * 3))
    metrics_file(tmp_path / "b", ablation_arm([0.1] * 3, [90] * 3))
    result = CliRunner().invoke(
        cli, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")]
    )
    assert result.exit_code == 0, result.output
    assert "| a | 3 |" in (tmp_path / "c" / "comparison.md").read_text()

    result = CliRunner().invoke(cli, ["report", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "report" / "report.md").is_file()

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "empty")])
    assert result.exit_code == 2
    assert "empty has no metrics.jsonl" in result.output
