"""`kubestar evolve`: one round of rStar-Math's self-evolution, end to end
(`kubestar.search.evolve`): MCTS with ground-truth values on the training problems, SFT
traces and PPM pairs from the trees, SFT of the policy, PPM training, and an evaluation of
the old and the new policy, in one folder that a rerun resumes.

Each policy is served by a vLLM engine with a scheduler in front, started as local processes
on 127.0.0.1 (as `kubestar solve` starts them) and stopped before training: on a GPU the
engine and the trainer would not fit side by side. The sandbox is one of those processes
too, or a running one (--sandbox).

The flags become one `kubestar.search.entrypoints.EvolveConfig` (the round's
`RoundSettings` and how its services start), which `kubestar.search.entrypoints.evolve`
runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from kubestar.cli.options import library_errors, local_service_settings, local_services_options
from kubestar.cli.solve import search_config, search_step_options, step_sampling_options

STAGE_NAMES = ("search", "data", "sft", "ppm", "evaluate")
# The flag of each setting a SettingError can name.
FLAGS = {
    "policy": "--policy",
    "problems": "--problems",
    "out": "--out",
    "sft.base": "--sft-base",
    "ppm.base": "--ppm-base",
    "ppm.held_out": "--ppm-held-out",
    "evaluation.problems": "--eval-problems",
    "evaluation.mode": "--eval-mode",
}


def format_round(manifest: dict[str, Any]) -> str:
    """What the command prints: each stage's figures in a line."""
    from kubestar.search.evolve import describe_stage

    lines = [f"round                 {manifest['settings']['out']}"]
    for stage in STAGE_NAMES:
        entry = manifest.get("stages", {}).get(stage)
        if entry and entry.get("done"):
            line = f"{describe_stage(stage, entry['figures'])} ({entry['seconds']:.0f} s)"
        else:
            line = "not run"
        lines.append(f"{stage:<22}{line}")
    return "\n".join(lines)


