"""Test-time search at a run's evaluation points (spec.evaluation.search): the trainer's
`SearchEvaluator` (`kubestar.training.workers`), given to `TrainingSession` by whoever starts
the run (the trainer cannot import the search, which builds on it).

Beside the greedy agent-loop evaluation, the same held-out problems are solved by
`kubestar.search.solve.Solver` in the mode the spec asks for, on the run's own services: its
Generate requests go to the run's rollout scheduler (the engines serve the weights just
pushed, so the search measures the policy as it is now), each expansion's programs to the
run's sandbox under the pool's per-call limits, and a PPM folder is served inside the process
that searches, for as long as the evaluation lasts (it holds no memory between points).

A search path may take as many tokens after its prompt as a greedy trajectory (the largest
stage's maxResponseTokens): the engines' context was sized for that, and the accuracies are
then read at a known budget, with the tokens each actually generated beside them.

The figures go into the evaluation's metrics entry under `search_*` keys
(`search_figures`), next to the greedy ones; every tree is kept as JSON lines
(`kubestar.search.solve.Solved.record`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubestar.api.errors import KubestarError
from kubestar.api.v1alpha1 import CallLimitsSpec, SearchEvaluationSpec
from kubestar.engine.models import tokenizer_sha256
from kubestar.search.adapters import ExecuteBatch, Generate, SandboxExecutor, StepSampling
from kubestar.search.ppm_data import Encode
from kubestar.search.scorer import PpmSource, ppm_scorer
from kubestar.search.solve import Judge, Solver, SolveSettings, summary
from kubestar.search.steps import step_format
from kubestar.search.tree import SearchSettings
from kubestar.training.datasets import Problem

# A step's new tokens at the most (`kubestar solve --max-step-tokens`'s default), within the
# path's budget.
MAX_STEP_TOKENS = 512
# The figures of `kubestar.search.solve.summary` an evaluation keeps, as `search_<key>`.
KEPT_FIGURES = (
    "problems",
    "accuracy",
    "answered",
    "generated_tokens_per_problem",
    "requests_per_problem",
    "nodes_per_problem",
)


class PpmUnusable(KubestarError, ValueError):
    """spec.evaluation.search.ppm cannot serve this run's search; the message says why."""


def check_ppm(spec: SearchEvaluationSpec, model_dir: Path) -> None:
    """Refuse, before any training, a PPM the first evaluation could not use: a missing
    folder, or one whose tokenizer reads token ids unlike the policy's (the PPM scores the
    policy's ids). Hours of training are not spent to find that out at the end."""
    if spec.ppm is None:
        return
    folder = Path(spec.ppm)
    if not folder.is_dir():
        raise PpmUnusable(
            f"spec.evaluation.search.ppm: {folder} is not a folder the trainer can read "
            "(a PPM folder from `kubestar ppm train --out`)"
        )
    theirs, ours = tokenizer_sha256(folder), tokenizer_sha256(model_dir)
    if theirs and ours and theirs != ours:
        raise PpmUnusable(
            f"spec.evaluation.search.ppm: {folder} reads token ids with another tokenizer "
            f"than the policy's ({model_dir}): train the PPM from the policy's model "
            "(`kubestar ppm train --model`)"
        )


def solve_settings(
    spec: SearchEvaluationSpec, max_response_tokens: int, max_context: int
) -> SolveSettings:
    """The Solver's settings from the spec. `max_context`: the longest prompt's tokens plus
    `max_response_tokens`, so that no path outgrows what the greedy evaluation may use."""
    return SolveSettings(
        mode=spec.mode,
        search=SearchSettings(
            rollouts=spec.budget("rollouts"),
            children=spec.budget("children"),
            beam_width=spec.budget("beams"),
            beam_samples=spec.budget("beam_samples"),
        ),
        sampling=StepSampling(
            temperature=spec.temperature,
            max_step_tokens=min(MAX_STEP_TOKENS, max_response_tokens),
            seed=spec.seed,
        ),
        samples=spec.budget("samples"),
        max_context=max_context,
    )


def search_figures(mode: str, figures: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The search's figures as an evaluation's metrics entry holds them: `search_mode`,
    `search_accuracy`, `search_generated_tokens_per_problem`, `search_seconds`, ..."""
    kept: dict[str, Any] = {"search_mode": mode}
    kept.update({f"search_{key}": figures[key] for key in KEPT_FIGURES})
    kept["search_seconds"] = round(seconds, 3)
    return kept


async def search_problems(
    *,
    scheduler: Generate,
    sandbox: ExecuteBatch,
    model_dir: Path,
    encode: Encode,
    problems: Sequence[Problem],
    spec: SearchEvaluationSpec,
    max_response_tokens: int,
    judge: Judge,
    call_limits: CallLimitsSpec | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Solve `problems` as the spec asks (see the module docstring); returns the figures
    (`search_figures`) and every problem's tree record."""
    started = time.monotonic()
    limits = call_limits or CallLimitsSpec()
    fmt = step_format(spec.format)
    longest = max((len(encode(fmt.prompt(p.question))) for p in problems), default=0)
    settings = solve_settings(spec, max_response_tokens, longest + max_response_tokens)
    executor = SandboxExecutor(
        sandbox,
        timeout_seconds=limits.timeout_seconds,
        memory_bytes=limits.memory_mib * 1024 * 1024,
    )
    source = PpmSource(folder=spec.ppm or "", tokenizer_sha256=tokenizer_sha256(model_dir))
    async with ppm_scorer(source, encode) as scorer:
        solver = Solver(scheduler, executor, fmt, encode, settings, judge, scorer)
        solved = await solver.solve_all(list(problems))
    figures = search_figures(spec.mode, summary(solved), time.monotonic() - started)
    return figures, [outcome.record() for outcome in solved]


class SearchEvaluation:
    """The trainer's `SearchEvaluator` (kubestar.training.workers): `check_ppm` before
    training, `search_problems` at each evaluation point."""

    check = staticmethod(check_ppm)
    solve = staticmethod(search_problems)
