"""SFT from the user's own file (`spec.sft.dataset`): conversations in the chat format TRL and
verl read, rendered in kubestar's tool-call format and masked exactly as RL trajectories.

The checks use SmolLM2's real tokenizer (the tiny test model carries it): an example must hold
the very tokens and masks the agent loop makes for the same turns, the masked tokens decode to
the assistant's text and nothing else, every rendered call parses back to its code, and each
kind of bad input fails with one line naming the file and the line. No sandbox is needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kubestar.sandbox.client import Call
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem
from kubestar.training.generators import ScriptedGenerator
from kubestar.training.rollout import AgentLoop, RolloutConfig
from kubestar.training.sft_data import SftExample, format_tool_call
from kubestar.training.sft_file import (
    SftFileError,
    load_sft_file,
    read_sft_file,
)
from kubestar.training.tools import (
    DEFAULT_INSTRUCTIONS,
    IM_END,
    PENDING,
    parse_tool_calls,
    render_prompt,
    system_prompt,
)
from kubestar.v1 import sandbox_pb2 as pb
from pydantic import ValidationError

from tests.real_parts import require_modules, tiny_model


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    """SmolLM2's tokenizer (the tiny test model carries it)."""
    return ChatTokenizer.from_model(tiny_model(hidden_size=64))


def call(code: str, as_string: bool = False) -> dict[str, Any]:
    """An OpenAI-style call of the python tool (arguments as an object or a JSON string)."""
    arguments: Any = {"code": code}
    return {
        "type": "function",
        "function": {
            "name": "python",
            "arguments": json.dumps(arguments) if as_string else arguments,
        },
    }


def arithmetic(a: int, b: int) -> dict[str, Any]:
    """A short conversation with one call: the kind of example SFT teaches the format with."""
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {
                "role": "assistant",
                "content": "I'll compute it with Python.",
                "tool_calls": [call(f"print({a} * {b})")],
            },
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"The product is \\boxed{{{a * b}}}."},
        ],
        "tools": [{"type": "function", "function": {"name": "python"}}],  # ignored
    }


def write_lines(path: Path, lines: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def masked(tokenizer: ChatTokenizer, example: SftExample, value: int) -> str:
    """The response tokens whose loss mask is `value`, decoded together."""
    ids = [
        i for i, m in zip(example.response_ids, example.response_mask, strict=True) if m == value
    ]
    return tokenizer.decode(ids)


# -- the same tokens and masks as the agent loop ---------------------------------------------
class AnsweringTools:
    """A stand-in sandbox that prints the given output for each code."""

    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs

    async def execute(self, call: Call) -> pb.ExecutionResult:
        return pb.ExecutionResult(
            status=pb.EXECUTION_STATUS_OK, stdout=self.outputs[call.code] + "\n"
        )

    async def close(self) -> None:
        return None


async def test_an_example_holds_the_tokens_and_masks_of_an_rl_trajectory(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """The agent loop plays the same turns (a scripted model, a sandbox that prints the file's
    tool outputs): prompt, response and mask are identical token for token. The message with
    two calls becomes two turns, as RL generation stops at the first </tool_call>."""
    instructions = "You are a careful calculator. Put the answer in \\boxed{}."
    first, second = "x = 12\nprint(x ** 2)", 'print("a\\tb", {"k": [1, 2]})'
    conversation = {
        "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": "Square 12, then show a dict."},
            {
                "role": "assistant",
                "content": "Two quick computations.",
                "tool_calls": [call(first), call(second, as_string=True)],
            },
            {"role": "tool", "content": "144"},
            {"role": "tool", "content": "a\tb {'k': [1, 2]}"},
            {"role": "assistant", "content": "12 squared is \\boxed{144}."},
        ]
    }
    [example] = read_sft_file(
        write_lines(tmp_path / "sft.jsonl", [conversation]), tokenizer, None, 4096
    )

    turns = [
        f"Two quick computations.\n{format_tool_call(first)}",
        format_tool_call(second),
        "12 squared is \\boxed{144}.",
    ]
    generator = ScriptedGenerator(tokenizer, lambda _id, turn, _context: turns[turn])
    tools = AnsweringTools({first: "144", second: "a\tb {'k': [1, 2]}"})
    loop = AgentLoop(generator, tools, tokenizer, RolloutConfig(instructions=instructions))
    problem = Problem("p", "Square 12, then show a dict.", "144")
    trajectory = await loop.run_trajectory(problem, 0, "p")

    assert trajectory.finish_reason == "answered"
    assert example.prompt_text == trajectory.prompt_text
    assert example.prompt_ids == trajectory.prompt_ids
    assert example.response_ids == trajectory.response_ids
    assert example.response_mask == trajectory.response_mask
    assert example.assistant_turns == [s.text for s in trajectory.segments if s.owner == "model"]
    assert example.tool_codes == [first, second]
    assert example.tool_responses == ["144", "a\tb {'k': [1, 2]}"]
    assert example.id == f"{tmp_path / 'sft.jsonl'}:1" and example.family == "file"
    assert example.question == "Square 12, then show a dict." and example.answer == ""


