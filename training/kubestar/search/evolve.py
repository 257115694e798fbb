"""Self-evolution: one round of rStar-Math's loop, end to end, in one folder.

A round turns the policy's own search trees into training data and trains on it:

1. `search` (trees.jsonl): MCTS valued by the reference answers (`--ground-truth`) on the
   training problems, with the round's policy. Q then says how reliably each step leads to
   a correct answer. While the policy's engine is up, it is also evaluated greedily (the
   "old" figure of the evaluation: the same model on the same engine).
2. `data` (sft.jsonl, pairs.jsonl): per tree the top correct trajectories by Q
   (`data.sft_traces`) become SFT examples, and the step-level preference pairs
   (`data.ppm_pairs`) a pair file for the PPM. An SFT example is the trajectory in the token
   form the policy was prompted with while searching (`trace_example`): the root's prompt
   ids and every observation (the tool's output, encoded as the search encoded it for the
   next prompt) with loss mask 0, the policy's own step ids, as sampled, with loss mask 1.
   Nothing the policy wrote is re-tokenised: a text round trip can change ids (merges,
   whitespace) and the policy would be taught a sequence it never produced.
3. `sft` (policy/): the policy is fine-tuned on the examples with kubestar's SFT loop
   (`kubestar.training.sft.train_sft`: masked cross-entropy, the same `Policy` and batches
   as the SFT stage of a TrainingRun), and written as a model folder an engine serves.
4. `ppm` (ppm/): a process preference model is trained on the pairs with the Bradley-Terry
   loss (`kubestar.search.ppm.train_ppm`), a share of the pairs held out to measure pair
   accuracy.
5. `evaluate` (eval.json): on problems the round did not train on, the accuracy of the old
   and the new policy decoding greedily, and of the new policy searching with the new PPM
   (MCTS, beam search or best-of-N at a small budget).

Which model the SFT starts from: rStar-Math fine-tunes the same base model every round on
the newest round's data, rather than the previous round's policy, so that errors learnt in
one round are not compounded in the next. Its base is a pretrained model that is taught the
step format by the first round's data. Here the policy must already write tool calls for
the search to find anything, so the base is the checkpoint that does: by default the round's
search policy's own starting checkpoint. A policy written by a round records the model its
SFT started from (`kubestar-evolve.json` in the policy folder), and the next round starts
from that model again; any other policy is its own starting checkpoint. `SftSettings.base`
names another one.

The folder: `round.json` (the settings, the models, and per stage whether it is done, when,
how long it took and its figures), then each stage's output. A stage is done once its output
is complete and round.json says so; running the round again skips the done stages, so an
interrupted round resumes at the stage it was in; an interrupted search keeps the trees it
found (`PARTIAL_TREES`) and searches only the other problems. A stage that runs again makes
the later stages run again too (their inputs changed). A folder made with other settings is refused:
its outputs would not be what the settings say.

The services (an engine serving a policy, the scheduler, the sandbox, the PPM) are the
caller's (`Services`): `kubestar evolve` starts them as local processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from kubestar.api.errors import KubestarError, SettingError
from kubestar.engine.models import tokenizer_sha256
from kubestar.search.adapters import StepSampling
from kubestar.search.data import SftTrace, is_correct, ppm_pairs, sft_traces
from kubestar.search.ppm_data import Encode, pair_record
from kubestar.search.solve import (
    BEAM,
    BEST_OF_N,
    GREEDY,
    MCTS_MODE,
    Solved,
    SolveSettings,
    summary,
    write_trees,
)
from kubestar.search.tree import Node, SearchSettings, answer_terminals, tree_from_records
from kubestar.training.datasets import Problem
from kubestar.training.sft_data import SftExample

FORMAT = "kubestar-evolve/1"
STAGES = ("search", "data", "sft", "ppm", "evaluate")
MANIFEST = "round.json"
TREES = "trees.jsonl"
# The trees found so far while the search stage runs; what a resumed search skips.
PARTIAL_TREES = "trees.partial.jsonl"
SFT_DATA = "sft.jsonl"
PAIRS = "pairs.jsonl"
POLICY = "policy"
PPM = "ppm"
EVALUATION = "eval.json"
# In a policy folder a round wrote: the model its SFT started from (the next round's base).
LINEAGE = "kubestar-evolve.json"
OUTPUTS: dict[str, tuple[str, ...]] = {
    "search": (TREES,),
    "data": (SFT_DATA, PAIRS),
    "sft": (POLICY,),
    "ppm": (PPM,),
    "evaluate": (EVALUATION,),
}
# The evaluation's figures: the old policy greedy, the new one greedy, the new one searching.
OLD_GREEDY, NEW_GREEDY, NEW_SEARCH = "old_greedy", "new_greedy", "new_search"
EVAL_MODES = (MCTS_MODE, BEAM, BEST_OF_N)
# Settings that change how fast a round runs, not what it makes: a resumed round may differ.
FREE_SETTINGS = frozenset({"out", "concurrency", "device"})
# Seeds of generated evaluation problems lie this far from the training problems' seed.
EVAL_SEED_OFFSET = 1
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class SolveFunction(Protocol):
    def __call__(
        self,
        problems: Sequence[Problem],
        settings: SolveSettings,
        ppm: str,
        on_done: Callable[[Solved], None] | None = None,
    ) -> list[Solved]:
        """One outcome per problem, in the problems' order; `ppm` is a PPM folder or "".
        `on_done` receives each outcome as soon as it is found."""
        ...


Progress = Callable[[str], None]


class RoundError(KubestarError, RuntimeError):
    """A stage cannot make its output; the message says why and what to change."""


class Services(Protocol):
    def serving(self, policy: Path) -> AbstractContextManager[SolveFunction]:
        """An engine serving `policy`, with the scheduler and the sandbox, for as long as
        the block runs; the function solves problems on them (with the PPM folder it is
        given served too)."""
        ...


@dataclass(frozen=True)
class SftSettings:
    """The policy's fine-tuning. The learning rate and batch size are those of kubestar's
    SFT stage; 2 epochs, as rStar-Math trains its policy on each round's data."""

    base: str = ""  # "": the search policy's starting checkpoint (see the module docstring)
    epochs: int = 2
    batch_size: int = 8
    micro_batch_size: int = 4
    learning_rate: float = 1e-5
    max_tokens: int = 4096  # a longer example (prompt included) is left out

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "micro_batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise SettingError(f"sft.{name}", f"sft.{name} must be at least 1")
        if not self.learning_rate > 0:
            raise SettingError("sft.learning_rate", "sft.learning_rate must be above 0")


