"""`kubestar rollout` options and the rollout report (no engine needed)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from kubestar.cli.main import cli
from kubestar.training.evaluation import format_stats
from kubestar.training.rollout import summarize
from kubestar.training.trajectory import (
    ANSWERED,
    MAX_LENGTH,
    NO_ANSWER,
    Segment,
    ToolCallRecord,
    Trajectory,
)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["rollout", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sandbox", "127.0.0.1:1"], "exactly one of --engine"),
        (["--sandbox", "127.0.0.1:1", "--engine", "http://x", "--scheduler", "y:1"], "exactly one"),
        (
            ["--sandbox", "127.0.0.1:1", "--engine", "http://x", "--dataset", "nope"],
            "neither a file",
        ),
        (["--engine", "http://x"], "--sandbox"),
    ],
)
def test_usage_errors(args: list[str], says: str) -> None:
    code, output = run(*args)
    assert code == 2
    assert says in output


def test_help_lists_the_options() -> None:
    code, output = run("--help")
    assert code == 0
    options = "--engine --scheduler --sandbox --dataset --problems -n -g --max-turns"
    options += " --max-response-tokens --request-timeout --output --json"
    for option in options.split():
        assert option in output


def trajectory(
    problem: str, reward: float, finish: str, length: int, calls: list[str]
) -> Trajectory:
    model = length // 2
    return Trajectory(
        id=f"{problem}-{reward}-{length}",
        problem_id=problem,
        sample_index=0,
        question="q",
        reference="1",
        response_ids=[5] * length,
        response_mask=[1] * model + [0] * (length - model),
        response_logprobs=[0.0] * length,
        segments=[Segment("model", 0, 0, model, "x"), Segment("tool", 0, model, length, "y")],
        tool_calls=[ToolCallRecord(turn=0, index=i, status=s) for i, s in enumerate(calls)],
        num_turns=len(calls) + 1,
        finish_reason=finish,
        reward=reward,
    )


def test_summary_numbers_and_report() -> None:
    trajectories = [
        trajectory("a", 1.0, ANSWERED, 10, ["ok", "error"]),
        trajectory("a", 0.0, NO_ANSWER, 20, ["malformed"]),
        trajectory("b", 0.0, MAX_LENGTH, 30, ["ok", "truncated"]),
        trajectory("b", 0.0, ANSWERED, 40, []),
    ]
    stats = summarize(trajectories, wall_s=2.0)
    assert stats.trajectories == 4 and stats.problems == 2 and stats.samples == 2
    assert stats.accuracy == 0.25 and stats.pass_at_samples == 0.5
    assert stats.tool_calls == 4 and stats.tool_errors == 2  # the truncated call had no reply
    assert stats.tool_error_rate == 0.5 and stats.tool_calls_per_trajectory == 1.0
    assert stats.tool_statuses == {"ok": 2, "error": 1, "malformed": 1, "truncated": 1}
    assert stats.response_tokens_mean == 25 and stats.response_tokens_p50 == 25
    assert stats.response_tokens_max == 40
    assert stats.model_tokens == 50 and stats.tool_tokens == 50
    assert stats.trajectories_per_s == 2.0 and stats.tokens_per_s == 50.0
    assert stats.finish_reasons == {ANSWERED: 2, NO_ANSWER: 1, MAX_LENGTH: 1}
    report = format_stats(stats.to_dict())
    assert "accuracy              0.250 (pass@2 0.500)" in report
    assert "tool error rate       0.500" in report
    assert "mean 25.0, p50 25, max 40" in report
    assert "2.000 trajectories/s, 50.0 tokens/s" in report


def test_summary_of_nothing() -> None:
    stats = summarize([], wall_s=0.0)
    assert stats.trajectories == 0 and stats.accuracy == 0.0 and stats.response_tokens_max == 0
