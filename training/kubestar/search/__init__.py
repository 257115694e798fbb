"""Test-time search as rStar-Math does it: MCTS and step-level beam search over code-augmented
reasoning steps, valued by ground truth or a process preference model, and the SFT traces and
PPM preference pairs built from finished trees."""

from kubestar.search.data import PpmPair, SftTrace, edit_distance, ppm_pairs, sft_traces
from kubestar.search.mcts import (
    MCTS,
    Execution,
    Executor,
    GroundTruth,
    Policy,
    Proposal,
    Scorer,
    SearchResult,
    beam_search,
    expand,
)
from kubestar.search.steps import (
    ParsedStep,
    RStarFormat,
    StepFormat,
    StepKind,
    ToolCallFormat,
    replay,
)
from kubestar.search.tree import (
    Node,
    SearchSettings,
    Terminal,
    backpropagate,
    select,
    selection_score,
    vote,
)

__all__ = [
    "MCTS",
    "Execution",
    "Executor",
    "GroundTruth",
    "Node",
    "ParsedStep",
    "Policy",
    "PpmPair",
    "Proposal",
    "RStarFormat",
    "Scorer",
    "SearchResult",
    "SearchSettings",
    "SftTrace",
    "StepFormat",
    "StepKind",
    "Terminal",
    "ToolCallFormat",
    "backpropagate",
    "beam_search",
    "edit_distance",
    "expand",
    "ppm_pairs",
    "replay",
    "select",
    "selection_score",
    "sft_traces",
    "vote",
]