@dataclass(frozen=True)
class PpmSettings:
    """The PPM's training: its starting model and the share of pairs held out."""

    base: str = "SmolLM2-135M-Instruct"  # a causal LM, or a PPM folder to train on
    held_out: float = 0.05
    learning_rate: float = 7e-6
    epochs: int = 2
    batch_size: int = 16
    micro_batch_size: int = 4
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        if not 0 <= self.held_out <= 0.5:
            raise SettingError("ppm.held_out", "ppm.held_out must lie in [0, 0.5]")


@dataclass(frozen=True)
class EvalSettings:
    """The evaluation: which problems, and the search of the new policy with the new PPM.
    Problems "" are held out from the round's own source: a file's problems after the
    round's first `limit`, or a generator's at another seed; never a question the round
    trained on."""

    problems: str = ""
    limit: int = 50
    seed: int | None = None  # of a generator (None: the round's seed + 1)
    mode: str = MCTS_MODE
    rollouts: int = 4  # mcts
    children: int = 4  # mcts
    beams: int = 2  # beam: B1
    beam_samples: int = 4  # beam: B2
    samples: int = 4  # best-of-n
    top_k: int = 4  # mcts, beam: answers voted over

    def __post_init__(self) -> None:
        if self.mode not in EVAL_MODES:
            raise SettingError(
                "evaluation.mode",
                f"evaluation mode {self.mode!r}: choose one of {', '.join(EVAL_MODES)}",
            )
        for name in ("limit", "rollouts", "children", "beams", "beam_samples", "samples"):
            if getattr(self, name) < 1:
                raise SettingError(f"evaluation.{name}", f"evaluation.{name} must be at least 1")


