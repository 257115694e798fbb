"""Test-time search as rStar-Math does it: MCTS and step-level beam search over code-augmented
reasoning steps, valued by ground truth or a process preference model, the baselines it is
measured against, and the SFT traces and PPM preference pairs built from finished trees. The
search on kubestar's services (scheduler, sandbox): `kubestar.search.adapters` and
`kubestar.search.solve`."""

from kubestar.search.baselines import (
    best_of_n,
    greedy,
    majority_vote,
    ppm_vote,
    sample_chains,
    weighted_vote,
)
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
    settle,
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
    node_records,
    select,
    selection_score,
    tree_from_records,
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
    "best_of_n",
    "edit_distance",
    "expand",
    "greedy",
    "majority_vote",
    "node_records",
    "ppm_pairs",
    "ppm_vote",
    "replay",
    "sample_chains",
    "select",
    "selection_score",
    "settle",
    "sft_traces",
    "tree_from_records",
    "vote",
    "weighted_vote",
]
