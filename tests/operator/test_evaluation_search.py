"""spec.evaluation.search and status.evaluations: what a manifest may ask for (each refusal
one line naming the field), the defaults a mode runs with, the CRD schema, and the status
entries as the trainer patches them and the API server gives them back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubestar.api import crds
from kubestar.api import v1alpha1 as api
from kubestar.api.trainer_contract import trainer_patch
from kubestar.operator.reconciler import validation_message
from pydantic import ValidationError

HELD_OUT = {"generator": "basic_arithmetic", "size": 4}


def run_document(search: dict[str, Any] | None, dataset: dict[str, Any] | None = HELD_OUT) -> Any:
    evaluation: dict[str, Any] = {}
    if dataset is not None:
        evaluation["dataset"] = dataset
    if search is not None:
        evaluation["search"] = search
    return {
        "apiVersion": api.API_VERSION,
        "kind": "TrainingRun",
        "metadata": {"name": "run"},
        "spec": {
            "rolloutFleetRef": {"name": "fleet"},
            "sandboxPoolRef": {"name": "pool"},
            "stages": [
                {"name": "s", "maxResponseTokens": 64, "steps": 1, "dataset": HELD_OUT},
            ],
            "evaluation": evaluation,
        },
    }


def refusal(search: dict[str, Any] | None, dataset: dict[str, Any] | None = HELD_OUT) -> str:
    with pytest.raises(api.ManifestError) as error:
        api.parse_resource(run_document(search, dataset))
    return str(error.value)


@pytest.mark.parametrize(
    ("search", "words"),
    [
        ({"mode": "mcts"}, ["spec.evaluation.search", "ppm: mode mcts needs"]),
        ({"mode": "beam"}, ["spec.evaluation.search", "ppm: mode beam needs"]),
        ({"mode": "best-of-n", "samples": 4}, ["ppm: mode best-of-n needs"]),
        ({"mode": "mcts", "ppm": "/p", "beams": 4}, ["beams: mode mcts does not use it", "beam"]),
        ({"mode": "beam", "ppm": "/p", "samples": 4}, ["samples: mode beam", "majority"]),
        ({"mode": "majority", "beamSamples": 2}, ["beamSamples: mode majority", "for beam"]),
        ({"mode": "majority", "rollouts": 2}, ["rollouts: mode majority", "for mcts"]),
        ({"mode": "best-of-n", "ppm": "/p", "children": 2}, ["children: mode best-of-n"]),
        ({"mode": "majority", "ppm": "/p"}, ["ppm: mode majority does not use a PPM"]),
        ({"mode": "ppm-vote", "samples": 4}, ["ppm: mode ppm-vote needs"]),
        ({"mode": "ppm-vote", "ppm": "/p", "rollouts": 2}, ["rollouts: mode ppm-vote"]),
        ({"mode": "greedy"}, ["spec.evaluation.search.mode", "mcts"]),
        ({"mode": "majority", "samples": 0}, ["spec.evaluation.search.samples"]),
        ({"mode": "majority", "sample": 4}, ["spec.evaluation.search.sample: unknown field"]),
    ],
)
def test_a_search_the_mode_cannot_run_is_refused_naming_the_field(
    search: dict[str, Any], words: list[str]
) -> None:
    message = refusal(search)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_a_search_without_held_out_problems_is_refused() -> None:
    message = refusal({"mode": "majority"}, dataset=None)
    assert "spec.evaluation" in message and "search:" in message and "dataset" in message


def test_the_operator_shows_the_refusal_naming_the_field() -> None:
    document = run_document({"mode": "majority", "beams": 4})
    with pytest.raises(ValidationError) as error:
        api.TrainingRunSpec.model_validate(document["spec"])
    message = validation_message(error.value)
    assert message.startswith("spec.evaluation.search: ")
    assert "beams: mode majority does not use it" in message


def test_defaults_of_each_mode() -> None:
    run = api.parse_resource(run_document({"mode": "majority"}))
    assert isinstance(run, api.TrainingRun)
    search = run.spec.evaluation.search
    assert search is not None
    assert (search.format, search.temperature, search.seed, search.ppm) == (
        "tool-call",
        0.7,
        1,
        None,
    )
    # Budget fields stay unset (so a mode never carries another's); budget() reads the default.
    assert (search.samples, search.rollouts, search.beams) == (None, None, None)
    assert search.budget("samples") == 8
    mcts = api.SearchEvaluationSpec.model_validate({"mode": "mcts", "ppm": "/p", "rollouts": 3})
    assert (mcts.budget("rollouts"), mcts.budget("children")) == (3, 16)
    beam = api.SearchEvaluationSpec.model_validate({"mode": "beam", "ppm": "/p"})
    assert (beam.budget("beams"), beam.budget("beam_samples")) == (8, 8)
    assert api.parse_resource(run_document(None)).spec.evaluation.search is None  # type: ignore[attr-defined]


def test_the_crd_documents_search_and_gives_budgets_no_default() -> None:
    """The API server fills schema defaults in: a budget field with one would reach every
    mode and be refused by the ones that do not spend it."""
    run = next(c for c in crds.crd_objects() if c["spec"]["names"]["kind"] == "TrainingRun")
    schema = run["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    evaluation = schema["properties"]["spec"]["properties"]["evaluation"]["properties"]
    search = evaluation["search"]
    assert search["description"] == api.EvaluationSpec.model_fields["search"].description
    fields = search["properties"]
    assert fields["mode"]["enum"] == ["mcts", "beam", "majority", "best-of-n", "ppm-vote"]
    assert search["required"] == ["mode"]
    for name in ("rollouts", "children", "beams", "beamSamples", "samples"):
        assert "default" not in fields[name], name
        assert fields[name]["minimum"] == 1
    assert fields["format"]["enum"] == ["tool-call", "rstar"]
    assert fields["ppm"]["description"].startswith("A PPM folder")
    status = schema["properties"]["status"]["properties"]["evaluations"]
    entry = status["items"]["properties"]
    assert set(entry["search"]["properties"]) == {
        "mode",
        "accuracy",
        "answered",
        "generatedTokensPerProblem",
        "seconds",
    }


def test_status_evaluations_round_trip_through_the_trainers_patch() -> None:
    status = api.TrainingRunStatus(
        step=4,
        evaluations=[
            api.EvaluationResult(point="start", step=0, problems=4, accuracy=0.25),
            api.EvaluationResult(
                point="end",
                step=4,
                problems=4,
                accuracy=0.5,
                generated_tokens_per_problem=31.5,
                seconds=2.0,
                search=api.SearchEvaluationResult(
                    mode="majority",
                    accuracy=0.75,
                    answered=1.0,
                    generated_tokens_per_problem=250.0,
                    seconds=9.5,
                ),
            ),
        ],
    )
    body = trainer_patch(status)["status"]
    sent = json.loads(json.dumps(body))  # what goes over the wire
    end = sent["evaluations"][1]
    assert end["generatedTokensPerProblem"] == 31.5
    assert end["search"] == {
        "mode": "majority",
        "accuracy": 0.75,
        "answered": 1.0,
        "generatedTokensPerProblem": 250.0,
        "seconds": 9.5,
    }
    assert sent["evaluations"][0]["search"] is None
    assert api.TrainingRunStatus.model_validate(sent).evaluations == status.evaluations