@dataclass(frozen=True)
class RoundSettings:
    """Everything a round does, in one place (round.json keeps it)."""

    policy: str  # the round's search policy: a model folder or a name kubestar resolves
    problems: str  # a problem file or a reasoning-gym generator (`load_problems`)
    out: str  # the round's folder
    limit: int | None = None  # the first N problems (a generator makes 100 without it)
    seed: int = 0  # of generated problems, of SFT's and the PPM's order and initialisation
    step_format: str = "tool-call"  # the step format (`kubestar solve --format`)
    search: SearchSettings = field(default_factory=SearchSettings)
    sampling: StepSampling = field(default_factory=StepSampling)
    concurrency: int = 4  # problems searched at once
    max_context: int = 0  # the engines' context length (0: unknown)
    sft: SftSettings = field(default_factory=SftSettings)
    ppm: PpmSettings = field(default_factory=PpmSettings)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    device: str = "auto"  # where SFT and the PPM train

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON keeps them (tuples as lists)."""
        data: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        return data


@dataclass(frozen=True)
class Models:
    """The round's models, resolved to folders."""

    policy: Path
    sft_base: Path
    ppm_base: Path


def _resolve(name: str, setting: str) -> Path:
    from kubestar.engine.models import resolve_model

    try:
        # Absolute: round.json and a policy's lineage are read from other folders later.
        return resolve_model(name).absolute()
    except (FileNotFoundError, RuntimeError, ImportError, ValueError) as error:
        raise SettingError(setting, str(error)) from None


def starting_checkpoint(policy: Path) -> Path:
    """The model a policy's SFT started from: what a round recorded in the policy folder
    it wrote (when that model is still there), else the policy itself."""
    lineage = policy / LINEAGE
    with contextlib.suppress(OSError, ValueError, AttributeError):
        base = Path(str(json.loads(lineage.read_text())["base"]))
        if base.is_absolute() and (base / "config.json").exists():
            return base
    return policy


def resolve_models(settings: RoundSettings) -> Models:
    """The policy, the SFT's starting model and the PPM's, as folders; each must read token
    ids with the policy's tokenizer (the trees hold the policy's ids)."""
    policy = _resolve(settings.policy, "policy")
    sft_base = (
        _resolve(settings.sft.base, "sft.base")
        if settings.sft.base
        else starting_checkpoint(policy)
    )
    ppm_base = _resolve(settings.ppm.base, "ppm.base")
    reference = tokenizer_sha256(policy)
    for setting, folder in (("sft.base", sft_base), ("ppm.base", ppm_base)):
        if tokenizer_sha256(folder) != reference:
            raise SettingError(
                setting,
                f"{folder} has another tokenizer than the policy {policy}: it would read the "
                "policy's token ids as other text; give a model with the policy's tokenizer",
            )
    return Models(policy, sft_base, ppm_base)


def _is_file(spec: str) -> bool:
    path = Path(spec)
    return path.suffix in FILE_SUFFIXES or path.exists()


