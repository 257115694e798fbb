"""What a TrainingRun's algorithm, stage and evaluation fields make the trainer do: the
rollouts per problem, the order a stage draws its problems in, the stage filter and the
evaluation's sampling."""

from __future__ import annotations

from typing import Any

import pytest
from kubestar.api.v1alpha1 import (
    AlgorithmSpec,
    EvaluationSpec,
    StageFilterResult,
    StageSpec,
    TrainingRunStatus,
)
from kubestar.training.datasets import Problem
from kubestar.training.progress import (
    evaluation_result,
    record_stage_filter,
    stage_filter_entry,
    stage_filters_from_log,
)
from kubestar.training.session import (
    TooFewProblems,
    algorithm_config,
    check_enough_problems,
    filter_unsolved,
    step_problems,
)
from pydantic import ValidationError


def problems(count: int) -> list[Problem]:
    return [Problem(id=f"p{i}", question=f"{i} + 1?", answer=str(i + 1)) for i in range(count)]


def stage(**fields: Any) -> StageSpec:
    spec: dict[str, Any] = {
        "name": "s1",
        "maxResponseTokens": 64,
        "steps": 2,
        "problemsPerStep": 4,
        "dataset": {"path": "/data/problems.jsonl", "format": "dapo", "size": 40},
    }
    spec.update(fields)
    return StageSpec.model_validate(spec)


def test_roc_fields_are_refused_under_plain_grpo() -> None:
    for field, value in (("oversampleFactor", 2), ("positiveSelection", "lowest-penalty")):
        with pytest.raises(ValidationError, match=f"{field}: only grpo-roc oversamples"):
            AlgorithmSpec.model_validate({"name": "grpo", field: value})
    # Unset, each takes grpo-roc's default; plain GRPO rolls out exactly the group.
    roc = algorithm_config(AlgorithmSpec.model_validate({"groupSize": 4}))
    assert roc.rollouts_per_problem == 8 and roc.positive_selection == "inverse-penalty"
    grpo = algorithm_config(AlgorithmSpec.model_validate({"name": "grpo", "groupSize": 4}))
    assert grpo.rollouts_per_problem == 4
    chosen = AlgorithmSpec.model_validate(
        {"groupSize": 4, "oversampleFactor": 3, "positiveSelection": "lowest-penalty"}
    )
    assert algorithm_config(chosen).rollouts_per_problem == 12
    assert algorithm_config(chosen).positive_selection == "lowest-penalty"


def test_the_datasets_seed_orders_a_files_problems() -> None:
    pool = problems(40)

    def drawn(seed: int) -> list[str]:
        spec = stage(dataset={"path": "/data/p.jsonl", "format": "dapo", "size": 40, "seed": seed})
        return [p.id for step in range(3) for p in step_problems(pool, spec, step)]

    assert drawn(0) == drawn(0)
    assert drawn(0) != drawn(1)
    assert len(set(drawn(1))) == 12  # three steps of four, no repeat within a pass


def test_the_filter_keeps_what_the_policy_does_not_always_solve() -> None:
    pool = problems(40)
    always = {f"p{i}" for i in range(0, 40, 2)}  # even problems: solved k of k
    asked: list[list[str]] = []

    def solved(candidates: list[Problem]) -> dict[str, int]:
        asked.append([p.id for p in candidates])
        return {p.id: 3 if p.id in always else 1 for p in candidates}

    spec = stage(steps=2, problemsPerStep=4)  # needs 8
    kept, evaluated = filter_unsolved(pool, spec, 3, solved)
    # Chunks of max(problemsPerStep, 8) in the stage's order, until 8 are kept.
    evaluated_ids = [i for chunk in asked for i in chunk]
    first_pass = [p.id for p in step_problems(pool, stage(steps=10, problemsPerStep=40), 0)]
    assert {len(chunk) for chunk in asked} == {8} and evaluated == len(evaluated_ids)
    assert evaluated_ids == first_pass[:evaluated]
    assert [p.id for p in kept] == [i for i in evaluated_ids if i not in always]
    assert len(kept) >= 8 > len([i for i in evaluated_ids[:-8] if i not in always])


def test_a_filter_that_leaves_too_few_problems_fails_the_stage() -> None:
    pool = problems(12)
    spec = stage(problemsPerStep=4)

    def solved(candidates: list[Problem]) -> dict[str, int]:
        return {p.id: 2 if p.id not in ("p0", "p1") else 0 for p in candidates}

    kept, evaluated = filter_unsolved(pool, spec, 2, solved)
    assert sorted(p.id for p in kept) == ["p0", "p1"] and evaluated == 12
    result = StageFilterResult(stage="s1", k=2, evaluated=evaluated, kept=len(kept))
    with pytest.raises(TooFewProblems, match="kept 2 of 12 problems, fewer than problemsPerStep 4"):
        check_enough_problems(spec, result)
    check_enough_problems(stage(problemsPerStep=2), result)  # one step's worth is enough


def test_stage_filters_are_rebuilt_from_the_log() -> None:
    first = StageFilterResult(stage="s3", k=8, evaluated=64, kept=40)
    again = StageFilterResult(stage="s3", k=8, evaluated=72, kept=41)  # after a restart
    other = StageFilterResult(stage="s2", k=4, evaluated=10, kept=9)
    log = [stage_filter_entry(5, first), {"step": 6, "stage": "s3"}, stage_filter_entry(5, again)]
    log.append(stage_filter_entry(9, other))
    assert stage_filters_from_log(log) == [again, other]
    status = TrainingRunStatus()
    record_stage_filter(status, first)
    record_stage_filter(status, again)
    assert status.stage_filters == [again]
    dumped = status.model_dump(by_alias=True)["stageFilters"]
    assert dumped == [{"stage": "s3", "k": 8, "evaluated": 72, "kept": 41}]


def test_evaluation_samples_at_its_temperature() -> None:
    assert EvaluationSpec.model_validate({}).temperature == 1.0
    with pytest.raises(ValidationError, match="samples: 16 greedy trajectories"):
        EvaluationSpec.model_validate({"samples": 16, "temperature": 0})
    assert EvaluationSpec.model_validate({"samples": 1, "temperature": 0}).samples == 1
    entry = {
        "step": 4,
        "stage": "evaluation",
        "point": "step",
        "eval_accuracy": 0.25,
        "eval_pass_at_k": 0.75,
        "eval_samples": 16,
        "eval_temperature": 1.0,
    }
    result = evaluation_result(entry)
    assert (result.accuracy, result.pass_at_k, result.samples, result.temperature) == (
        0.25,
        0.75,
        16,
        1.0,
    )
