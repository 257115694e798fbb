"""The search evaluation of a run (spec.evaluation.search), piece by piece: the Solver's
settings from the spec, a search on a real scheduler before fake engines and a fake sandbox
(its figures, and paths kept to the greedy evaluation's budget), the PPM checked before
training, and the figures in status.evaluations (also after a resume) and in the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubestar.api.v1alpha1 import (
    MAX_STATUS_EVALUATIONS,
    CallLimitsSpec,
    SearchEvaluationSpec,
    TrainingRunStatus,
)
from kubestar.search.evaluation import (
    PpmUnusable,
    check_ppm,
    search_problems,
    solve_settings,
)
from kubestar.search.steps import RStarFormat
from kubestar.training.datasets import Problem
from kubestar.training.progress import (
    evaluation_result,
    evaluations_from_log,
    record_evaluation,
)
from kubestar.training.report import write_report

from tests.search.service_fakes import FakeSandbox, encode, scheduler
from tests.training.test_report import metrics_file

QUESTION = "What is 6 * 7?"


def entry(point: str, step: int, search: bool = True) -> dict[str, Any]:
    """An evaluation's metrics entry as TrainingSession writes it."""
    figures: dict[str, Any] = {
        "step": step,
        "stage": "evaluation",
        "point": point,
        "eval_accuracy": 0.25,
        "problems": 4,
        "generated_tokens_per_problem": 30.0,
        "seconds": 1.5,
    }
    if search:
        figures.update(
            search_mode="majority",
            search_accuracy=0.75,
            search_answered=1.0,
            search_generated_tokens_per_problem=240.0,
            search_seconds=12.5,
        )
    return figures


def test_the_solver_runs_the_modes_budget_within_the_greedy_budget() -> None:
    spec = SearchEvaluationSpec.model_validate({"mode": "mcts", "ppm": "/p", "rollouts": 3})
    settings = solve_settings(spec, max_response_tokens=300, max_context=350)
    assert (settings.mode, settings.search.rollouts, settings.search.children) == ("mcts", 3, 16)
    assert settings.max_context == 350
    assert settings.sampling.max_step_tokens == 300  # a step no longer than the whole budget
    assert (settings.sampling.temperature, settings.sampling.seed) == (0.7, 1)
    beam = solve_settings(
        SearchEvaluationSpec.model_validate({"mode": "beam", "ppm": "/p", "beams": 2}), 4096, 0
    )
    assert (beam.search.beam_width, beam.search.beam_samples) == (2, 8)
    assert beam.sampling.max_step_tokens == 512
    assert solve_settings(SearchEvaluationSpec(mode="majority", samples=5), 64, 0).samples == 5
    vote = solve_settings(SearchEvaluationSpec(mode="ppm-vote", ppm="/p", samples=3), 64, 0)
    assert (vote.mode, vote.samples) == ("ppm-vote", 3)


async def judge(answer: str | None, reference: str) -> float:
    return 1.0 if answer == reference else 0.0


async def test_a_majority_search_on_the_services() -> None:
    problems = [Problem("p1", QUESTION, "42"), Problem("p2", QUESTION, "41")]
    spec = SearchEvaluationSpec(mode="majority", samples=3, format="rstar")
    sandbox = FakeSandbox()
    budget = 200
    async with scheduler() as (client, fakes):
        figures, trees = await search_problems(
            scheduler=client,
            sandbox=sandbox,
            model_dir=Path("/nonexistent"),  # no tokenizer.json: no PPM to compare with
            encode=encode,
            problems=problems,
            spec=spec,
            max_response_tokens=budget,
            judge=judge,
            call_limits=CallLimitsSpec(timeout_seconds=5),
        )
    assert figures["search_mode"] == "majority"
    assert (figures["search_problems"], figures["search_accuracy"]) == (2, 0.5)  # p2 is 41
    assert figures["search_generated_tokens_per_problem"] > 0
    assert figures["search_seconds"] > 0
    assert [tree["problem"] for tree in trees] == ["p1", "p2"]
    assert all(tree["answer"] == "42" and tree["mode"] == "majority" for tree in trees)
    assert sandbox.batches  # the steps' code ran in the sandbox
    # Every request left room for no more than the greedy evaluation's response budget.
    prompt = len(encode(RStarFormat().prompt(QUESTION)))
    requests = [request for fake in fakes for request in fake.requests]
    assert requests and all(length + new <= prompt + budget for length, new in requests)
    assert any(body.get("n") == 3 for fake in fakes for body in fake.bodies)


def test_a_ppm_the_evaluation_could_not_use_is_refused_before_training(tmp_path: Path) -> None:
    policy, ppm = tmp_path / "policy", tmp_path / "ppm"
    policy.mkdir()
    (policy / "tokenizer.json").write_text('{"policy": 1}')
    spec = SearchEvaluationSpec(mode="best-of-n", ppm=str(ppm))
    with pytest.raises(PpmUnusable, match=r"spec\.evaluation\.search\.ppm: .* not a folder"):
        check_ppm(spec, policy)
    ppm.mkdir()
    (ppm / "tokenizer.json").write_text('{"other": 1}')
    with pytest.raises(PpmUnusable, match=r"spec\.evaluation\.search\.ppm: .*another tokenizer"):
        check_ppm(spec, policy)
    (ppm / "tokenizer.json").write_text('{"policy": 1}')
    check_ppm(spec, policy)
    check_ppm(SearchEvaluationSpec(mode="majority"), policy)  # no PPM, nothing to check


def test_status_entries_from_the_metrics_log() -> None:
    result = evaluation_result(entry("end", 4))
    assert (result.point, result.step, result.problems, result.accuracy) == ("end", 4, 4, 0.25)
    assert (result.generated_tokens_per_problem, result.seconds) == (30.0, 1.5)
    assert result.search is not None
    assert (result.search.mode, result.search.accuracy) == ("majority", 0.75)
    assert result.search.generated_tokens_per_problem == 240.0
    assert result.search.seconds == 12.5
    assert evaluation_result(entry("start", 0, search=False)).search is None
    # A resumed trainer's status gets back the evaluations its log kept, in order.
    log = [entry("start", 0), {"step": 1, "stage": "only", "reward": 0.5}, entry("step", 1)]
    assert [(e.point, e.step) for e in evaluations_from_log(log)] == [("start", 0), ("step", 1)]


def test_status_keeps_the_first_evaluation_and_the_newest() -> None:
    status = TrainingRunStatus()
    for step in range(MAX_STATUS_EVALUATIONS + 20):
        record_evaluation(status, evaluation_result(entry("step", step)))
    steps = [e.step for e in status.evaluations]
    assert len(steps) == MAX_STATUS_EVALUATIONS
    assert steps[0] == 0 and steps[1] == 21 and steps[-1] == MAX_STATUS_EVALUATIONS + 19


def test_the_report_shows_the_search_beside_greedy(tmp_path: Path) -> None:
    metrics_file(tmp_path, [entry("start", 0), entry("end", 2)])
    text = write_report(tmp_path).read_text()
    evaluation = text.split("## Evaluation")[1]
    assert "by greedy decoding and by test-time search (majority)." in evaluation
    header, *rows = [line for line in evaluation.splitlines() if line.startswith("| ")]
    assert header.endswith(
        "| generated tokens per problem | seconds | majority accuracy "
        "| majority generated tokens per problem | majority seconds |"
    )
    assert rows[1].startswith("| after RL | 2 | 0.250 |")
    assert rows[1].endswith("| 30.0 | 1.5 | 0.750 | 240.0 | 12.5 |")