def load_round_problems(settings: RoundSettings) -> tuple[list[Problem], list[Problem]]:
    """The training problems and the evaluation problems (see `EvalSettings`)."""
    from kubestar.training.datasets import load_problems

    ev = settings.evaluation
    try:
        problems = load_problems(settings.problems, limit=settings.limit, seed=settings.seed)
    except (ValueError, FileNotFoundError) as error:
        raise SettingError("problems", str(error)) from None
    if not problems:
        raise SettingError("problems", f"{settings.problems}: no problems")
    spec = ev.problems or settings.problems
    try:
        if _is_file(spec):
            candidates = load_problems(spec, limit=None)
            if not ev.problems:
                candidates = candidates[len(problems) :]
        else:
            seed = ev.seed if ev.seed is not None else settings.seed + EVAL_SEED_OFFSET
            candidates = load_problems(spec, limit=ev.limit + len(problems), seed=seed)
    except (ValueError, FileNotFoundError) as error:
        raise SettingError("evaluation.problems", str(error)) from None
    trained = {problem.question for problem in problems}
    held_out = [problem for problem in candidates if problem.question not in trained]
    if not held_out:
        raise SettingError(
            "evaluation.problems",
            f"{spec}: no evaluation problems the round does not train on (a file's problems "
            "after the first `limit` are held out): give fewer training problems or "
            "evaluation problems of their own",
        )
    return problems, held_out[: ev.limit]


# -- the data --------------------------------------------------------------------------------
def trace_example(
    trace: SftTrace,
    root: Node,
    encode: Encode,
    *,
    example_id: str,
    question: str,
    answer: str,
    family: str = "search",
) -> SftExample:
    """A trace as an SFT example in the policy's own token ids (see the module docstring):
    prompt = the root's ids; response = each step's ids (mask 1), then its encoded
    observation (mask 0). prompt + response is the node sequence the search prompted the
    policy with (`ppm_data.path_token_ids` of the answer). A node without token ids (a tree
    made from text) is refused rather than tokenised."""
    if not root.token_ids:
        raise ValueError(f"{example_id}: the root holds no prompt token ids")
    response: list[int] = []
    mask: list[int] = []
    codes: list[str] = []
    outputs: list[str] = []
    statuses: list[str] = []
    for step in trace.steps:
        if not step.token_ids:
            raise ValueError(
                f"{example_id}: node {step.id} holds no token ids (SFT examples are built "
                "from the policy's ids, never from re-tokenised text)"
            )
        response.extend(step.token_ids)
        mask.extend([1] * len(step.token_ids))
        if step.observation:
            observed = encode(step.observation)
            response.extend(observed)
            mask.extend([0] * len(observed))
        if step.code:
            codes.append(step.code)
            outputs.append(step.observation)
            statuses.append("error" if step.code_failed else "ok")
    return SftExample(
        id=example_id,
        family=family,
        question=question,
        answer=answer,
        prompt_ids=list(root.token_ids),
        response_ids=response,
        response_mask=mask,
        prompt_text=root.text,
        assistant_turns=[step.text for step in trace.steps],
        tool_codes=codes,
        tool_responses=outputs,
        tool_statuses=statuses,
        fixes_error=any(step.code_failed for step in trace.steps),
        metadata={
            "nodes": [step.id for step in trace.steps],
            "q_values": trace.q_values,
            "mean_q": trace.mean_q,
        },
    )


def read_trees(path: Path) -> list[tuple[dict[str, Any], Node]]:
    """Each line of a trees file (`solve.write_trees`) and its tree."""
    trees = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            trees.append((record, tree_from_records(record["nodes"])))
        except (ValueError, KeyError, TypeError) as error:
            raise RoundError(f"{path}:{number}: not a tree of `kubestar solve`: {error}") from None
    return trees


def read_sft_examples(path: Path) -> list[SftExample]:
    """The examples of an sft.jsonl (`SftExample.to_dict` per line)."""
    return [SftExample(**json.loads(line)) for line in path.read_text().splitlines() if line]


