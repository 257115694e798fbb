"""Rewards: math verification of the final \\boxed{} answer, with a time limit."""

from __future__ import annotations

import pytest
from kubestar.training.rewards import RewardScorer, quick_match, score_answer, verify_answer
from kubestar.training.trajectory import ANSWERED, MAX_LENGTH, Trajectory


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("-4", "-4", True),
        (" 42 ", "42", True),
        ("42.0", "42", True),
        ("1,000", "1000", True),
        ("$7$", "7", True),
        ("3", "4", False),
        ("", "4", False),
        ("0.3333333", "0.3333333", True),
    ],
)
def test_quick_match(answer: str, reference: str, expected: bool) -> None:
    assert quick_match(answer, reference) is expected


def test_quick_match_leaves_hard_cases_to_math_verify() -> None:
    assert quick_match("\\frac{1}{2}", "0.5") is None


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{2}{3}", "0.5", False),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("x^2 + 2x + 1", "(x+1)^2", True),
        ("\\{1, 2\\}", "\\{2, 1\\}", True),
        ("10\\%", "10", True),
        ("\\text{banana}", "7", False),
        ("}{", "7", False),
    ],
)
def test_verify_answer(answer: str, reference: str, expected: bool) -> None:
    assert verify_answer(answer, reference) is expected


def test_no_answer_scores_zero() -> None:
    assert score_answer(None, "3") == 0.0
    assert score_answer("3", "3") == 1.0


async def test_scorer_in_worker_processes_with_a_time_limit() -> None:
    scorer = RewardScorer(workers=1, timeout=0.0005)
    try:
        # Plain cases never reach a worker.
        assert await scorer.score("12", "12") == 1.0
        assert await scorer.score(None, "12") == 0.0
        assert scorer._all == []
        # A worker that cannot answer in time: 0, and it is replaced.
        assert await scorer.score("\\frac{1}{2}", "0.5") == 0.0
        assert scorer.timeouts == 1
        scorer.timeout = 30.0
        assert await scorer.score("\\frac{1}{2}", "0.5") == 1.0
        assert await scorer.score("\\frac{1}{3}", "0.5") == 0.0
        assert scorer.verified == 2
        assert len(scorer._all) == 1 and scorer._all[0].process.is_alive()
    finally:
        scorer.close()
    assert scorer._all == []


async def test_score_trajectory_uses_the_final_answer_only() -> None:
    scorer = RewardScorer(workers=1)
    try:
        answered = Trajectory("t", "p", 0, "q", "5", finish_reason=ANSWERED, answer="5")
        truncated = Trajectory(
            "t2", "p", 1, "q", "5", finish_reason=MAX_LENGTH, boxed_answers=["5"]
        )
        assert await scorer.score_trajectory(answered) == 1.0
        assert await scorer.score_trajectory(truncated) == 0.0
        assert answered.reward == 1.0 and truncated.reward == 0.0
    finally:
        scorer.close()
