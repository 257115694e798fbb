"""Steps: how a step is read from the policy's text, what the tool appends after it, and the
program a step runs.

A step is reasoning plus Python code and ends at a step stop; the final step gives the answer
in `\\boxed{}`. Two formats:

* rStar-Math's: code comments carry the reasoning, `<code>` opens the program once,
  `<end_of_step>` ends each step, `<end_of_code>` closes the program, after which the tool
  appends `<output>...<end_of_output>`, and an answer step holds `\\boxed{}`
  (`<answer>...<end_of_answer>`). Steps of one program print nothing in between, so the
  observation shows everything the program printed.
* kubestar's tool-call format (`kubestar.training.tools`): a step is one assistant turn that
  ends with a `<tool_call>` of the python tool; the tool appends a `<tool_response>` turn; a
  turn with no call and a `\\boxed{}` answer is the final step. Policies trained by the agent
  loop expect each call to print its own results, so the observation shows only what this
  step's code printed.

Code runs by replay: the sandbox keeps nothing between calls, so a step runs the code of its
ancestors, then its own (`replay`). The code of an ancestor whose code failed is left out:
replaying it would fail again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kubestar.search.tree import Node
from kubestar.training.tools import (
    IM_END,
    TOOL_CALL_CLOSE,
    last_boxed,
    parse_tool_calls,
    render_prompt,
    render_tool_turn,
    truncate_middle,
)

CODE = "<code>"
STEP_END = "<end_of_step>"
CODE_END = "<end_of_code>"
OUTPUT = "<output>"
OUTPUT_END = "<end_of_output>"
ANSWER_END = "<end_of_answer>"
NO_OUTPUT = "(no output: print() the values you want to see)"


class StepKind(enum.StrEnum):
    CODE = "code"
    ANSWER = "answer"
    UNPARSABLE = "unparsable"


@dataclass(frozen=True)
class ParsedStep:
    kind: StepKind
    code: str = ""
    answer: str | None = None


class StepFormat(Protocol):
    """How one format writes prompts, reads steps and shows tool results."""

    stops: tuple[str, ...]  # the strings generation of one step stops at (kept in the text)

    def prompt(self, question: str) -> str: ...

    def parse(self, text: str) -> ParsedStep: ...

    def observation(self, node: Node, failed: bool) -> str:
        """The tool's text appended after the node's step, once its code has run."""
        ...


def replay(node: Node) -> str:
    """The program the node runs: its ancestors' code, then its own, in order."""
    steps = node.path()[1:]
    kept = [step.code for step in steps[:-1] if step.code and not step.code_failed]
    return "\n".join([*kept, node.code]) if node.code else "\n".join(kept)


def new_output(node: Node) -> str:
    """What the node's replay printed beyond what its parent's replay printed."""
    before = node.parent.output if node.parent is not None else ""
    return node.output[len(before) :] if node.output.startswith(before) else node.output


class RStarFormat:
    """rStar-Math's step format (see the module docstring)."""

    stops: tuple[str, ...] = (STEP_END, CODE_END, ANSWER_END)

    def prompt(self, question: str) -> str:
        return (
            f"<|user|>:\n{question}\n"
            "<|assistant|>: Let's think step by step and solve the problem with code."
        )

    def parse(self, text: str) -> ParsedStep:
        if "boxed" in text:
            answer = last_boxed(text)
            return ParsedStep(StepKind.ANSWER, answer=answer) if answer else _UNPARSABLE
        lines: list[str] = []
        for line in text.replace(STEP_END, "").split("\n"):
            line = line.split(CODE, 1)[-1]
            if CODE_END in line:
                lines.append(line.split(CODE_END, 1)[0])
                break
            lines.append(line)
        code = "\n".join(lines).strip("\n")
        return ParsedStep(StepKind.CODE, code=code) if code.strip() else _UNPARSABLE

    def observation(self, node: Node, failed: bool) -> str:
        """Shown when the step closes the program, and when its code failed (so that a
        later step can repair it)."""
        if CODE_END not in node.text and not failed:
            return ""
        return f"\n{OUTPUT}{node.output.strip()}{OUTPUT_END}"


class ToolCallFormat:
    """kubestar's `<tool_call>` format (see the module docstring and
    `kubestar.training.tools`)."""

    stops: tuple[str, ...] = (TOOL_CALL_CLOSE,)

    def __init__(self, system: str | None = None, max_output_chars: int = 2048) -> None:
        self.system = system
        self.max_output_chars = max_output_chars

    def prompt(self, question: str) -> str:
        return render_prompt(question, self.system)

    def parse(self, text: str) -> ParsedStep:
        calls = parse_tool_calls(text)
        if calls:
            call = calls[0]
            return ParsedStep(StepKind.CODE, code=call.code) if call.runnable else _UNPARSABLE
        answer = last_boxed(text)
        return ParsedStep(StepKind.ANSWER, answer=answer) if answer else _UNPARSABLE

    def observation(self, node: Node, failed: bool) -> str:
        printed = new_output(node).strip("\n") or NO_OUTPUT
        response = truncate_middle(printed, self.max_output_chars)
        return render_tool_turn([response], model_closed_turn=node.text.rstrip().endswith(IM_END))


_UNPARSABLE = ParsedStep(StepKind.UNPARSABLE)

# The step formats by name (`kubestar solve --format`, spec.evaluation.search.format).
FORMATS = ("tool-call", "rstar")


def step_format(name: str) -> StepFormat:
    """The step format by its name: rstar, else tool-call."""
    return RStarFormat() if name == "rstar" else ToolCallFormat()