def _write_atomic(path: Path, text: str) -> None:
    """A file that appears whole or not at all (a crash leaves the old one or none)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _jsonl(records: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


# -- the round -------------------------------------------------------------------------------
class Round:
    """One round in `settings.out` (see the module docstring). `progress` receives a line
    per stage (and a few during training)."""

    def __init__(
        self, settings: RoundSettings, services: Services, progress: Progress | None = None
    ) -> None:
        self.settings = settings
        self.services = services
        self.progress = progress or (lambda line: None)
        self.folder = Path(settings.out)
        self.manifest: dict[str, Any] = {}
        self.models: Models | None = None
        self.problems: list[Problem] = []
        self.eval_problems: list[Problem] = []
        self._started = time.monotonic()

    # -- bookkeeping
    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def _open(self) -> None:
        """Resolve the models and problems, and read or start round.json."""
        settings = self.settings
        self.models = resolve_models(settings)
        self.problems, self.eval_problems = load_round_problems(settings)
        current = settings.as_dict()
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_text())
                earlier = manifest["settings"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise SettingError(
                    "out", f"{self.manifest_path}: not a round's manifest ({error})"
                ) from None
            changed = _differences(earlier, current)
            if changed:
                more = f"; and {len(changed) - 4} more" if len(changed) > 4 else ""
                raise SettingError(
                    "out",
                    f"{self.manifest_path}: the round there was made with other settings "
                    f"({'; '.join(changed[:4])}{more}): give the same settings to resume "
                    "it, or another folder",
                )
            self.manifest = manifest
            self.manifest["settings"] = current  # the free settings of this run
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.manifest = {"format": FORMAT, "settings": current, "stages": {}}
        models = self.models
        self.manifest["models"] = {
            "policy": str(models.policy),
            "sft_base": str(models.sft_base),
            "ppm_base": str(models.ppm_base),
        }
        self.manifest["problems"] = {
            "training": len(self.problems),
            "evaluation": len(self.eval_problems),
        }
        self._save()

    def _save(self) -> None:
        _write_atomic(self.manifest_path, json.dumps(self.manifest, indent=2) + "\n")

    def done(self, stage: str) -> bool:
        """Marked done in round.json, and its outputs are all there."""
        entry = self.manifest.get("stages", {}).get(stage) or {}
        return bool(entry.get("done")) and all(
            (self.folder / name).exists() for name in OUTPUTS[stage]
        )

    def _invalidate_from(self, stage: str) -> None:
        """`stage` runs: it and every later stage are no longer done. The new policy's
        evaluation goes with them; the old policy's does not depend on them."""
        stages = self.manifest.setdefault("stages", {})
        for later in STAGES[STAGES.index(stage) :]:
            stages.pop(later, None)
        evaluation = self._evaluation()
        parts = evaluation.get("parts", {})
        if stage != "evaluate" and {NEW_GREEDY, NEW_SEARCH} & set(parts):
            parts.pop(NEW_GREEDY, None)
            parts.pop(NEW_SEARCH, None)
            self._save_evaluation(evaluation)
        self._save()

    def run(self, until: str | None = None) -> dict[str, Any]:
        """Run the stages not done yet, up to and including `until` (default: all);
        returns round.json's content."""
        if until is not None and until not in STAGES:
            raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
        self._open()
        for index, stage in enumerate(STAGES, start=1):
            where = f"[{index}/{len(STAGES)}] {stage}"
            if self.done(stage):
                self.progress(f"{where}: done, skipped ({self._outputs(stage)})")
            else:
                self._invalidate_from(stage)
                self.progress(f"{where}: running")
                self._started = time.monotonic()
                figures = getattr(self, f"_{stage}")()
                self._mark_done(stage, figures)
                self.progress(f"{where}: {describe_stage(stage, figures)}")
            if stage == until:
                break
        return self.manifest

    def _mark_done(self, stage: str, figures: dict[str, Any]) -> None:
        self.manifest["stages"][stage] = {
            "done": True,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.monotonic() - self._started, 1),
            "figures": figures,
        }
        self._save()

    def _outputs(self, stage: str) -> str:
        return ", ".join(str(self.folder / name) for name in OUTPUTS[stage])

    def _solve_settings(self, mode: str, **changes: Any) -> SolveSettings:
        s = self.settings
        return SolveSettings(
            mode=mode,
            search=replace(s.search, **changes),
            sampling=s.sampling,
            concurrency=s.concurrency,
            max_context=s.max_context,
            ground_truth=False,
        )

    # -- the stages
    def _search(self) -> dict[str, Any]:
        assert self.models is not None
        settings = replace(self._solve_settings(MCTS_MODE), ground_truth=True)
        partial = self.folder / PARTIAL_TREES
        found = self._partial_trees(partial)
        remaining = [problem for problem in self.problems if problem.id not in found]
        if found:
            self.progress(
                f"  {len(found)} trees kept from the interrupted search ({partial}); "
                f"searching the other {len(remaining)} problems"
            )
        with self.services.serving(self.models.policy) as solve:
            with partial.open("a") as out:

                def keep(solved: Solved) -> None:
                    out.write(json.dumps(solved.record()) + "\n")
                    out.flush()
                    found[solved.problem.id] = solved

                solve(remaining, settings, "", keep)
            solved = [found[problem.id] for problem in self.problems]
            tmp = self.folder / f"{TREES}.tmp-{os.getpid()}"
            write_trees(tmp, solved)
            tmp.replace(self.folder / TREES)
            partial.unlink()
            figures = summary(solved)
            figures["solved_by_search"] = sum(
                any(is_correct(node, s.problem.answer) for node in answer_terminals(s.root))
                for s in solved
            )
            # The trees are whole: a failure from here on does not search again.
            self._mark_done("search", figures)
            if OLD_GREEDY not in self._evaluation()["parts"]:
                self.progress("  evaluating the search policy greedily while its engine is up")
                self._evaluate_part(solve, OLD_GREEDY, self.models.policy, GREEDY)
        return figures

    def _partial_trees(self, path: Path) -> dict[str, Solved]:
        """The round's problems already searched before an interruption, read from `path`,
        which is rewritten to hold just them: a line cut short by the interruption (or any
        line that is not one of the round's trees) is dropped and its problem searched again."""
        problems = {problem.id: problem for problem in self.problems}
        found: dict[str, Solved] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    found[record["problem"]] = Solved.from_record(
                        record, problems[record["problem"]]
                    )
                except (ValueError, KeyError, TypeError):
                    continue
        _write_atomic(path, _jsonl([solved.record() for solved in found.values()]))
        return found

    def _data(self) -> dict[str, Any]:
        from kubestar.training.chat import ChatTokenizer

        assert self.models is not None
        encode = ChatTokenizer.from_model(self.models.policy).encode
        s = self.settings
        examples: list[SftExample] = []
        pairs: list[dict[str, Any]] = []
        too_long = with_traces = with_pairs = 0
        trees = read_trees(self.folder / TREES)
        for record, root in trees:
            reference = str(record["reference"])
            traces = sft_traces(root, reference, s.search)
            with_traces += bool(traces)
            for trace in traces:
                example = trace_example(
                    trace,
                    root,
                    encode,
                    example_id=f"{record['problem']}/{trace.steps[-1].id}",
                    question=str(record.get("question", "")),
                    answer=reference,
                )
                if example.tokens > s.sft.max_tokens:
                    too_long += 1
                else:
                    examples.append(example)
            found = ppm_pairs(root, reference, s.search)
            with_pairs += bool(found)
            pairs.extend(pair_record(pair, encode) for pair in found)
        _write_atomic(self.folder / SFT_DATA, _jsonl([e.to_dict() for e in examples]))
        _write_atomic(self.folder / PAIRS, _jsonl(pairs))
        return {
            "trees": len(trees),
            "problems_with_traces": with_traces,
            "traces": len(examples) + too_long,
            "sft_examples": len(examples),
            "sft_too_long": too_long,
            "sft_trained_tokens": sum(e.trained_tokens for e in examples),
            "problems_with_pairs": with_pairs,
            "pairs": len(pairs),
        }

    def _sft(self) -> dict[str, Any]:
        assert self.models is not None
        s = self.settings
        examples = read_sft_examples(self.folder / SFT_DATA)
        if not examples:
            raise RoundError(
                f"{self.folder / SFT_DATA}: no SFT examples: the search found no correct "
                "answer (or every trace was too long): search more (rollouts, children), "
                "or give problems the policy can sometimes solve"
            )
        from kubestar.training.policy import OptimizerConfig, Policy
        from kubestar.training.sft import train_sft

        policy = Policy(
            self.models.sft_base,
            OptimizerConfig(learning_rate=s.sft.learning_rate),
            device=s.device,
            micro_batch_size=s.sft.micro_batch_size,
            seed=s.seed,
        )
        report = _every_tenth(self.progress, "sft")
        metrics = train_sft(
            policy,
            examples,
            epochs=s.sft.epochs,
            batch_size=s.sft.batch_size,
            learning_rate=s.sft.learning_rate,
            seed=s.seed,
            progress=lambda _stage, step, total, values: report(step, total, values["loss"]),
        )
        target = self.folder / POLICY
        policy.save_weights(target)
        lineage = {"base": str(self.models.sft_base), "round": str(self.folder.resolve())}
        _write_atomic(target / LINEAGE, json.dumps(lineage, indent=2) + "\n")
        del policy
        _free_accelerator()
        return {"examples": len(examples), "base": str(self.models.sft_base), **metrics}

    def _ppm(self) -> dict[str, Any]:
        from kubestar.search.ppm import PpmTrainSettings, train_ppm_folder
        from kubestar.search.ppm_data import PairFileError, read_pairs
        from kubestar.training.chat import ChatTokenizer

        assert self.models is not None
        s = self.settings
        pairs_file = self.folder / PAIRS
        try:
            examples = read_pairs(pairs_file, ChatTokenizer.from_model(self.models.policy).encode)
        except PairFileError as error:
            raise RoundError(
                f"{error}: no tree had both a correct and a wrong answer under one step: "
                "search more problems, or with more rollouts"
            ) from None
        settings = PpmTrainSettings(
            learning_rate=s.ppm.learning_rate,
            epochs=s.ppm.epochs,
            batch_size=s.ppm.batch_size,
            micro_batch_size=s.ppm.micro_batch_size,
            max_tokens=s.ppm.max_tokens,
            seed=s.seed,
        )
        report = _every_tenth(self.progress, "ppm")
        figures = train_ppm_folder(
            self.models.ppm_base,
            examples,
            self.folder / PPM,
            settings,
            held_out=s.ppm.held_out,
            device=s.device,
            pairs_file=pairs_file,
            progress=lambda _epoch, step, total, loss: report(step, total, loss),
        )
        _free_accelerator()
        return {"base": str(self.models.ppm_base), **figures}

    def _evaluate(self) -> dict[str, Any]:
        assert self.models is not None
        parts = self._evaluation().get("parts", {})
        if OLD_GREEDY not in parts:
            with self.services.serving(self.models.policy) as solve:
                self._evaluate_part(solve, OLD_GREEDY, self.models.policy, GREEDY)
        policy, ppm = self.folder / POLICY, self.folder / PPM
        if NEW_GREEDY not in parts or NEW_SEARCH not in parts:
            with self.services.serving(policy) as solve:
                self._evaluate_part(solve, NEW_GREEDY, policy, GREEDY)
                self._evaluate_part(solve, NEW_SEARCH, policy, self.settings.evaluation.mode, ppm)
        parts = self._evaluation()["parts"]
        return {
            "problems": len(self.eval_problems),
            "mode": self.settings.evaluation.mode,
            **{f"{name}_accuracy": parts[name]["accuracy"] for name in parts},
            **{
                f"{name}_tokens_per_problem": parts[name]["generated_tokens_per_problem"]
                for name in parts
            },
        }

    # -- the evaluation's parts
    def _evaluation(self) -> dict[str, Any]:
        path = self.folder / EVALUATION
        if not path.exists():
            return {"parts": {}}
        evaluation: dict[str, Any] = json.loads(path.read_text())
        evaluation.setdefault("parts", {})
        return evaluation

    def _save_evaluation(self, evaluation: dict[str, Any]) -> None:
        evaluation["problems"] = [problem.id for problem in self.eval_problems]
        evaluation["settings"] = asdict(self.settings.evaluation)
        _write_atomic(self.folder / EVALUATION, json.dumps(evaluation, indent=2) + "\n")

    def _evaluate_part(
        self, solve: SolveFunction, name: str, model: Path, mode: str, ppm: Path | None = None
    ) -> None:
        ev = self.settings.evaluation
        settings = (
            self._solve_settings(GREEDY)
            if mode == GREEDY
            else replace(
                self._solve_settings(
                    mode,
                    rollouts=ev.rollouts,
                    children=ev.children,
                    beam_width=ev.beams,
                    beam_samples=ev.beam_samples,
                    top_k=ev.top_k,
                ),
                samples=ev.samples,
            )
        )
        solved = solve(self.eval_problems, settings, str(ppm) if ppm else "")
        evaluation = self._evaluation()
        evaluation["parts"][name] = {
            "model": str(model),
            "ppm": str(ppm) if ppm else None,
            **summary(solved),
            "mode": mode,
        }
        self._save_evaluation(evaluation)


