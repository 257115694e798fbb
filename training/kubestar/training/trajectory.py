"""The record of one trajectory: tokens with their owner (model or tool), log-probabilities,
every tool call with its outcome, how it finished, and its answer.

The response is everything after the prompt: model turns and the tool turns between them.
`response_mask[i]` is 1 for a token the model generated (its loss counts) and 0 for a token
the loop inserted (tool responses and the ChatML markup around them). `response_logprobs[i]`
is the sampling log-probability of a model token and 0.0 for a tool token. The four lists
`prompt_ids`, `response_ids`, `response_mask`, `response_logprobs` are what the trainer turns
into tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kubestar.sandbox.retries import INFRA_STATUSES
from kubestar.training.tools import PARSE_ERRORS, SKIPPED, TRUNCATED

# How a trajectory ended.
ANSWERED = "answered"  # the last turn made no tool call and gave a \boxed{} answer
NO_ANSWER = "no_answer"  # the last turn made no tool call and gave no \boxed{} answer
MAX_TURNS = "max_turns"  # the last allowed turn still asked for a tool
MAX_LENGTH = "max_length"  # the response reached max_response_tokens (or the context limit)
ERROR = "error"  # generation failed (engine or scheduler error); see Trajectory.error
FINISH_REASONS = (ANSWERED, NO_ANSWER, MAX_TURNS, MAX_LENGTH, ERROR)

MODEL = "model"
TOOL = "tool"


@dataclass
class ToolCallRecord:
    """One tool call, from the model's text to the sandbox's answer.

    `status`: the sandbox's (`ok`, `error`, `timeout`, `memory`, `output-limit`,
    `queue-timeout`, `internal`, `invalid`), a parse status (`malformed`, `unknown-tool`,
    `bad-arguments`, `rejected`: answered with an explanation), or `truncated` / `skipped`
    (no response: cut off by the length limit, or past the last turn).
    """

    turn: int
    index: int  # position in the trajectory's list of calls
    status: str
    name: str = ""
    code: str = ""
    raw: str = ""
    response: str = ""  # what the model was told (inside <tool_response>)
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    message: str = ""
    wall_ms: float = 0.0
    latency_s: float = 0.0  # from the request to the result, as the loop saw it

    @property
    def answered(self) -> bool:
        """The model got a tool response for this call."""
        return self.status not in (TRUNCATED, SKIPPED)

    @property
    def errored(self) -> bool:
        """The policy's code failed (or was rejected): the sandbox's own failures are not
        the policy's errors (`infra_error`)."""
        return self.answered and self.status != "ok" and not self.infra_error

    @property
    def parse_error(self) -> bool:
        return self.status in PARSE_ERRORS

    @property
    def infra_error(self) -> bool:
        return self.status in INFRA_STATUSES


@dataclass
class Segment:
    """A run of response tokens with one owner: [start, end) in response_ids."""

    owner: str  # MODEL | TOOL
    turn: int
    start: int
    end: int
    text: str
    finish_reason: str = ""  # model segments: "stop" | "length"
    stop_reason: str = ""
    engine: str = ""
    weights_version: int = 0
    latency_s: float = 0.0


@dataclass
class Trajectory:
    id: str
    problem_id: str
    sample_index: int
    question: str
    reference: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    num_turns: int = 0
    finish_reason: str = ""
    # The final answer: the last \boxed{} of the model's text, set only when the trajectory
    # ended on its own (ANSWERED); truncated trajectories have none.
    answer: str | None = None
    # Every \boxed{} the model wrote, in every turn (several answers is a format fault).
    boxed_answers: list[str] = field(default_factory=list)
    reward: float | None = None
    error: str = ""
    prompt_text: str = ""
    generate_s: float = 0.0
    tool_s: float = 0.0
    wall_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    # Token accounting -------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def tool_tokens(self) -> int:
        return len(self.response_mask) - sum(self.response_mask)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_text(self) -> str:
        return "".join(segment.text for segment in self.segments)

    @property
    def weights_versions(self) -> list[int]:
        return sorted({s.weights_version for s in self.segments if s.owner == MODEL})

    # Tool-call accounting (Resample-on-Correct needs these) ---------------------------
    @property
    def num_tool_calls(self) -> int:
        """Calls the model got a response for (run, or rejected by the parser)."""
        return sum(1 for call in self.tool_calls if call.answered)

    @property
    def num_tool_errors(self) -> int:
        return sum(1 for call in self.tool_calls if call.errored)

    @property
    def tool_error_ratio(self) -> float:
        calls = self.num_tool_calls
        return self.num_tool_errors / calls if calls else 0.0

    @property
    def num_answers(self) -> int:
        return len(self.boxed_answers)

    @property
    def answered(self) -> bool:
        return self.finish_reason == ANSWERED

    @property
    def truncated(self) -> bool:
        return self.finish_reason in (MAX_LENGTH, MAX_TURNS)

    # Infrastructure failures (kubestar.training.resilience) ----------------------------
    @property
    def infra_failure(self) -> str:
        """What spoiled this trajectory, "" when nothing did: `generation` (an engine or the
        scheduler failed) or `sandbox-STATUS` (the sandbox could not run a call). A spoiled
        trajectory's reward says nothing about the policy: it is never trained on."""
        if self.finish_reason == ERROR:
            return "generation"
        failed = next((call for call in self.tool_calls if call.infra_error), None)
        return f"sandbox-{failed.status}" if failed else ""

    @property
    def infra_error_text(self) -> str:
        if self.finish_reason == ERROR:
            return self.error
        failed = next((call for call in self.tool_calls if call.infra_error), None)
        return (failed.message or failed.response) if failed else ""

    def check(self) -> None:
        """Raise AssertionError when the token lists disagree (a bug in the loop)."""
        n = len(self.response_ids)
        assert len(self.response_mask) == n, "mask length"
        assert len(self.response_logprobs) == n, "logprobs length"
        position = 0
        for segment in self.segments:
            assert segment.start == position, "segments must tile the response"
            expected = 1 if segment.owner == MODEL else 0
            assert all(m == expected for m in self.response_mask[segment.start : segment.end])
            position = segment.end
        assert position == n, "segments must cover the response"

    def to_dict(self, tokens: bool = True) -> dict[str, Any]:
        """JSON-ready; with tokens=False the four token lists are left out."""
        data = asdict(self)
        if not tokens:
            for key in ("prompt_ids", "response_ids", "response_mask", "response_logprobs"):
                data.pop(key)
        data.update(
            response_length=self.response_length,
            model_tokens=self.model_tokens,
            tool_tokens=self.tool_tokens,
            num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors,
            response_text=self.response_text,
            infra_failure=self.infra_failure,
        )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        known = {name for name in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        values["segments"] = [Segment(**s) for s in values.get("segments", [])]
        values["tool_calls"] = [ToolCallRecord(**c) for c in values.get("tool_calls", [])]
        return cls(**values)
