"""The tool-call format: system prompt, parser rules, tool responses, boxed answers."""

from __future__ import annotations

import json

import pytest
from kubestar.training.tools import (
    BAD_ARGUMENTS,
    MALFORMED,
    PENDING,
    PYTHON_TOOL_SCHEMA,
    REJECTED,
    TRUNCATED,
    UNKNOWN_TOOL,
    clean_traceback,
    extract_boxed,
    last_boxed,
    parse_tool_calls,
    render_prompt,
    render_result,
    render_tool_turn,
    system_prompt,
    truncate_middle,
)
from kubestar.v1 import sandbox_pb2 as pb


def call_text(body: str) -> str:
    return f"Some reasoning.\n<tool_call>\n{body}\n</tool_call>"


def test_system_prompt_declares_the_python_tool() -> None:
    prompt = system_prompt()
    start = prompt.index("<tools>\n") + len("<tools>\n")
    declared = json.loads(prompt[start : prompt.index("\n</tools>")])
    assert declared == PYTHON_TOOL_SCHEMA
    assert declared["function"]["name"] == "python"
    assert declared["function"]["parameters"]["required"] == ["code"]
    assert "\\boxed{}" in prompt
    assert "<tool_call></tool_call>" in prompt


def test_prompt_is_chatml_and_opens_the_assistant_turn() -> None:
    text = render_prompt("What is 2+2?", system="SYS")
    assert text == (
        "<|im_start|>system\nSYS<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_valid_call() -> None:
    (call,) = parse_tool_calls(call_text('{"name": "python", "arguments": {"code": "print(1)"}}'))
    assert call.status == PENDING and call.runnable
    assert call.name == "python" and call.code == "print(1)"


@pytest.mark.parametrize(
    "body",
    [
        '```json\n{"name": "python", "arguments": {"code": "print(1)"}}\n```',
        '   {"name": "python", "arguments": {"code": "print(1)"}}   ',
        '{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}',  # OpenAI style
        '{"name": "python", "arguments": {"code": "print(1)", "extra": 5}}',  # extra ignored
    ],
)
def test_lenient_forms_are_accepted(body: str) -> None:
    (call,) = parse_tool_calls(call_text(body))
    assert call.status == PENDING, call.error
    assert call.code == "print(1)"


def test_literal_newlines_inside_the_code_string_are_accepted() -> None:
    body = '{"name": "python", "arguments": {"code": "x = 2\nprint(x ** 10)"}}'
    (call,) = parse_tool_calls(call_text(body))
    assert call.status == PENDING
    assert call.code == "x = 2\nprint(x ** 10)"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ('{"name": "python", "arguments": {"code": "print(1)"}', MALFORMED, "not valid JSON"),
        ("{name: python}", MALFORMED, "not valid JSON"),
        ("print(1)", MALFORMED, "not valid JSON"),
        ("", MALFORMED, "empty"),
        ('{"name": "python", "arguments": {"code": "1"}} and more', MALFORMED, "after the JSON"),
        ('["python", {"code": "1"}]', MALFORMED, "JSON object"),
        ('{"arguments": {"code": "1"}}', MALFORMED, '"name"'),
        ('{"name": 3, "arguments": {"code": "1"}}', MALFORMED, '"name"'),
        ('{"name": "bash", "arguments": {"cmd": "ls"}}', UNKNOWN_TOOL, "unknown tool 'bash'"),
        ('{"name": "python"}', BAD_ARGUMENTS, '"arguments"'),
        ('{"name": "python", "arguments": [1]}', BAD_ARGUMENTS, '"arguments"'),
        ('{"name": "python", "arguments": "not json"}', BAD_ARGUMENTS, '"arguments"'),
        ('{"name": "python", "arguments": {}}', BAD_ARGUMENTS, '"code"'),
        ('{"name": "python", "arguments": {"code": 5}}', BAD_ARGUMENTS, '"code"'),
        ('{"name": "python", "arguments": {"code": "  "}}', BAD_ARGUMENTS, '"code"'),
    ],
)
def test_bad_calls_are_explained(body: str, status: str, says: str) -> None:
    (call,) = parse_tool_calls(call_text(body))
    assert call.status == status
    assert not call.runnable
    assert says in call.error
    # Every explanation shows the expected format.
    assert '{"name": "python", "arguments": {"code": "print(2 + 2)"}}' in call.error


def test_unclosed_call_is_truncated_when_cut_by_length_else_malformed() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1'
    (cut,) = parse_tool_calls(text, truncated=True)
    assert cut.status == TRUNCATED
    assert cut.raw.startswith('\n{"name"')
    (ended,) = parse_tool_calls(text, truncated=False)
    assert ended.status == MALFORMED
    assert "without </tool_call>" in ended.error