@click.command("evolve")
@click.option(
    "--policy",
    required=True,
    help="The round's policy (it searches; a model folder or a name kubestar resolves). It "
    "must already write the step format's tool calls.",
)
@click.option(
    "--problems",
    "problems_spec",
    required=True,
    help="Training problems: a .jsonl file (question, answer) or a reasoning-gym dataset name.",
)
@click.option("-n", "--limit", type=click.IntRange(min=1), default=None, help="First N only.")
@click.option("--seed", default=0, show_default=True, help="Seed of problems and training.")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="The round's folder; a round there with the same settings is resumed.",
)
@click.option(
    "--until",
    type=click.Choice(STAGE_NAMES),
    default=None,
    help="Stop after this stage (a later run goes on from there).",
)
@click.option(
    "--rollouts",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="MCTS rollouts per training problem.",
)
@search_step_options
@step_sampling_options
@click.option("--sandbox", metavar="HOST:PORT", help="A running sandbox (gRPC).")
@click.option(
    "--max-model-len",
    type=click.IntRange(min=256),
    default=4096,
    show_default=True,
    help="Context length of the local engines.",
)
@local_services_options
@click.option(
    "--sft-traces",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="SFT traces kept per problem (its top correct trajectories by Q).",
)
@click.option(
    "--sft-base",
    default="",
    help="The model the SFT starts from (default: the policy's own starting checkpoint: the "
    "base a round recorded in the policy's folder, else the policy).",
)
@click.option("--sft-epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--sft-learning-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-5,
    show_default=True,
)
@click.option(
    "--sft-batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Examples."
)
@click.option(
    "--sft-max-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Longer examples (prompt included) are left out.",
)
@click.option(
    "--ppm-base",
    default="SmolLM2-135M-Instruct",
    show_default=True,
    help="The PPM's starting model: a causal LM with the policy's tokenizer, or a PPM folder "
    "(e.g. the last round's) to train on.",
)
@click.option("--ppm-epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--ppm-learning-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=7e-6,
    show_default=True,
)
@click.option(
    "--ppm-batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="Pairs."
)
@click.option(
    "--ppm-held-out",
    type=click.FloatRange(min=0, max=0.5),
    default=0.05,
    show_default=True,
    help="Share of the pairs held out to measure pair accuracy on.",
)
@click.option(
    "--train-device",
    default="auto",
    show_default=True,
    help="Where SFT and the PPM train, and the PPM is served (auto: a GPU if any).",
)
@click.option(
    "--eval-problems",
    default="",
    help="Evaluation problems (default: held out from --problems: a file's problems after "
    "the first -n, or the generator's at --seed + 1).",
)
@click.option("--eval-n", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--eval-seed", type=int, default=None, help="Seed of generated evaluation problems.")
@click.option(
    "--eval-mode",
    type=click.Choice(["mcts", "beam", "best-of-n"]),
    default="mcts",
    show_default=True,
    help="How the new policy searches with the new PPM.",
)
@click.option("--eval-rollouts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--eval-children", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--eval-beams", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--eval-beam-samples", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--eval-samples", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print round.json.")
@click.option("--no-progress", is_flag=True, help="No progress lines or bars.")
def evolve(
    policy: str,
    problems_spec: str,
    limit: int | None,
    seed: int,
    out: str,
    until: str | None,
    format_name: str,
    rollouts: int,
    children: int,
    exploration: float,
    max_depth: int,
    max_code_errors: int,
    temperature: float,
    top_p: float,
    max_step_tokens: int,
    sampling_seed: int,
    tool_timeout: float,
    concurrency: int,
    scheduler_policy: str,
    sandbox: str | None,
    max_model_len: int,
    engine_python: str,
    device: str,
    sandbox_executors: int,
    sandbox_preload: str,
    log_dir: str,
    sft_traces: int,
    sft_base: str,
    sft_epochs: int,
    sft_learning_rate: float,
    sft_batch_size: int,
    sft_max_tokens: int,
    ppm_base: str,
    ppm_epochs: int,
    ppm_learning_rate: float,
    ppm_batch_size: int,
    ppm_held_out: float,
    train_device: str,
    eval_problems: str,
    eval_n: int,
    eval_seed: int | None,
    eval_mode: str,
    eval_rollouts: int,
    eval_children: int,
    eval_beams: int,
    eval_beam_samples: int,
    eval_samples: int,
    as_json: bool,
    no_progress: bool,
) -> None:
    """One round of self-evolution: search with ground-truth values, SFT traces and PPM
    pairs, SFT of the policy, PPM training, evaluation; a rerun resumes the round."""
    from kubestar.search.entrypoints import EvolveConfig
    from kubestar.search.entrypoints import evolve as run
    from kubestar.search.evolve import EvalSettings, PpmSettings, RoundSettings, SftSettings

    search = search_config()
    with library_errors(FLAGS.get):
        settings = RoundSettings(
            policy=policy,
            problems=problems_spec,
            out=out,
            limit=limit,
            seed=seed,
            step_format=search.step_format,
            search=search.tree(rollouts=rollouts, sft_traces=sft_traces),
            sampling=search.sampling(),
            concurrency=search.concurrency,
            max_context=max_model_len,
            sft=SftSettings(
                base=sft_base,
                epochs=sft_epochs,
                batch_size=sft_batch_size,
                learning_rate=sft_learning_rate,
                max_tokens=sft_max_tokens,
            ),
            ppm=PpmSettings(
                base=ppm_base,
                held_out=ppm_held_out,
                learning_rate=ppm_learning_rate,
                epochs=ppm_epochs,
                batch_size=ppm_batch_size,
            ),
            evaluation=EvalSettings(
                problems=eval_problems,
                limit=eval_n,
                seed=eval_seed,
                mode=eval_mode,
                rollouts=eval_rollouts,
                children=eval_children,
                beams=eval_beams,
                beam_samples=eval_beam_samples,
                samples=eval_samples,
            ),
            device=train_device,
        )
        config = EvolveConfig(
            round=settings,
            search=search,
            sandbox=sandbox or "",
            services=local_service_settings(),
            until=until,
            progress=not no_progress,
        )
        manifest = run(config)
    if as_json:
        json.dump(manifest, sys.stdout, indent=2)
        click.echo()
    else:
        click.echo(format_round(manifest))