def _differences(earlier: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """`name: earlier -> now` for each setting that differs (nested ones dotted), the free
    settings aside."""
    changed = []
    for key in sorted(set(earlier) | set(current)):
        name = f"{prefix}{key}"
        if name in FREE_SETTINGS:
            continue
        old, new = earlier.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed.extend(_differences(old, new, f"{name}."))
        elif old != new:
            changed.append(f"{name} {old!r} there, {new!r} now")
    return changed


def _every_tenth(progress: Progress, what: str) -> Callable[[int, int, float], None]:
    """A progress callback that reports about ten times per training."""

    def report(step: int, total: int, loss: float) -> None:
        if step == total or step % max(1, math.ceil(total / 10)) == 0:
            progress(f"  {what} step {step}/{total}: loss {loss:.4f}")

    return report


def _free_accelerator() -> None:
    """Give a GPU's cached memory back between stages (the next one may be an engine)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _accuracy(figures: dict[str, Any], key: str) -> str:
    value = figures.get(key)
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def describe_stage(stage: str, f: dict[str, Any]) -> str:
    """A stage's figures in one line."""
    if stage == "search":
        return (
            f"{f['problems']} problems searched, {f['solved_by_search']} solved by search "
            f"(a correct answer in the tree), {f['generated_tokens_per_problem']:.0f} tokens "
            "per problem"
        )
    if stage == "data":
        return (
            f"{f['sft_examples']} SFT examples from {f['problems_with_traces']} problems "
            f"({f['sft_too_long']} too long), {f['pairs']} PPM pairs from "
            f"{f['problems_with_pairs']} problems"
        )
    if stage == "sft":
        return (
            f"{f['examples']} examples, {f['steps']:.0f} steps, loss {f['initial_loss']:.4f} "
            f"-> {f['loss']:.4f}"
        )
    if stage == "ppm":
        held = f.get("held_out_accuracy")
        accuracy = f"{held:.3f}" if held is not None else "- (no pairs held out)"
        return (
            f"{f['pairs']} pairs, train pair accuracy {f['train_accuracy']:.3f}, held-out "
            f"pair accuracy {accuracy} on {f['held_out_pairs']} pairs"
        )
    return (
        f"{f['problems']} problems: greedy {_accuracy(f, OLD_GREEDY + '_accuracy')} -> "
        f"{_accuracy(f, NEW_GREEDY + '_accuracy')}, {f['mode']} with the PPM "
        f"{_accuracy(f, NEW_SEARCH + '_accuracy')}"
    )