def test_close_without_open_is_malformed() -> None:
    (call,) = parse_tool_calls('{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert call.status == MALFORMED
    assert "without <tool_call> before it" in call.error


def test_unclosed_call_followed_by_another() -> None:
    good = '{"name": "python", "arguments": {"code": "print(2)"}}'
    text = f"<tool_call>{{oops <tool_call>{good}</tool_call>"
    first, second = parse_tool_calls(text, truncated=True)
    assert first.status == MALFORMED  # not at the end: it was abandoned, not cut off
    assert second.status == PENDING and second.code == "print(2)"


def test_several_calls_in_order_up_to_the_limit() -> None:
    text = "".join(
        f'<tool_call>{{"name": "python", "arguments": {{"code": "print({i})"}}}}</tool_call> '
        for i in range(4)
    )
    calls = parse_tool_calls(text, max_calls=2)
    assert [c.status for c in calls] == [PENDING, PENDING, REJECTED, REJECTED]
    assert [c.code for c in calls[:2]] == ["print(0)", "print(1)"]
    assert "at most 2" in calls[2].error
    assert [c.status for c in parse_tool_calls(text)] == [PENDING] * 4


def test_no_call() -> None:
    assert parse_tool_calls("The answer is \\boxed{4}.") == []


def result(status: int, **fields: object) -> pb.ExecutionResult:
    return pb.ExecutionResult(status=status, **fields)  # type: ignore[arg-type]


def test_rendered_results() -> None:
    assert render_result(result(pb.EXECUTION_STATUS_OK, stdout="120\n")) == "120"
    assert "no output" in render_result(result(pb.EXECUTION_STATUS_OK))
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/srv/kubestar/sandbox/zygote.py", line 428, in _child\n'
        '    code = compile(request["code"], "<tool_call>", "exec")\n'
        '  File "<tool_call>", line 1, in <module>\n'
        "ZeroDivisionError: division by zero\n"
    )
    error = render_result(
        result(pb.EXECUTION_STATUS_ERROR, stdout="partial\n", stderr=traceback, exit_code=1)
    )
    assert error.startswith("partial\nTraceback")
    assert "zygote" not in error and "ZeroDivisionError: division by zero" in error
    assert "exited with code 3" in render_result(result(pb.EXECUTION_STATUS_ERROR, exit_code=3))
    timeout = render_result(
        result(pb.EXECUTION_STATUS_TIMEOUT, stdout="1\n", message="wall-clock limit of 1s passed")
    )
    assert timeout == "1\nTimeoutError: the code was stopped (wall-clock limit of 1s passed)"
    assert "MemoryError" in render_result(result(pb.EXECUTION_STATUS_MEMORY))
    assert "too much output" in render_result(result(pb.EXECUTION_STATUS_OUTPUT_LIMIT))
    assert "rejected" in render_result(result(pb.EXECUTION_STATUS_INVALID, message="empty code"))
    internal = render_result(result(pb.EXECUTION_STATUS_INTERNAL, message="no worker"))
    assert "sandbox could not run the code (internal: no worker)" in internal
    long = render_result(result(pb.EXECUTION_STATUS_OK, stdout="x" * 10_000), max_chars=100)
    assert len(long) < 200 and "characters omitted" in long


def test_clean_traceback_keeps_other_text() -> None:
    assert clean_traceback("just a warning\n") == "just a warning\n"


def test_truncate_middle_keeps_head_and_tail() -> None:
    text = "HEAD" + "." * 1000 + "TAIL"
    short = truncate_middle(text, 20)
    assert short.startswith("HEAD") and short.endswith("TAIL")
    assert "[988 characters omitted]" in short
    assert truncate_middle("abc", 20) == "abc"


def test_tool_turn_markup() -> None:
    after_stop = render_tool_turn(["4"], model_closed_turn=False)
    assert after_stop == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    after_eos = render_tool_turn(["a", "b"], model_closed_turn=True)
    assert after_eos.startswith("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n")
    assert "<tool_response>\nb\n</tool_response><|im_end|>" in after_eos


@pytest.mark.parametrize(
    ("text", "answers"),
    [
        ("so \\boxed{42}.", ["42"]),
        ("\\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"]),
        ("\\boxed{{a}+{b^{2}}}", ["{a}+{b^{2}}"]),
        ("first \\boxed{1} then \\boxed{2}", ["1", "2"]),
        ("\\boxed 5.", ["5"]),
        ("$\\boxed {7}$", ["7"]),
        ("\\fbox{x}", ["x"]),
        ("\\boxed{unclosed", []),
        ("\\boxedx{1}", []),
        ("\\boxed{}", [""]),
        ("\\boxed{\\{1, 2\\}}", ["\\{1, 2\\}"]),
        ("no answer", []),
    ],
)
def test_extract_boxed(text: str, answers: list[str]) -> None:
    assert extract_boxed(text) == answers


def test_last_boxed() -> None:
    assert last_boxed("\\boxed{1} and \\boxed{\\dfrac{3}{4}}") == "\\dfrac{3}{4}"
    assert last_boxed("nothing") is None