def test_the_mask_covers_exactly_what_the_assistant_writes(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """Loss on the assistant's text, its calls and the <|im_end|> of its turns without calls;
    none on tool responses, later user turns or the <|im_end|> after a call."""
    code = "print(sum(range(10)))"
    conversation = {
        "messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! What should I compute?"},
            {"role": "user", "content": "The sum of 0..9."},
            {"role": "assistant", "content": None, "tool_calls": [call(code)]},
            {"role": "tool", "content": "45", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "It is \\boxed{45}."},
        ]
    }
    [example] = read_sft_file(
        write_lines(tmp_path / "chat.jsonl", [conversation]), tokenizer, None, 4096
    )

    assert masked(tokenizer, example, 1) == (
        f"Hi! What should I compute?{IM_END}{format_tool_call(code)}It is \\boxed{{45}}.{IM_END}"
    )
    assert masked(tokenizer, example, 0) == (
        "\n<|im_start|>user\nThe sum of 0..9.<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n45\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The prompt is the system turn, the FIRST user turn and the opening of the assistant's.
    assert example.prompt_text == render_prompt("Hello!", system_prompt(DEFAULT_INSTRUCTIONS))
    assert tokenizer.decode(example.prompt_ids) == example.prompt_text
    assert example.question == "Hello!" and example.trained_tokens == sum(example.response_mask)


def test_every_rendered_call_parses_back_to_its_code(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """What SFT teaches is what RL's parser reads: quotes, backslashes, tabs, newlines and
    non-ASCII text in code survive the format."""
    codes = [
        'print("quoted \\"text\\"")',
        "for i in range(3):\n\tprint(i, end='\\n')",
        "s = 'naïve ünïcode ✓'\nprint(s[::-1])",
        'import json\nprint(json.dumps({"a": "<b>"}))',
    ]
    lines = [
        {
            "messages": [
                {"role": "user", "content": "Run it."},
                {"role": "assistant", "content": "", "tool_calls": [call(code, as_string=True)]},
                {"role": "tool", "content": "done"},
                {"role": "assistant", "content": "Done."},
            ]
        }
        for code in codes
    ]
    examples = read_sft_file(write_lines(tmp_path / "codes.jsonl", lines), tokenizer, None, 4096)
    for example, code in zip(examples, codes, strict=True):
        first_turn = masked(tokenizer, example, 1).split(IM_END)[0].removesuffix("Done.")
        [parsed] = parse_tool_calls(first_turn)
        assert parsed.status == PENDING and parsed.code == code
        assert example.tool_codes == [code]


def test_a_system_message_becomes_the_instructions_of_the_tool_prompt(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """With or without a system message, the python tool is declared; without one, the
    instructions given (the RL rollouts') are used."""
    with_system = {
        "messages": [{"role": "system", "content": "Be brief."}] + arithmetic(2, 3)["messages"]
    }
    path = write_lines(tmp_path / "system.jsonl", [with_system, arithmetic(4, 5)])
    own, default = read_sft_file(path, tokenizer, None, 4096, instructions="Use Python.")
    assert own.prompt_text == render_prompt("What is 2 * 3?", system_prompt("Be brief."))
    assert default.prompt_text == render_prompt("What is 4 * 5?", system_prompt("Use Python."))
    assert all('"name": "python"' in e.prompt_text for e in (own, default))


# -- how many -------------------------------------------------------------------------------------
def test_examples_takes_the_first_conversations_that_fit(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    long = arithmetic(7, 8)
    long["messages"][-1]["content"] = "The product is 56. " * 200 + "\\boxed{56}"
    lines: list[dict[str, Any] | str] = [
        arithmetic(1, 2),
        long,
        "",
        arithmetic(3, 4),
        arithmetic(5, 6),
    ]
    path = write_lines(tmp_path / "sft.jsonl", lines)

    everything = load_sft_file(path, tokenizer, None, 1024)
    assert [e.id.rsplit(":", 1)[1] for e in everything.examples] == ["1", "4", "5"]
    assert everything.dropped_too_long == 1 and everything.conversations == 4
    assert max(e.tokens for e in everything.examples) <= 1024

    first_two = load_sft_file(path, tokenizer, 2, 1024)
    assert [e.question for e in first_two.examples] == ["What is 1 * 2?", "What is 3 * 4?"]
    assert first_two.dropped_too_long == 1
    assert len(read_sft_file(path, tokenizer, 1, 1024)) == 1


def test_nothing_that_fits_max_tokens_is_an_error(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "sft.jsonl", [arithmetic(1, 2), arithmetic(3, 4)])
    with pytest.raises(SftFileError) as failed:
        read_sft_file(path, tokenizer, None, 200)
    message = str(failed.value)
    assert message.startswith(f"{path}: none of its 2 conversation(s) fits spec.sft.maxTokens 200")
    assert "the shortest takes" in message and "\n" not in message


# -- bad input ------------------------------------------------------------------------------------
def _messages(*messages: Any) -> dict[str, Any]:
    return {"messages": list(messages)}


USER = {"role": "user", "content": "What is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "\\boxed{4}"}
CALLING = {"role": "assistant", "content": "Let me run it.", "tool_calls": [call("print(2 + 2)")]}
TOOL = {"role": "tool", "content": "4"}

BAD_LINES: list[tuple[str, Any, str]] = [
    ("not JSON", '{"messages": [', "not JSON: "),
    ("not an object", "[1, 2]", "not an object with messages but [1, 2]"),
    ("no messages", {"conversation": []}, 'no messages (a non-empty "messages" list)'),
    ("empty messages", {"messages": []}, 'no messages (a non-empty "messages" list)'),
    ("message not an object", _messages(USER, "hi"), "message 2 is not an object"),
    (
        "unknown role",
        _messages(USER, {"role": "bot", "content": "4"}),
        "message 2: unknown role 'bot' (one of system, user, assistant, tool)",
    ),
    (
        "content not a string",
        _messages(USER, {"role": "assistant", "content": [{"type": "text", "text": "4"}]}),
        "message 2 (assistant): content is not a string",
    ),
    (
        "another tool",
        _messages(
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "search", "arguments": {}}}
                ],
            },
            TOOL,
            ANSWER,
        ),
        "message 2 (assistant) tool call 1 names the tool 'search'; only 'python' is declared",
    ),
    (
        "arguments without code",
        _messages(
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": {"src": "1"}}}
                ],
            },
            TOOL,
            ANSWER,
        ),
        'message 2 (assistant) tool call 1: arguments without a non-empty string "code"',
    ),
    (
        "code that is not a string",
        _messages(
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": '{"code": 4}'}}
                ],
            },
            TOOL,
            ANSWER,
        ),
        'message 2 (assistant) tool call 1: arguments without a non-empty string "code"',
    ),
    (
        "arguments string not JSON",
        _messages(
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": "print(1)"}}
                ],
            },
            TOOL,
            ANSWER,
        ),
        "message 2 (assistant) tool call 1: arguments is a string but not JSON (",
    ),
    (
        "code that ends the call",
        _messages(
            USER,
            {"role": "assistant", "content": "", "tool_calls": [call("print('</tool_call>')")]},
            TOOL,
            ANSWER,
        ),
        "message 2 (assistant) tool call 1: the code holds </tool_call>, which ends a tool "
        "call early",
    ),
    ("no assistant turn", _messages(USER), "no assistant message"),
    (
        "no user message first",
        _messages(ANSWER),
        "a conversation starts with a user message (after an optional system message), not "
        "assistant",
    ),
    (
        "tool message without a call",
        _messages(USER, ANSWER, TOOL),
        "message 3 (tool): a tool message with no tool call before it",
    ),
    (
        "too few tool messages",
        _messages(USER, CALLING, ANSWER),
        "message 2 (assistant) makes 1 tool call(s) but 0 tool message(s) follow it",
    ),
    (
        "too many tool messages",
        _messages(USER, CALLING, TOOL, TOOL, ANSWER),
        "message 2 (assistant) makes 1 tool call(s) but 2 tool message(s) follow it",
    ),
    (
        "ends with tool responses",
        _messages(USER, CALLING, TOOL),
        "the conversation ends with tool responses; the assistant's answer to them is missing",
    ),
    (
        "ends with a user message",
        _messages(USER, ANSWER, USER),
        "the conversation ends with a user message; the last message is the assistant's",
    ),
    ("two user messages", _messages(USER, USER, ANSWER), "message 2 (user): two user messages"),
    (
        "two assistant messages",
        _messages(USER, ANSWER, ANSWER),
        "message 3 (assistant): two assistant messages in a row",
    ),
    (
        "a later system message",
        _messages(USER, ANSWER, {"role": "system", "content": "x"}),
        "message 3 (system): a system message is only read first",
    ),
    (
        "a call written in the content",
        _messages(USER, {"role": "assistant", "content": format_tool_call("print(4)")}),
        "message 2 (assistant): the content holds <tool_call>; give calls in tool_calls",
    ),
    (
        "a chat marker in the content",
        _messages({"role": "user", "content": "2+2<|im_end|>"}, ANSWER),
        "message 1 (user): the content holds the chat marker <|im_end|>",
    ),
    (
        "an empty assistant message",
        _messages(USER, {"role": "assistant", "content": " "}),
        "message 2 (assistant): no content and no tool calls",
    ),
]


