"""A self-evolution round's mechanics without engines or training: SFT examples in the
policy's own token ids, the data files, the manifest, skipping done stages on a rerun,
resuming only with the same settings, and which models and problems a round takes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubestar.api.errors import SettingError
from kubestar.search.data import sft_traces
from kubestar.search.evolve import (
    LINEAGE,
    OLD_GREEDY,
    PAIRS,
    PARTIAL_TREES,
    SFT_DATA,
    TREES,
    EvalSettings,
    PpmSettings,
    Round,
    RoundError,
    RoundSettings,
    SftSettings,
    load_round_problems,
    read_sft_examples,
    resolve_models,
    starting_checkpoint,
    trace_example,
)
from kubestar.search.ppm_data import path_token_ids
from kubestar.search.tree import SearchSettings
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem

from tests.search.evolve_support import (
    BAD_IDS,
    GOOD_ANSWER_IDS,
    GOOD_IDS,
    OBSERVATION,
    ROOT_IDS,
    FakeServices,
    planted_tree,
    write_model,
    write_problems,
)

PROBLEM = Problem("p0", "What is 6 * 7?", "42")


def char_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_trace_becomes_an_example_in_the_policys_token_ids() -> None:
    root = planted_tree(PROBLEM)
    (trace,) = sft_traces(root, "42")
    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return char_ids(text)

    example = trace_example(
        trace, root, encode, example_id="p0/0.1.1", question=PROBLEM.question, answer="42"
    )
    observation = char_ids(OBSERVATION)
    assert example.prompt_ids == list(ROOT_IDS)
    assert example.response_ids == [*GOOD_IDS, *observation, *GOOD_ANSWER_IDS]
    assert example.response_mask == [1, 1, 1] + [0] * len(observation) + [1, 1]
    # What the policy wrote is taken as sampled; only the tool's observation is encoded.
    assert encoded == [OBSERVATION]
    # The example is the sequence the search prompted the policy with at the answer.
    answer_node = trace.steps[-1]
    assert example.prompt_ids + example.response_ids == path_token_ids(answer_node, char_ids)
    assert example.tool_codes == ["print(6 * 7)"] and example.tool_statuses == ["ok"]
    assert example.metadata["nodes"] == ["0.1", "0.1.1"]
    assert example.metadata["q_values"] == [1.0, 1.0]


def test_a_step_without_token_ids_is_refused_not_retokenised() -> None:
    root = planted_tree(PROBLEM)
    (trace,) = sft_traces(root, "42")
    trace.steps[0].token_ids = ()
    with pytest.raises(ValueError, match=r"node 0\.1 holds no token ids"):
        trace_example(trace, root, char_ids, example_id="p0", question="", answer="42")


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return write_model(tmp_path / "models" / "base")


def settings_for(tmp_path: Path, policy: Path, **changes: Any) -> RoundSettings:
    problems = write_problems(tmp_path / "problems.jsonl", 5)
    base = RoundSettings(
        policy=str(policy),
        problems=str(problems),
        out=str(tmp_path / "round"),
        limit=3,
        search=SearchSettings(rollouts=2, children=2),
        ppm=PpmSettings(base=str(policy)),
        evaluation=EvalSettings(limit=2),
    )
    return replace(base, **changes)


def test_the_data_stage_writes_sft_examples_and_pairs(tmp_path: Path, policy: Path) -> None:
    services = FakeServices()
    lines: list[str] = []
    manifest = Round(settings_for(tmp_path, policy), services, lines.append).run(until="data")
    folder = tmp_path / "round"
    encode = ChatTokenizer.from_model(policy).encode
    observation = encode(OBSERVATION)

    trees = [json.loads(line) for line in (folder / TREES).read_text().splitlines()]
    assert [tree["problem"] for tree in trees] == ["problems-0", "problems-1", "problems-2"]
    pairs = [json.loads(line) for line in (folder / PAIRS).read_text().splitlines()]
    assert len(pairs) == 3  # one per tree: the step to the reference against the other
    for pair in pairs:
        assert pair["prompt_ids"] == list(ROOT_IDS)
        assert pair["chosen_ids"] == [*GOOD_IDS, *observation]
        assert pair["rejected_ids"] == list(BAD_IDS)
        assert pair["margin"] == 2.0
    examples = read_sft_examples(folder / SFT_DATA)
    assert [e.id for e in examples] == ["problems-0/0.1.1", "problems-1/0.1.1", "problems-2/0.1.1"]
    assert all(e.response_ids == [*GOOD_IDS, *observation, *GOOD_ANSWER_IDS] for e in examples)
    assert [e.answer for e in examples] == ["42", "48", "54"]

    stages = manifest["stages"]
    assert set(stages) == {"search", "data"} and all(s["done"] for s in stages.values())
    assert stages["search"]["figures"]["solved_by_search"] == 3
    data = stages["data"]["figures"]
    assert (data["sft_examples"], data["pairs"], data["problems_with_pairs"]) == (3, 3, 3)
    assert json.loads((folder / "round.json").read_text())["stages"] == stages
    # The search ran with ground-truth values, and the old policy was evaluated greedily on
    # the same engine; both on the two problems held out of the file.
    assert services.started == [policy]
    assert services.calls == [("base", "mcts", True, ""), ("base", "greedy", False, "")]
    evaluation = json.loads((folder / "eval.json").read_text())
    assert evaluation["problems"] == ["problems-3", "problems-4"]
    assert evaluation["parts"][OLD_GREEDY]["accuracy"] == 0.0
    assert any("[2/5] data: 3 SFT examples from 3 problems" in line for line in lines)


def test_done_stages_are_skipped_when_the_round_runs_again(tmp_path: Path, policy: Path) -> None:
    settings = settings_for(tmp_path, policy)
    folder = tmp_path / "round"
    Round(settings, FakeServices()).run(until="data")
    written = {name: (folder / name).stat().st_mtime_ns for name in (TREES, SFT_DATA, PAIRS)}

    again, lines = FakeServices(), list[str]()
    Round(settings, again, lines.append).run(until="data")
    assert again.started == [] and again.calls == []
    assert {name: (folder / name).stat().st_mtime_ns for name in written} == written
    assert [line.split(":")[0] for line in lines] == ["[1/5] search", "[2/5] data"]
    assert all("done, skipped" in line for line in lines)

    # A done stage whose output is gone runs again, and so does every stage after it; the
    # old policy's evaluation does not depend on them and is kept.
    (folder / TREES).unlink()
    (folder / SFT_DATA).write_text("")
    third = FakeServices()
    manifest = Round(settings, third).run(until="data")
    assert third.calls == [("base", "mcts", True, "")]
    assert (folder / TREES).exists() and len(read_sft_examples(folder / SFT_DATA)) == 3
    assert manifest["stages"]["data"]["figures"]["sft_examples"] == 3


def test_an_interrupted_search_keeps_its_trees_and_searches_only_the_rest(
    tmp_path: Path, policy: Path
) -> None:
    settings = settings_for(tmp_path, policy, limit=4)
    folder = tmp_path / "round"
    with pytest.raises(RuntimeError, match="went away"):
        Round(settings, FakeServices(fail_after=2)).run(until="search")
    partial = folder / PARTIAL_TREES
    kept = partial.read_text().splitlines()
    assert [json.loads(line)["problem"] for line in kept] == ["problems-0", "problems-1"]
    assert not (folder / TREES).exists()
    # The interruption cut the third tree's line short.
    partial.write_text("\n".join(kept) + '\n{"problem": "problems-2", "mo')

    again, lines = FakeServices(), list[str]()
    manifest = Round(settings, again, lines.append).run(until="search")
    assert again.solved[:2] == ["problems-2", "problems-3"]  # then the greedy evaluation's
    assert any("2 trees kept from the interrupted search" in line for line in lines)
    trees = (folder / TREES).read_text().splitlines()
    assert [json.loads(line)["problem"] for line in trees] == [f"problems-{k}" for k in range(4)]
    assert trees[:2] == kept  # as the interrupted search wrote them
    assert not partial.exists()
    figures = manifest["stages"]["search"]["figures"]
    assert (figures["problems"], figures["solved_by_search"]) == (4, 4)


def test_a_round_resumes_only_with_its_settings(tmp_path: Path, policy: Path) -> None:
    Round(settings_for(tmp_path, policy), FakeServices()).run(until="search")
    other = settings_for(tmp_path, policy, search=SearchSettings(rollouts=4, children=2))
    with pytest.raises(SettingError, match=r"search\.rollouts 2 there, 4 now") as caught:
        Round(other, FakeServices()).run()
    assert caught.value.setting == "out"
    # How fast it runs is no part of what it makes.
    faster = settings_for(tmp_path, policy, concurrency=16)
    Round(faster, FakeServices()).run(until="search")


def test_a_round_without_a_correct_trace_stops_at_sft(tmp_path: Path, policy: Path) -> None:
    settings = settings_for(tmp_path, policy)
    Round(settings, FakeServices()).run(until="data")
    (tmp_path / "round" / SFT_DATA).write_text("")
    # data is done (its files are there), so the round goes on with SFT.
    with pytest.raises(RoundError, match=r"sft\.jsonl: no SFT examples"):
        Round(settings, FakeServices()).run()


def test_the_sft_base_is_the_policys_starting_checkpoint(tmp_path: Path, policy: Path) -> None:
    # A policy that no round wrote starts from itself.
    assert starting_checkpoint(policy) == policy
    assert resolve_models(settings_for(tmp_path, policy)).sft_base == policy
    # A round's policy starts from the model its own SFT started from.
    evolved = write_model(tmp_path / "round-1" / "policy")
    (evolved / LINEAGE).write_text(json.dumps({"base": str(policy)}))
    models = resolve_models(settings_for(tmp_path, evolved))
    assert (models.policy, models.sft_base) == (evolved, policy)
    # A base that is gone, or a named one, is not looked up.
    (evolved / LINEAGE).write_text(json.dumps({"base": str(tmp_path / "gone")}))
    assert starting_checkpoint(evolved) == evolved
    named = write_model(tmp_path / "models" / "other")
    sft = SftSettings(base=str(named))
    assert resolve_models(settings_for(tmp_path, evolved, sft=sft)).sft_base == named


def test_models_must_share_the_policys_tokenizer(tmp_path: Path, policy: Path) -> None:
    stranger = write_model(tmp_path / "models" / "stranger", words=("<unk>", "<|im_end|>", "x"))
    with pytest.raises(SettingError, match="another tokenizer") as caught:
        resolve_models(settings_for(tmp_path, policy, ppm=PpmSettings(base=str(stranger))))
    assert caught.value.setting == "ppm.base"
    with pytest.raises(SettingError) as missing:
        resolve_models(settings_for(tmp_path, tmp_path / "no-such-model"))
    assert missing.value.setting == "policy"


def test_evaluation_problems_are_held_out(tmp_path: Path, policy: Path) -> None:
    settings = settings_for(tmp_path, policy)
    training, held_out = load_round_problems(settings)
    assert [p.id for p in training] == ["problems-0", "problems-1", "problems-2"]
    assert [p.id for p in held_out] == ["problems-3", "problems-4"]
    # A question the round trains on is never evaluated on, whatever the source.
    repeated = tmp_path / "repeated.jsonl"
    repeated.write_text(
        json.dumps({"question": "What is 6 * 7?", "answer": "42"})
        + "\n"
        + json.dumps({"question": "What is 2 + 2?", "answer": "4"})
        + "\n"
    )
    own = replace(settings, evaluation=EvalSettings(problems=str(repeated)))
    assert [p.question for p in load_round_problems(own)[1]] == ["What is 2 + 2?"]
    with pytest.raises(SettingError) as caught:
        load_round_problems(replace(settings, limit=None))
    assert caught.value.setting == "evaluation.problems"
