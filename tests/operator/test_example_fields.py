"""Every field the examples set does something: changing it changes what the operator makes
or what the trainer does.

For each example (examples/paper-amd.yaml, examples/qwen3-nvidia.yaml and
examples/gpu-smoke.yaml) the test walks every leaf a user wrote under each resource's spec (a
list of scalars, such as a SandboxPool's preload, is one leaf; comments are not fields),
changes it to another valid value (`changed`, with a small table, `SPECIAL`, for fields that
must change together), and compares the effect of the example before and after (`Effects`):

* what the operator makes: the children its pure builders make, called as the reconciles
  call them. The TrainingRun's ConfigMap is left out: it holds the whole spec, so any change
  would show there.
* what the trainer does, computed only with the trainer's own functions: the model it loads,
  its algorithm and Policy settings, the problems each stage trains on (read from stand-in
  files at the example's paths, through the stage filter with scripted rollouts), the
  rollouts it asks for, its SFT stage run against a recording policy, when it checkpoints
  and what it keeps, and the evaluation's problems and sampling.

* what `kubectl get` shows: the printer columns the CRDs declare on spec fields (a model's
  name, in a fleet that loads it from a claim, is what its Model column says).

A field without effect fails its case, which is named by the field's path.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import random
import re
import types
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin
from unittest import mock

import annotated_types
import pyarrow
import pyarrow.parquet as pyarrow_parquet
import pytest
import yaml
from _pytest.mark import ParameterSet
from kubestar.api.crds import crd_objects
from kubestar.api.v1alpha1 import (
    KINDS,
    DatasetSpec,
    ManifestError,
    RolloutFleetSpec,
    SandboxPoolSpec,
    SftSpec,
    StageFilterResult,
    StageSpec,
    TrainingRun,
    TrainingRunSpec,
    parse_resource,
)
from kubestar.operator import build_fleet, build_sandbox, build_trainer, rolloutfleet
from kubestar.operator.settings import OperatorSettings, SharedCheckpoints, TrainerDefaults
from kubestar.operator.trainingrun import dependencies
from kubestar.training import checkpoint
from kubestar.training.batch import TokenBatch
from kubestar.training.checkpoint import RunState
from kubestar.training.datasets import DAPO_INSTRUCTION, DAPO_REMINDER, Problem
from kubestar.training.distributed import SINGLE
from kubestar.training.endpoints import Endpoints
from kubestar.training.rollout import RolloutConfig
from kubestar.training.session import (
    RolloutRequest,
    TrainingSession,
    algorithm_config,
    check_enough_problems,
    checkpoint_due,
    evaluation_rollouts,
    filter_unsolved,
    load_dataset,
    policy_settings,
    sft_stage,
    step_problems,
    total_steps,
    training_rollouts,
)
from kubestar.training.sft import run_sft
from kubestar.training.tools import IM_END, IM_START
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.operator.support import EXAMPLES, parent

EXAMPLE_NAMES = ("paper-amd.yaml", "qwen3-nvidia.yaml", "gpu-smoke.yaml")
EXAMPLE_FILES = [EXAMPLES / name for name in EXAMPLE_NAMES]

# Installed as the examples ask: the chart's shared checkpoint volume, which the trainer
# pods write to and the engines load each step's weights from.
SETTINGS = OperatorSettings(
    trainer=TrainerDefaults(shared_checkpoints=SharedCheckpoints(pvc_claim_name="checkpoints"))
)

Key = str | int
FieldPath = tuple[Key, ...]
Document = dict[str, Any]
T = TypeVar("T")


def load(file: Path) -> list[Document]:
    return [document for document in yaml.safe_load_all(file.read_text()) if document]


# -- the walk ---------------------------------------------------------------------------------
def leaves(value: Any, path: FieldPath) -> Iterator[FieldPath]:
    """Every leaf under `value` as written; a list of scalars is one leaf."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path


