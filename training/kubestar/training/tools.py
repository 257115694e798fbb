"""The tool-call format: the system prompt that declares the `python` tool, the parser of the
model's `<tool_call>` blocks, and the text of the `<tool_response>` turns it gets back.

Format (ChatML, Qwen/Hermes conventions)::

    <|im_start|>system
    {instructions}

    # Tools
    ... <tools>{"type": "function", "function": {"name": "python", ...}}</tools> ...<|im_end|>
    <|im_start|>user
    {question}<|im_end|>
    <|im_start|>assistant
    reasoning ... <tool_call>
    {"name": "python", "arguments": {"code": "print(2 + 2)"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    4
    </tool_response><|im_end|>
    <|im_start|>assistant
    ... \\boxed{4}<|im_end|>

Parse rules (one model turn's text; `parse_tool_calls`):

* A call is the text between `<tool_call>` and the next `</tool_call>`. Whitespace around the
  JSON is ignored, and so is a Markdown code fence (```` ```json ... ``` ````) around it.
* The body must be one JSON object `{"name": ..., "arguments": {...}}`. Literal newlines and
  tabs inside JSON strings are accepted (models write code that way); anything else that is
  not valid JSON, or text after the object, makes the call `malformed`.
* `name` must be a string naming a declared tool (`python`), else `unknown-tool` (or
  `malformed` when it is missing or not a string).
* `arguments` must be an object (a string holding a JSON object is accepted too, as in the
  OpenAI API) with a non-empty string `code`; otherwise `bad-arguments`. Other argument
  keys are ignored.
* A `<tool_call>` with no `</tool_call>` before the next `<tool_call>` or the end of the turn
  is `truncated` when generation was cut off by the length limit (it is recorded, never run,
  and the trajectory ends), else `malformed`. A `</tool_call>` with no `<tool_call>` before it
  is `malformed`.
* Every call of a turn is answered in order, up to `max_calls` per turn; the ones past it
  are `rejected` with a message. (Generation stops at the first `</tool_call>`, so a turn
  normally holds exactly one call.) Text outside the tags is ignored.
* A rejected call (`malformed`, `unknown-tool`, `bad-arguments`, `rejected`) is answered with a
  `<tool_response>` that says what was wrong and shows the expected format: never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kubestar.v1 import sandbox_pb2 as pb

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PYTHON_TOOL = "python"

# Statuses of a call the parser rejected (answered with an explanation, never run).
MALFORMED = "malformed"
UNKNOWN_TOOL = "unknown-tool"
BAD_ARGUMENTS = "bad-arguments"
REJECTED = "rejected"
# Statuses of a call that got no tool response at all.
TRUNCATED = "truncated"
SKIPPED = "skipped"
# A call that passed the parser and waits for the sandbox.
PENDING = "pending"
PARSE_ERRORS = frozenset({MALFORMED, UNKNOWN_TOOL, BAD_ARGUMENTS, REJECTED})

PYTHON_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL,
        "description": (
            "Run Python 3 code in a fresh process and return what it printed (stdout and "
            "stderr). Nothing is kept between calls. numpy and sympy are available. Use "
            "print() to see values."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python code to run."},
            },
            "required": ["code"],
        },
    },
}

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant that solves math problems. Think step by step. You can "
    "run Python code with the python tool to calculate and to check your work: it returns "
    "what the code printed. Put your final answer in \\boxed{}."
)

EXAMPLE_CALL = (
    f'{TOOL_CALL_OPEN}\n{{"name": "python", "arguments": {{"code": "print(2 + 2)"}}}}\n'
    f"{TOOL_CALL_CLOSE}"
)


def system_prompt(
    instructions: str = DEFAULT_INSTRUCTIONS, tools: list[dict[str, Any]] | None = None
) -> str:
    """The system message: instructions, then the tools block in Qwen2.5/Hermes wording."""
    declared = "\n".join(json.dumps(tool) for tool in (tools or [PYTHON_TOOL_SCHEMA]))
    return (
        f"{instructions}\n\n"
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{declared}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{TOOL_CALL_CLOSE}\n\n"
        f"For example:\n{EXAMPLE_CALL}"
    )


def chatml(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def render_prompt(question: str, system: str | None = None) -> str:
    """The prompt text: system and user turns, then the opening of the assistant's turn."""
    return (
        chatml("system", system if system is not None else system_prompt())
        + chatml("user", question)
        + f"{IM_START}assistant\n"
    )