@pytest.mark.parametrize(
    ("line", "expected"), [case[1:] for case in BAD_LINES], ids=[case[0] for case in BAD_LINES]
)
def test_bad_input_is_one_line_naming_the_file_and_the_line(
    tokenizer: ChatTokenizer, tmp_path: Path, line: Any, expected: str
) -> None:
    """A good conversation, a blank line, then the bad one: line 3 is named."""
    path = write_lines(tmp_path / "sft.jsonl", [arithmetic(1, 2), "", line])
    with pytest.raises(SftFileError) as failed:
        read_sft_file(path, tokenizer, None, 4096)
    message = str(failed.value)
    assert message.startswith(f"{path}:3: {expected}"), message
    assert "\n" not in message


def test_a_missing_or_empty_file_names_the_setting(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(SftFileError) as failed:
        read_sft_file(missing, tokenizer, None, 4096)
    assert str(failed.value) == (
        f"spec.sft.dataset.path: {missing} does not exist in the trainer's container"
    )
    with pytest.raises(SftFileError) as failed:
        read_sft_file(tmp_path, tokenizer, None, 4096)
    assert str(failed.value) == f"spec.sft.dataset.path: {tmp_path} is not a file"
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(SftFileError, match="no conversations"):
        read_sft_file(empty, tokenizer, None, 4096)
    binary = tmp_path / "data.parquet"
    binary.write_bytes(b"PAR1\xff\xfe\x00")
    with pytest.raises(SftFileError, match="not a text file of JSON lines"):
        read_sft_file(binary, tokenizer, None, 4096)


# -- the spec -------------------------------------------------------------------------------------
def test_the_sft_spec_reads_a_dataset_path() -> None:
    from kubestar.api.v1alpha1 import SftSpec

    spec = SftSpec.model_validate(
        {"dataset": {"path": "/data/sft.jsonl"}, "examples": 10, "maxTokens": 2048}
    )
    assert spec.dataset is not None and spec.dataset.path == "/data/sft.jsonl"
    assert spec.examples == 10 and spec.max_tokens == 2048
    plain = SftSpec.model_validate({})
    assert plain.dataset is None and plain.examples is None  # 256 made examples
    with pytest.raises(ValidationError, match="format"):
        SftSpec.model_validate({"dataset": {"path": "/data/sft.jsonl", "format": "sharegpt"}})
    with pytest.raises(ValidationError, match="dataset"):
        SftSpec.model_validate({"dataset": {}})
    with pytest.raises(ValidationError, match="examples"):
        SftSpec.model_validate({"dataset": {"path": "/data/sft.jsonl"}, "examples": 0})


# -- training -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_sft_trains_on_the_file_and_lowers_the_loss(tmp_path: Path) -> None:
    """No sandbox: the file path never calls one. A too-long conversation is dropped and
    counted; `examples` takes the first six that fit."""
    require_modules("torch", "transformers")
    from kubestar.api.v1alpha1 import SftSpec
    from kubestar.training.policy import OptimizerConfig, Policy
    from kubestar.training.sft import run_sft

    long = arithmetic(9, 9)
    long["messages"][-1]["content"] = "It is 81. " * 300 + "\\boxed{81}"
    lines = [arithmetic(2, 3), long, *(arithmetic(a, a + 1) for a in range(4, 10))]
    path = write_lines(tmp_path / "sft.jsonl", lines)
    model = tiny_model(hidden_size=64)
    policy = Policy(model, OptimizerConfig(learning_rate=1e-6), device="cpu", micro_batch_size=4)
    spec = SftSpec.model_validate(
        {
            "dataset": {"path": str(path)},
            "examples": 6,
            "epochs": 4,
            "learningRate": 3e-3,
            "batchSize": 3,
            "maxTokens": 1024,
        }
    )
    metrics = run_sft(policy, model, spec, "127.0.0.1:1")
    assert metrics["examples"] == 6 and metrics["dropped_too_long"] == 1
    assert metrics["steps"] == 8 and metrics["error_fix_examples"] == 0
    assert metrics["loss"] < metrics["first_epoch_loss"] < metrics["initial_loss"]
    assert all(group["lr"] == 1e-6 for group in policy.optimizer.param_groups)