def walk(documents: Sequence[Document]) -> list[tuple[int, FieldPath]]:
    """(document index, path) of every leaf under each resource's spec."""
    return [
        (index, path)
        for index, document in enumerate(documents)
        for path in leaves(document.get("spec") or {}, ("spec",))
    ]


def dotted(path: FieldPath, wildcard: bool = False) -> str:
    """spec.stages[2].filter.dropSolvedKOfK, spec.trainer.resources.limits["amd.com/gpu"];
    `wildcard`: list indices as [*]."""
    text = ""
    for key in path:
        if isinstance(key, int):
            text += "[*]" if wildcard else f"[{key}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", key):
            text += f".{key}" if text else key
        else:
            text += f'["{key}"]'
    return text


def get_at(document: Any, path: FieldPath) -> Any:
    for key in path:
        document = document[key]
    return document


def set_at(document: Any, path: FieldPath, value: Any) -> None:
    get_at(document, path[:-1])[path[-1]] = value


# -- the mutation ---------------------------------------------------------------------------
def field_at(kind: str, path: FieldPath) -> tuple[Any, FieldInfo | None]:
    """The schema's type of the value at `path` and its pydantic field (None inside a dict
    or for a list's item)."""
    annotation: Any = KINDS[kind]
    info: FieldInfo | None = None
    for key in path:
        annotation = _unwrap_optional(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            info = next(f for name, f in annotation.model_fields.items() if key in (name, f.alias))
            annotation = info.annotation
        else:
            annotation = get_args(annotation)[-1]  # list[X] -> X, dict[str, X] -> X
            info = None
    return _unwrap_optional(annotation), info


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _literals(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def _within(value: float, info: FieldInfo | None) -> bool:
    for bound in info.metadata if info else ():
        if isinstance(bound, annotated_types.Ge) and not value >= cast(float, bound.ge):
            return False
        if isinstance(bound, annotated_types.Gt) and not value > cast(float, bound.gt):
            return False
        if isinstance(bound, annotated_types.Le) and not value <= cast(float, bound.le):
            return False
        if isinstance(bound, annotated_types.Lt) and not value < cast(float, bound.lt):
            return False
    return True


def changed(value: Any, annotation: Any, info: FieldInfo | None) -> Any:
    """Another valid value: another allowed literal, the other bool, a number next to it
    within the field's bounds, another plausible string, a list one item shorter (or
    longer)."""
    if literals := _literals(annotation):
        return next(other for other in literals if other != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        if isinstance(value, int):
            candidates: list[float] = [value + 1, value - 1]
        else:
            candidates = [round(value * 1.1, 12), round(value * 0.9, 12)] if value else [0.1]
        within = [candidate for candidate in candidates if _within(candidate, info)]
        assert within, f"no value next to {value!r} within the bounds of {info}"
        return within[0]
    if isinstance(value, str):
        if number := re.fullmatch(r"(\d+)(\D*)", value):  # a quantity: "32", "96Gi"
            return f"{int(number[1]) + 1}{number[2]}"
        stem, dot, extension = value.rpartition(".")
        if dot and "/" not in extension:  # a file: /data/sft.jsonl -> /data/sft-b.jsonl
            return f"{stem}-b.{extension}"
        return f"{value}-b"
    if isinstance(value, list):
        if len(value) > 1:
            return value[:-1]
        allowed = _literals(get_args(annotation)[0]) if get_args(annotation) else ()
        extra = next((v for v in allowed if v not in value), f"{value[0]}-b" if value else "x")
        return [*value, extra]
    raise AssertionError(f"no rule to change {value!r}")


# Fields changed another way than `changed`'s: (kind, path pattern, change in place).
Mutation = Callable[[Document, FieldPath], None]


def _other_algorithm(document: Document, path: FieldPath) -> None:
    """grpo-roc <-> grpo; grpo refuses RoC's own fields, so they go with it."""
    algorithm = document["spec"]["algorithm"]
    algorithm["name"] = "grpo" if algorithm.get("name", "grpo-roc") == "grpo-roc" else "grpo-roc"
    if algorithm["name"] == "grpo":
        algorithm.pop("oversampleFactor", None)
        algorithm.pop("positiveSelection", None)


def _other_process_count(document: Document, path: FieldPath) -> None:
    """processesPerWorker and the trainer's accelerators move together: the schema wants the
    limit equal to processesPerWorker, Kubernetes an extended resource's request equal to
    its limit."""
    trainer = document["spec"]["trainer"]
    count = int(trainer.get("processesPerWorker", 1))
    new = count - 1 if count > 1 else 2
    trainer["processesPerWorker"] = new
    resources = trainer.get("resources") or {}
    for part in ("requests", "limits"):
        for name in resources.get(part) or {}:
            if name.endswith("/gpu"):
                resources[part][name] = new


def _half(document: Document, path: FieldPath) -> None:
    """Half: the stand-in conversations' lengths double from one to the next, so one lies
    between any value and its half."""
    set_at(document, path, max(64, get_at(document, path) // 2))


def _other_format(document: Document, path: FieldPath) -> None:
    """Another format that reads the file: jsonl reads JSON lines only, dapo and aime also
    parquet and JSON arrays."""
    file = str(get_at(document, (*path[:-1], "path")))
    formats = (
        ("jsonl", "dapo", "aime") if file.endswith((".jsonl", ".ndjson")) else ("dapo", "aime")
    )
    set_at(document, path, next(f for f in formats if f != get_at(document, path)))


def _other_size(document: Document, path: FieldPath) -> None:
    """One more problem, or, for a size beyond the PROBLEMS of the stand-in files (which it
    reads whole), one fewer than they hold."""
    size = get_at(document, path)
    set_at(document, path, size + 1 if size < PROBLEMS else PROBLEMS - 1)


def _other_runtime(document: Document, path: FieldPath) -> None:
    set_at(document, path, "kata" if get_at(document, path) == "gvisor" else "gvisor")


def _other_generator(document: Document, path: FieldPath) -> None:
    """Another reasoning-gym generator (a name the walk would make up is none)."""
    set_at(document, path, "chain_sum" if get_at(document, path) != "chain_sum" else "gcd")


SPECIAL: list[tuple[str, str, Mutation]] = [
    ("TrainingRun", r"spec\.algorithm\.name", _other_algorithm),
    ("TrainingRun", r"spec\.trainer\.processesPerWorker", _other_process_count),
    (
        "TrainingRun",
        r'spec\.trainer\.resources\.(requests|limits)\["[^"]+/gpu"\]',
        _other_process_count,
    ),
    ("TrainingRun", r"spec\.sft\.maxTokens", _half),
    ("TrainingRun", r"spec\.(stages\[\*\]|evaluation)\.dataset\.format", _other_format),
    ("TrainingRun", r"spec\.(stages\[\*\]|evaluation)\.dataset\.size", _other_size),
    ("SandboxPool", r"spec\.runtimeClassName", _other_runtime),
    ("TrainingRun", r"spec\.(stages\[\*\]|evaluation)\.dataset\.generator", _other_generator),
]


def mutate(documents: Sequence[Document], index: int, path: FieldPath) -> list[Document]:
    """A copy of `documents` with the field at `path` of document `index` changed; every
    document still validates."""
    mutated = copy.deepcopy(list(documents))
    document = mutated[index]
    kind = document["kind"]
    special = [m for k, p, m in SPECIAL if k == kind and re.fullmatch(p, dotted(path, True))]
    if special:
        special[0](document, path)
    else:
        set_at(document, path, changed(get_at(document, path), *field_at(kind, path)))
    assert get_at(mutated[index], path) != get_at(documents[index], path)
    for each in mutated:
        try:
            parse_resource(each)
        except ManifestError as error:
            where = f"{kind} {dotted(path)}"
            raise AssertionError(f"{where}: changed, the example is invalid: {error}") from None
    return mutated


# -- stand-ins for the data volume and the model's tokenizer -----------------------------------
# Problems in each stand-in file (a dataset's size beyond it reads them all; see _other_size).
PROBLEMS = 2000
WORDS = [f"w{i}" for i in range(64)]
# SFT conversations; every 30th is long, 24 words doubling up to 12288 (see _half).
CONVERSATIONS = 300
LONG_WORDS = [3 * 2**j for j in range(3, 13)]


def problem_record(tag: int, number: int) -> dict[str, Any]:
    """One problem as each format finds it: dapo reads prompt, reward_model.ground_truth and
    extra_info.index; aime problem, answer and problem_idx; jsonl problem and answer, and
    numbers the problems itself."""
    question = f"What is {number} + {tag}?"
    answer = str(number + tag)
    return {
        "prompt": [{"role": "user", "content": f"{DAPO_INSTRUCTION}{question}{DAPO_REMINDER}"}],
        "reward_model": {"ground_truth": answer},
        "extra_info": {"index": f"{tag}-{number}"},
        "problem": question,
        "answer": answer,
        "problem_idx": number + 1,
    }


def conversation(rng: random.Random, number: int) -> dict[str, Any]:
    length = LONG_WORDS[number // 30] if number % 30 == 0 else rng.randint(8, 40)
    answer = " ".join(rng.choice(WORDS) for _ in range(length))
    return {
        "messages": [
            {"role": "user", "content": f"Question {number}: {rng.choice(WORDS)}?"},
            {"role": "assistant", "content": answer},
        ]
    }


class DataVolume:
    """Stand-in files at the paths the examples name, made on first use. What a file holds
    follows from its path, so another path reads other problems or conversations."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _local(self, path: str) -> tuple[Path, int]:
        local = self.root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        return local, zlib.crc32(path.encode()) % 1000

    def problems(self, path: str) -> Path:
        local, tag = self._local(path)
        if not local.exists():
            records = [problem_record(tag, n) for n in range(PROBLEMS)]
            if local.suffix == ".parquet":
                pyarrow_parquet.write_table(pyarrow.Table.from_pylist(records), local)
            else:
                local.write_text("".join(json.dumps(record) + "\n" for record in records))
        return local

    def conversations(self, path: str) -> Path:
        local, _ = self._local(path)
        if not local.exists():
            rng = random.Random(path)
            lines = (json.dumps(conversation(rng, n)) + "\n" for n in range(CONVERSATIONS))
            local.write_text("".join(lines))
        return local


def tokenizer_folder(folder: Path) -> Path:
    """A model folder with just a tokenizer.json (all ChatTokenizer reads): one token per
    word of WORDS, one for every other word, and the ChatML markers."""
    vocabulary = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tokenizer.add_special_tokens([IM_START, IM_END])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# -- the effect -----------------------------------------------------------------------------
def fingerprint(problems: Sequence[Problem]) -> str:
    """How many problems and a digest of what they are."""
    text = json.dumps(
        [[p.id, p.question, p.answer, p.source, p.metadata] for p in problems], sort_keys=True
    )
    return f"{len(problems)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def scripted_rollouts(request: RolloutRequest) -> Callable[[list[Problem]], dict[str, int]]:
    """Stands in for the stage filter's rollouts: each problem has a solve rate (0, 1/4, ...,
    1, drawn from its id) and each of its request.samples samples is right with that rate."""

    def right(problem: Problem) -> int:
        draw = random.Random(problem.id)
        rate = draw.choice((0.0, 0.25, 0.5, 0.75, 1.0))
        return sum(draw.random() < rate for _ in range(request.samples))

    return lambda candidates: {problem.id: right(problem) for problem in candidates}


@dataclass
class RecordingPolicy:
    """Stands in for the Policy in run_sft: records the learning rates its optimizer is reset
    to and the batches it trains on."""

    world: Any = SINGLE
    optimizer_config: Any = field(default_factory=lambda: types.SimpleNamespace(learning_rate=1e-6))
    learning_rates: list[float | None] = field(default_factory=list)
    batches: list[tuple[int, int, str]] = field(default_factory=list)

    def reset_optimizer(self, learning_rate: float | None = None) -> None:
        self.learning_rates.append(learning_rate)

    def sft_step(self, rows: TokenBatch) -> dict[str, float]:
        digest = hashlib.sha256(rows.input_ids.numpy().tobytes()).hexdigest()[:16]
        self.batches.append((int(rows.input_ids.shape[0]), rows.tokens, digest))
        return {"loss": 1.0, "grad_norm": 0.0}


class NoReporter:
    def report(self, status: Any) -> None:
        pass


# Steps whose problems are compared, and global steps whose checkpoints are.
SAMPLED_STEPS = (0, 1)
CHECKPOINT_WINDOW = range(1, 65)


def shown_columns(kind: str, spec: Document) -> dict[str, Any]:
    """What `kubectl get` shows of a spec: the CRD's printer columns on .spec paths, read from
    the spec with its defaults filled in (as the API server stores it)."""
    (crd,) = [c for c in crd_objects() if c["spec"]["names"]["kind"] == kind]
    specs: dict[str, type[BaseModel]] = {
        "SandboxPool": SandboxPoolSpec,
        "RolloutFleet": RolloutFleetSpec,
        "TrainingRun": TrainingRunSpec,
    }
    values = specs[kind].model_validate(spec).model_dump(mode="json", by_alias=True)
    shown: dict[str, Any] = {}
    for version in crd["spec"]["versions"]:
        for column in version.get("additionalPrinterColumns", []):
            path = column["jsonPath"]
            if path.startswith(".spec."):
                value: Any = values
                for key in path.removeprefix(".spec.").split("."):
                    value = value.get(key) if isinstance(value, dict) else None
                shown[column["name"]] = value
    return shown


class Effects:
    """What the operator makes and what the trainer does for a list of documents; parts that
    depend on only some of the inputs are computed once per distinct input."""

    def __init__(self, root: Path) -> None:
        self.volume = DataVolume(root / "data")
        self.model_dir = tokenizer_folder(root / "model")
        self.run_dir = root / "run"
        self._cache: dict[str, Any] = {}

    def _cached(self, key: Any, make: Callable[[], T]) -> T:
        text = json.dumps(key, sort_keys=True, default=str)
        if text not in self._cache:
            self._cache[text] = make()
        return cast(T, self._cache[text])

    def __call__(self, documents: Sequence[Document]) -> dict[str, Any]:
        return self._cached(["effects", documents], lambda: self._effects(documents))

    def _effects(self, documents: Sequence[Document]) -> dict[str, Any]:
        objects = {
            (d["kind"], d["metadata"]["name"]): {
                **parent(d["kind"], d["metadata"]["name"]),
                "spec": d.get("spec") or {},
            }
            for d in documents
        }
        made: dict[str, Any] = {}
        for (kind, name), obj in objects.items():
            made[f"kubectl get {kind} {name}"] = shown_columns(kind, obj["spec"])
            if kind == "SandboxPool":
                pool = SandboxPoolSpec.model_validate(obj["spec"])
                made[f"{kind} {name}"] = build_sandbox.children(obj, pool, SETTINGS)
            elif kind == "RolloutFleet":
                fleet = rolloutfleet.fleet_spec(obj, SETTINGS)
                made[f"{kind} {name}"] = build_fleet.children(obj, fleet, SETTINGS)
            elif kind == "TrainingRun":
                made[f"{kind} {name}"] = self.trainer_children(obj, objects)
                made[f"trainer of {name}"] = self._cached(
                    ["trainer", obj], functools.partial(self.trainer, obj)
                )
        return made

    # -- the operator: a TrainingRun's children, as trainingrun.reconcile makes them ---------
    def trainer_children(
        self, run: Document, objects: dict[tuple[str, str], Document]
    ) -> dict[str, Any]:
        spec = TrainingRunSpec.model_validate(run["spec"])
        fleet = objects.get(("RolloutFleet", spec.rollout_fleet_ref.name))
        pool = objects.get(("SandboxPool", spec.sandbox_pool_ref.name))
        found, exist = dependencies(spec, "team", fleet, pool, 1)
        made: dict[str, Any] = {
            "problem": build_trainer.spec_problem(spec, SETTINGS),
            "dependencies": [found.reason, found.message],
            # build_trainer.config_map is left out: it is the whole spec.
            "rbac": build_trainer.rbac(run),
            "auth": build_trainer.auth(run, SETTINGS),
            "networkPolicies": build_trainer.network_policies(run, spec, SETTINGS),
            "checkpointClaim": build_trainer.checkpoint_claim(run, spec, SETTINGS),
            "worldSize": build_trainer.world_size(spec),
        }
        if exist:
            assert fleet is not None and pool is not None
            fleet_spec = rolloutfleet.fleet_spec(fleet, SETTINGS)
            pool_spec = SandboxPoolSpec.model_validate(pool["spec"])
            workloads = build_trainer.jobs(run, spec, fleet_spec, pool_spec, SETTINGS)
            if build_trainer.world_size(spec) > 1:
                workloads.insert(0, build_trainer.rendezvous_service(run, SETTINGS))
            made["workloads"] = workloads
        return made

    # -- the trainer ------------------------------------------------------------------------
    def trainer(self, document: Document) -> dict[str, Any]:
        run = TrainingRun.model_validate(document)
        spec = run.spec
        return {
            # The trainer pod loads the model from here (kubestar train --in-cluster).
            "model": spec.model.location(),
            "algorithm": algorithm_config(spec.algorithm),
            "policy": policy_settings(spec),
            "totalSteps": total_steps(spec),
            "sft": self.sft(sft_stage(spec)),
            "stages": [self.stage(spec, stage) for stage in spec.stages],
            "evaluation": self.evaluation(spec),
            "checkpoints": self.checkpoints(run),
        }

    def problems(self, dataset: DatasetSpec) -> tuple[list[Problem], str]:
        """load_dataset, with a file path read from the stand-in volume: the problems and
        their fingerprint."""
        if dataset.path is not None:
            local = str(self.volume.problems(dataset.path))
            dataset = dataset.model_copy(update={"path": local})

        def read() -> tuple[list[Problem], str]:
            problems = load_dataset(dataset)
            return problems, fingerprint(problems)

        return self._cached(["problems", dataset.model_dump()], read)

    def stage(self, spec: TrainingRunSpec, stage: StageSpec) -> dict[str, Any]:
        """The problems the stage trains on and the rollouts it asks for, as
        TrainingSession._stage_problems, _drop_solved and _run make them."""
        problems, loaded = self.problems(stage.dataset)
        k = stage.filter.drop_solved_k_of_k if stage.filter else None
        request = training_rollouts(spec, stage, k) if k else None

        def chosen() -> dict[str, Any]:
            kept, filtered = problems, None
            if k and request:
                solved = scripted_rollouts(request)
                kept, evaluated = filter_unsolved(problems, stage, k, solved)
                result = StageFilterResult(
                    stage=stage.name, k=k, evaluated=evaluated, kept=len(kept)
                )
                check_enough_problems(stage, result)
                filtered = {"request": request, "result": result, "kept": fingerprint(kept)}
            steps = [fingerprint(step_problems(kept, stage, step)) for step in SAMPLED_STEPS]
            return {"filter": filtered, "steps": steps}

        samples = algorithm_config(spec.algorithm).rollouts_per_problem
        return {
            "loaded": loaded,
            **self._cached(["chosen", stage.model_dump(), request], chosen),
            "rollouts": training_rollouts(spec, stage, samples),
        }

    def sft(self, sft: SftSpec | None) -> dict[str, Any] | None:
        """run_sft as TrainingSession._run calls it, on a recording policy."""
        if sft is None:
            return None
        assert sft.dataset is not None, (
            "an SFT stage without sft.dataset makes its examples in a sandbox: give this test "
            "a stand-in for it"
        )
        local = str(self.volume.conversations(sft.dataset.path))
        sft = sft.model_copy(update={"dataset": sft.dataset.model_copy(update={"path": local})})
        return self._cached(["sft", sft.model_dump()], lambda: self._run_sft(sft))

    def _run_sft(self, sft: SftSpec) -> dict[str, Any]:
        policy = RecordingPolicy()
        metrics = run_sft(
            cast(Any, policy), self.model_dir, sft, "", seed=0, config=RolloutConfig()
        )
        for timing in ("seconds", "data_seconds"):
            metrics.pop(timing)
        return {"metrics": metrics, "optimizer": policy.learning_rates, "batches": policy.batches}

    def evaluation(self, spec: TrainingRunSpec) -> dict[str, Any]:
        """The held-out problems and how they are rolled out, as TrainingSession._evaluate."""
        dataset = spec.evaluation.dataset
        return {
            "problems": self.problems(dataset)[1] if dataset else None,
            "rollouts": evaluation_rollouts(spec),
        }

    def checkpoints(self, run: TrainingRun) -> dict[str, Any]:
        """Which steps are checkpointed, and what TrainingSession._checkpoint asks
        checkpoint.save to write and keep."""
        spec = run.spec
        due = [
            [
                step
                for step in CHECKPOINT_WINDOW
                if checkpoint_due(spec.checkpoint, stage, step, step)
            ]
            for stage in spec.stages
        ]
        saves: list[dict[str, Any]] = []

        def save(
            folder: Path, policy: Any, state: RunState, keep: int, weights: Path | None = None
        ) -> Path:
            saves.append({"folder": str(folder), "keep": keep, "step": state.global_step})
            return folder / "step"

        session = TrainingSession(
            run, Endpoints(scheduler="", sandbox=""), self.run_dir, self.model_dir, NoReporter()
        )
        trainer = types.SimpleNamespace(rng=random.Random(0))
        with mock.patch.object(checkpoint, "save", save):
            session._checkpoint(
                cast(Any, None), RunState(global_step=1), cast(Any, trainer), Path("w")
            )
        return {"due": due, "saves": saves}


@pytest.fixture(scope="module")
def effects(tmp_path_factory: pytest.TempPathFactory) -> Effects:
    return Effects(tmp_path_factory.mktemp("effects"))


# -- the tests ------------------------------------------------------------------------------
def cases() -> Iterator[ParameterSet]:
    for file in EXAMPLE_FILES:
        documents = load(file)
        for index, path in walk(documents):
            name = f"{file.stem}: {documents[index]['kind']} {dotted(path)}"
            yield pytest.param(file.name, index, path, id=name)


@pytest.mark.parametrize(("example", "index", "path"), list(cases()))
def test_changing_a_field_changes_what_is_made_or_done(
    example: str, index: int, path: FieldPath, effects: Effects
) -> None:
    documents = load(EXAMPLES / example)
    mutated = mutate(documents, index, path)
    before, after = effects(documents), effects(mutated)
    where = f"{example}: {documents[index]['kind']} {dotted(path)}"
    assert after != before, (
        f"{where}: changing it from {get_at(documents[index], path)!r} to "
        f"{get_at(mutated[index], path)!r} changes neither what the operator makes nor what "
        "the trainer does"
    )


# The recipes set many fields; the smoke run few, on purpose (its own fields are walked).
@pytest.mark.parametrize("example", [name for name in EXAMPLE_NAMES if name != "gpu-smoke.yaml"])
def test_the_walk_covers_every_resource_and_every_field(example: str) -> None:
    documents = load(EXAMPLES / example)
    paths = walk(documents)
    per_kind = Counter(documents[index]["kind"] for index, _ in paths)
    assert set(per_kind) == set(KINDS), per_kind
    assert min(per_kind.values()) >= 8 and len(paths) >= 60, per_kind
    # Nested fields, a list's items and a resource name with a slash are all reached.
    names = {dotted(path) for _, path in paths}
    assert {"spec.stages[0].dataset.path", "spec.algorithm.clipHigh", "spec.preload"} <= names
    assert any(name.endswith('/gpu"]') for name in names)


def test_the_paper_example_is_walked() -> None:
    assert EXAMPLES / "paper-amd.yaml" in EXAMPLE_FILES


@pytest.mark.parametrize("example", [file.name for file in EXAMPLE_FILES])
def test_the_effects_are_deterministic_and_not_empty(example: str, effects: Effects) -> None:
    """Otherwise every change would seem to have an effect."""
    documents = load(EXAMPLES / example)
    first = effects(documents)
    assert Effects(effects.volume.root.parent)._effects(copy.deepcopy(documents)) == first
    runs = [d for d in documents if d["kind"] == "TrainingRun"]
    assert len(first) == 2 * len(documents) + len(runs)  # made, shown, and the trainer's
    for document in documents:
        made = first[f"{document['kind']} {document['metadata']['name']}"]
        assert made, document["kind"]
    for run in runs:
        name = run["metadata"]["name"]
        children = first[f"TrainingRun {name}"]
        assert children["problem"] is None, children["problem"]  # runnable as installed
        assert children["workloads"], "the trainer's Jobs"
        trainer = first[f"trainer of {name}"]
        for stage in trainer["stages"]:
            assert not stage["loaded"].startswith("0:") and all(
                not step.startswith("0:") for step in stage["steps"]
            )
            if stage["filter"] is not None:  # it drops some problems, not all
                result = stage["filter"]["result"]
                assert 0 < result.kept < result.evaluated, result
        if trainer["sft"] is not None:
            assert trainer["sft"]["batches"], "SFT trained on nothing"
        if trainer["evaluation"]["problems"] is not None:
            assert not trainer["evaluation"]["problems"].startswith("0:")


@pytest.mark.parametrize("example", [file.name for file in EXAMPLE_FILES])
def test_contradicting_fields_are_refused_naming_the_field(example: str) -> None:
    run = next(d for d in load(EXAMPLES / example) if d["kind"] == "TrainingRun")
    parse_resource(run)

    # Under plain GRPO, Resample-on-Correct's own fields.
    for name, value in (("oversampleFactor", 2), ("positiveSelection", "lowest-penalty")):
        grpo = copy.deepcopy(run)
        algorithm = grpo["spec"].setdefault("algorithm", {})
        algorithm.pop("oversampleFactor", None)
        algorithm.pop("positiveSelection", None)
        algorithm["name"] = "grpo"
        parse_resource(grpo)
        algorithm[name] = value
        with pytest.raises(ManifestError, match=f"{name}: only grpo-roc"):
            parse_resource(grpo)

    # Several greedy samples: all the same.
    greedy = copy.deepcopy(run)
    greedy["spec"].setdefault("evaluation", {}).update(samples=16, temperature=0)
    with pytest.raises(ManifestError, match="samples: 16 greedy trajectories"):
        parse_resource(greedy)

    # An accelerator count other than the processes per trainer pod.
    gpus = copy.deepcopy(run)
    trainer = gpus["spec"].setdefault("trainer", {})
    processes = int(trainer.get("processesPerWorker", 1))
    limits = trainer.setdefault("resources", {}).setdefault("limits", {})
    gpu = next((name for name in limits if name.endswith("/gpu")), "nvidia.com/gpu")
    limits[gpu] = processes + 1
    with pytest.raises(ManifestError, match=re.escape(f"resources.limits[{gpu}] is")):
        parse_resource(gpus)