@dataclass
class ParsedCall:
    """One `<tool_call>` block of a model turn."""

    raw: str
    status: str  # PENDING when it may run, else one of the parse statuses above
    name: str = ""
    code: str = ""
    error: str = ""  # what the model is told when status is not PENDING
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        return self.status == PENDING


_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?```$", re.DOTALL)


def _format_hint(tools: frozenset[str]) -> str:
    names = ", ".join(sorted(tools))
    return (
        f"Available tools: {names}. Write a tool call as one JSON object, for example:\n"
        f"{EXAMPLE_CALL}"
    )


def _parse_body(raw: str, tools: frozenset[str]) -> ParsedCall:
    body = raw.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    hint = _format_hint(tools)
    if not body:
        return ParsedCall(raw, MALFORMED, error=f"Error: the tool call is empty. {hint}")
    decoder = json.JSONDecoder(strict=False)
    try:
        value, end = decoder.raw_decode(body)
    except json.JSONDecodeError as exc:
        return ParsedCall(
            raw, MALFORMED, error=f"Error: the tool call is not valid JSON ({exc}). {hint}"
        )
    if body[end:].strip():
        return ParsedCall(
            raw,
            MALFORMED,
            error=f"Error: unexpected text after the JSON object of the tool call. {hint}",
        )
    if not isinstance(value, dict):
        return ParsedCall(
            raw, MALFORMED, error=f"Error: the tool call must be a JSON object. {hint}"
        )
    name = value.get("name")
    if not isinstance(name, str):
        return ParsedCall(
            raw, MALFORMED, error=f'Error: the tool call has no "name" string. {hint}'
        )
    if name not in tools:
        return ParsedCall(
            raw, UNKNOWN_TOOL, name=name, error=f"Error: unknown tool {name!r}. {hint}"
        )
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ParsedCall(
            raw,
            BAD_ARGUMENTS,
            name=name,
            error=f'Error: the tool call needs an "arguments" object. {hint}',
        )
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return ParsedCall(
            raw,
            BAD_ARGUMENTS,
            name=name,
            arguments=arguments,
            error=f'Error: the {name} tool needs a non-empty "code" string argument. {hint}',
        )
    return ParsedCall(raw, PENDING, name=name, code=code, arguments=arguments)


def parse_tool_calls(
    text: str,
    *,
    truncated: bool = False,
    tools: frozenset[str] = frozenset({PYTHON_TOOL}),
    max_calls: int = 0,
) -> list[ParsedCall]:
    """The tool calls of one model turn, in order (see the module docstring for the rules).

    `truncated`: the turn was cut off by the length limit (an unclosed call is then
    `truncated` rather than `malformed`). `max_calls`: calls past this many are `rejected`
    (0: no limit).
    """
    calls: list[ParsedCall] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        close = text.find(TOOL_CALL_CLOSE, position)
        if start < 0 and close < 0:
            break
        if close >= 0 and (start < 0 or close < start):
            calls.append(
                ParsedCall(
                    text[position : close + len(TOOL_CALL_CLOSE)],
                    MALFORMED,
                    error=f"Error: {TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN} before it. "
                    + _format_hint(tools),
                )
            )
            position = close + len(TOOL_CALL_CLOSE)
            continue
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if close < 0 or (0 <= reopen < close):
            end = reopen if reopen >= 0 else len(text)
            raw = text[body_start:end]
            if reopen < 0 and truncated:
                calls.append(ParsedCall(raw, TRUNCATED))
            else:
                calls.append(
                    ParsedCall(
                        raw,
                        MALFORMED,
                        error=f"Error: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}. "
                        + _format_hint(tools),
                    )
                )
            position = end
            continue
        calls.append(_parse_body(text[body_start:close], tools))
        position = close + len(TOOL_CALL_CLOSE)
    if max_calls > 0:
        answered = 0
        for call in calls:
            if call.status == TRUNCATED:
                continue
            answered += 1
            if answered > max_calls:
                call.status = REJECTED
                call.error = (
                    f"Error: at most {max_calls} tool call(s) are run per turn; this one was not."
                )
    return calls


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of `text` (tracebacks end with what matters)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n... [{omitted} characters omitted] ...\n{text[-tail:]}"


_SANDBOX_FRAME = re.compile(r'^  File "[^"]*/kubestar/sandbox/[^"]*", line \d+.*$')


def clean_traceback(stderr: str) -> str:
    """Drop the sandbox's own frames (they say nothing about the model's code)."""
    if "Traceback" not in stderr:
        return stderr
    kept: list[str] = []
    skipping = False
    for line in stderr.splitlines(keepends=True):
        if _SANDBOX_FRAME.match(line.rstrip("\n")):
            skipping = True
            continue
        if skipping and line.startswith("    "):
            continue
        skipping = False
        kept.append(line)
    return "".join(kept)


def render_result(result: pb.ExecutionResult, max_chars: int = 2048) -> str:
    """What the model reads back from one execution (inside `<tool_response>`)."""
    from kubestar.sandbox.metrics import status_label

    status = status_label(result.status)
    stdout = result.stdout
    stderr = clean_traceback(result.stderr)
    parts = [part.rstrip("\n") for part in (stdout, stderr) if part.strip()]
    output = "\n".join(parts)
    if status == "ok":
        text = output if output else "(no output: print() the values you want to see)"
    elif status == "error":
        text = (
            output
            if stderr.strip()
            else (output + "\n" if output else "")
            + (f"Error: the process exited with code {result.exit_code}")
        )
    elif status == "timeout":
        text = (output + "\n" if output else "") + (
            f"TimeoutError: the code was stopped ({result.message or 'time limit passed'})"
        )
    elif status == "memory":
        text = (output + "\n" if output else "") + (
            f"MemoryError: the code was stopped ({result.message or 'memory limit passed'})"
        )
    elif status == "output-limit":
        text = (output + "\n" if output else "") + (
            f"Error: too much output; the code was stopped ({result.message or 'output limit'})"
        )
    elif status == "invalid":
        text = f"Error: the code was rejected: {result.message}"
    else:  # queue-timeout, internal, unspecified: not the code's fault
        text = f"Error: the sandbox could not run the code ({status}: {result.message})"
    return truncate_middle(text, max_chars)


def render_tool_turn(responses: list[str], model_closed_turn: bool) -> str:
    """The text appended after a model turn that made tool calls.

    It closes the assistant turn when the model stopped at `</tool_call>` (the model's own
    `<|im_end|>` is kept as a model token when it wrote one), adds a user turn with one
    `<tool_response>` block per call, and opens the next assistant turn. All of it is
    tool-owned (mask 0).
    """
    blocks = "\n".join(f"{TOOL_RESPONSE_OPEN}\n{r}\n{TOOL_RESPONSE_CLOSE}" for r in responses)
    prefix = "\n" if model_closed_turn else f"{IM_END}\n"
    return f"{prefix}{IM_START}user\n{blocks}{IM_END}\n{IM_START}assistant\n"


def extract_boxed(text: str) -> list[str]:
    """Every `\\boxed{...}` (or `\\fbox{...}`) answer in `text`, in order.

    Braces nest (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); `\\boxed 5` gives `5`; an
    unclosed box is ignored.
    """
    answers: list[str] = []
    for match in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text):
        index = match.end()
        while index < len(text) and text[index] == " ":
            index += 1
        if index < len(text) and text[index] == "{":
            depth = 0
            for end in range(index, len(text)):
                if text[end] == "{":
                    depth += 1
                elif text[end] == "}":
                    depth -= 1
                    if depth == 0:
                        answers.append(text[index + 1 : end].strip())
                        break
        elif index > match.end():  # `\boxed 5`
            word = re.match(r"[^\s$]+", text[index:])
            if word:
                answers.append(word.group(0).rstrip(".,"))
    return answers


def last_boxed(text: str) -> str | None:
    answers = extract_boxed(text)
    return answers[-1] if answers else None
