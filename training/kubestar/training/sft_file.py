"""SFT examples from the user's own file (`spec.sft.dataset.path`), rendered in kubestar's
tool-call format and masked exactly as RL trajectories.

File: JSON lines, each `{"messages": [...]}` as TRL's SFTTrainer (conversational) and verl's
multi-turn SFT read them; other keys (such as "tools") are ignored, and so are blank lines. A
message is `{"role": "system" | "user" | "assistant" | "tool", "content": str}`; an assistant
message may carry OpenAI-style calls of the python tool (its content may then be null)::

    "tool_calls": [{"type": "function",
                    "function": {"name": "python", "arguments": {"code": "print(2 + 2)"}}}]

(`arguments` may also be a JSON string, as in the OpenAI API.) A conversation is an optional
system message, a user message, then assistant turns; an assistant message with N tool calls
is followed by exactly N tool messages (their answers, in order), then by the assistant again;
an assistant message without calls may be followed by another user message. The last
message is the assistant's, without calls.

Rendering (`kubestar.training.tools`), so that SFT teaches exactly what RL rollouts parse:

* The system message becomes the instructions of `system_prompt`, so the python tool is always
  declared (no system message: the `instructions` given, by default the RL rollouts' own).
* Prompt: the system turn, the first user turn and `<|im_start|>assistant\\n` (`render_prompt`).
* An assistant turn is its content, then one `format_tool_call` block per call. RL generation
  stops at the first `</tool_call>`, so a message with several calls becomes that many turns,
  each ending at its call and answered by its own tool turn (`render_tool_turn`: the
  `<|im_end|>` that closes the turn, a user turn with the `<tool_response>`, and the opening
  of the next assistant turn). A turn without calls ends with the model's `<|im_end|>`; a later
  user message follows it as a user turn and opens the next assistant turn.
* Tokens: segment by segment as the agent loop encodes them. Loss mask 1 on what the assistant
  writes (its text and `<tool_call>` blocks, and the `<|im_end|>` that ends a turn without
  calls); 0 on tool responses, later user turns and the `<|im_end|>` that closes a turn ending
  in a call (the agent loop adds that one itself).

A conversation longer than `max_tokens` (prompt included) is dropped and counted; when none
is left an error says so. Malformed input raises `SftFileError` with one line naming the file,
the line and what is wrong.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubestar.api.errors import KubestarError
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import json_lines
from kubestar.training.sft_data import SftExample, format_tool_call
from kubestar.training.tools import (
    DEFAULT_INSTRUCTIONS,
    IM_END,
    IM_START,
    PENDING,
    PYTHON_TOOL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    chatml,
    parse_tool_calls,
    render_prompt,
    render_tool_turn,
    system_prompt,
)

log = logging.getLogger(__name__)

SYSTEM, USER, ASSISTANT, TOOL = "system", "user", "assistant", "tool"
ROLES = (SYSTEM, USER, ASSISTANT, TOOL)
FAMILY = "file"
SPEC_FIELD = "spec.sft.dataset.path"


class SftFileError(KubestarError, ValueError):
    """An SFT file that cannot be read as conversations. The message is one line naming the
    file, the line (counted from 1) and what is wrong."""


@dataclass
class SftFile:
    """What `load_sft_file` read: the examples and how many conversations were left out."""

    examples: list[SftExample]
    conversations: int  # conversations read, kept or dropped
    dropped_too_long: int


@dataclass(frozen=True)
class _Message:
    role: str
    content: str
    codes: tuple[str, ...] = ()  # the python calls of an assistant message


@dataclass(frozen=True)
class _Piece:
    """A segment of the response, tokenized on its own as the agent loop does."""

    text: str
    assistant: bool  # written by the model: loss mask 1
    closes_turn: bool = False  # the model's end-of-turn token follows the text


@dataclass
class _Conversation:
    system: str | None
    question: str
    pieces: list[_Piece] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)


# -- reading messages ---------------------------------------------------------------------------
def _call_code(call: Any, where: str) -> str:
    """The code of one entry of `tool_calls` (`where` names the message and the call)."""
    if not isinstance(call, Mapping):
        raise SftFileError(f"{where} is not an object")
    kind = call.get("type", "function")
    if kind != "function":
        raise SftFileError(f"{where} has type {kind!r}; only function calls are read")
    # OpenAI nests the call under "function"; a flat {"name", "arguments"} is read as well.
    function = call.get("function", call)
    if not isinstance(function, Mapping):
        raise SftFileError(f'{where}: "function" is not an object')
    name = function.get("name")
    if name != PYTHON_TOOL:
        raise SftFileError(f"{where} names the tool {name!r}; only {PYTHON_TOOL!r} is declared")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise SftFileError(f"{where}: arguments is a string but not JSON ({exc})") from exc
    code = arguments.get("code") if isinstance(arguments, Mapping) else None
    if not isinstance(code, str) or not code.strip():
        raise SftFileError(f'{where}: arguments without a non-empty string "code"')
    # What RL parses back must be this very code: a tag inside the code would end the call
    # early (and `</tool_call>` stops generation there).
    for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        if tag in code:
            raise SftFileError(f"{where}: the code holds {tag}, which ends a tool call early")
    parsed = parse_tool_calls(format_tool_call(code))
    if len(parsed) != 1 or parsed[0].status != PENDING or parsed[0].code != code:
        raise SftFileError(f"{where}: the code does not parse back from a tool call")
    return code


def _message(value: Any, where: str) -> _Message:
    if not isinstance(value, Mapping):
        raise SftFileError(f"{where} is not an object")
    role = value.get("role")
    if role not in ROLES:
        raise SftFileError(f"{where}: unknown role {role!r} (one of {', '.join(ROLES)})")
    where = f"{where} ({role})"
    calls = value.get("tool_calls") or []
    if calls and role != ASSISTANT:
        raise SftFileError(f"{where} has tool_calls; only assistant messages make calls")
    if not isinstance(calls, list):
        raise SftFileError(f"{where}: tool_calls is not a list")
    content = value.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise SftFileError(f"{where}: content is not a string")
    for marker in (IM_START, IM_END):
        if marker in content:
            raise SftFileError(f"{where}: the content holds the chat marker {marker}")
    if role == ASSISTANT:
        for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
            if tag in content:
                raise SftFileError(f"{where}: the content holds {tag}; give calls in tool_calls")
        if not calls and not content.strip():
            raise SftFileError(f"{where}: no content and no tool calls")
    codes = tuple(_call_code(call, f"{where} tool call {i}") for i, call in enumerate(calls, 1))
    return _Message(role, content, codes)


def _assistant_text(content: str, code: str) -> str:
    """A turn that ends in a call: its text (if any) on the lines before the call."""
    if not content.strip():
        return format_tool_call(code)
    separator = "" if content.endswith("\n") else "\n"
    return f"{content}{separator}{format_tool_call(code)}"


def _conversation(record: Mapping[str, Any], where: str) -> _Conversation:
    """The turns of one conversation (see the module docstring for the rules)."""
    values = record.get("messages")
    if not isinstance(values, list) or not values:
        raise SftFileError(f'{where}: no messages (a non-empty "messages" list)')
    messages = [_message(v, f"{where}: message {i}") for i, v in enumerate(values, 1)]
    position = 0
    system = None
    if messages[0].role == SYSTEM:
        system, position = messages[0].content, 1
    if position >= len(messages) or messages[position].role != USER:
        found = messages[position].role if position < len(messages) else "nothing"
        raise SftFileError(
            f"{where}: a conversation starts with a user message (after an optional system "
            f"message), not {found}"
        )
    conversation = _Conversation(system, messages[position].content)
    position += 1
    if position == len(messages):
        raise SftFileError(f"{where}: no assistant message")
    while position < len(messages):
        number = position + 1
        message = messages[position]
        if message.role != ASSISTANT:
            before = messages[position - 1].role
            if message.role == SYSTEM:
                problem = "a system message is only read first"
            elif message.role == TOOL:
                problem = "a tool message with no tool call before it"
            elif before == TOOL:
                problem = "a user message right after tool responses (the assistant answers them)"
            else:
                problem = "two user messages in a row"
            raise SftFileError(f"{where}: message {number} ({message.role}): {problem}")
        position += 1
        if not message.codes:
            conversation.pieces.append(_Piece(message.content, assistant=True, closes_turn=True))
            if position == len(messages):
                break
            following = messages[position]
            if following.role == USER:
                # The model closed its turn with <|im_end|>; the newline and the user's turn
                # are context, and the next assistant turn opens.
                text = "\n" + chatml(USER, following.content) + f"{IM_START}{ASSISTANT}\n"
                conversation.pieces.append(_Piece(text, assistant=False))
                position += 1
                if position == len(messages):
                    raise SftFileError(
                        f"{where}: the conversation ends with a user message; the last message "
                        "is the assistant's"
                    )
            elif following.role == ASSISTANT:
                raise SftFileError(
                    f"{where}: message {position + 1} (assistant): two assistant messages in a row"
                )
            continue
        answers: list[str] = []
        while position < len(messages) and messages[position].role == TOOL:
            answers.append(messages[position].content)
            position += 1
        if len(answers) != len(message.codes):
            raise SftFileError(
                f"{where}: message {number} (assistant) makes {len(message.codes)} tool "
                f"call(s) but {len(answers)} tool message(s) follow it"
            )
        for index, (code, answer) in enumerate(zip(message.codes, answers, strict=True)):
            text = _assistant_text(message.content if index == 0 else "", code)
            conversation.pieces.append(_Piece(text, assistant=True))
            # The turn stopped at </tool_call>: the loop closes it, as in RL.
            tool_turn = render_tool_turn([answer], model_closed_turn=False)
            conversation.pieces.append(_Piece(tool_turn, assistant=False))
        conversation.codes += message.codes
        conversation.responses += answers
        if position == len(messages):
            raise SftFileError(
                f"{where}: the conversation ends with tool responses; the assistant's answer "
                "to them is missing"
            )
    return conversation


# -- tokens -------------------------------------------------------------------------------------
def _example(
    conversation: _Conversation,
    tokenizer: ChatTokenizer,
    instructions: str,
    example_id: str,
    metadata: dict[str, Any],
) -> SftExample:
    system = conversation.system if conversation.system is not None else instructions
    prompt_text = render_prompt(conversation.question, system_prompt(system))
    response_ids: list[int] = []
    response_mask: list[int] = []
    assistant_turns: list[str] = []
    for piece in conversation.pieces:
        ids = tokenizer.encode(piece.text)
        if piece.closes_turn:
            ids.append(tokenizer.eos_id)
        response_ids += ids
        response_mask += [int(piece.assistant)] * len(ids)
        if piece.assistant:
            assistant_turns.append(piece.text + (tokenizer.eos_token if piece.closes_turn else ""))
    return SftExample(
        id=example_id,
        family=FAMILY,
        question=conversation.question,
        answer="",
        prompt_ids=tokenizer.encode(prompt_text),
        response_ids=response_ids,
        response_mask=response_mask,
        prompt_text=prompt_text,
        assistant_turns=assistant_turns,
        tool_codes=list(conversation.codes),
        tool_responses=list(conversation.responses),
        tool_statuses=[],  # not run here: the file's tool responses are taken as written
        metadata=metadata,
    )


def _records(file: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(line number, object) of every non-blank line."""
    if not file.exists():
        raise SftFileError(f"{SPEC_FIELD}: {file} does not exist in the trainer's container")
    if not file.is_file():
        raise SftFileError(f"{SPEC_FIELD}: {file} is not a file")
    try:
        for number, value in json_lines(file, SftFileError):
            if not isinstance(value, Mapping):
                raise SftFileError(
                    f"{file}:{number}: not an object with messages but {value!r:.60}"
                )
            yield number, value
    except OSError as exc:
        raise SftFileError(f"{SPEC_FIELD}: {file} cannot be read: {exc.strerror or exc}") from exc


def load_sft_file(
    path: str | Path,
    tokenizer: ChatTokenizer,
    limit: int | None,
    max_tokens: int,
    instructions: str = DEFAULT_INSTRUCTIONS,
) -> SftFile:
    """The first `limit` conversations of `path` that fit `max_tokens` (None: all of them) as
    examples, and how many were dropped as too long (see the module docstring).

    `instructions`: the system prompt's instructions for a conversation without a system
    message (use the RL rollouts' so the prompts match).
    """
    file = Path(path)
    examples: list[SftExample] = []
    read = dropped = 0
    shortest = 0
    for number, record in _records(file):
        if limit is not None and len(examples) >= limit:
            break
        where = f"{file}:{number}"
        conversation = _conversation(record, where)
        read += 1
        example = _example(
            conversation, tokenizer, instructions, where, {"path": str(file), "line": number}
        )
        if example.tokens > max_tokens:
            dropped += 1
            shortest = min(shortest or example.tokens, example.tokens)
            log.debug("sft conversation %s dropped: %d tokens", where, example.tokens)
            continue
        examples.append(example)
    if dropped:
        log.info(
            "sft conversations dropped as longer than max_tokens",
            extra={"fields": {"path": str(file), "dropped": dropped, "max_tokens": max_tokens}},
        )
    if not examples:
        if not read:
            raise SftFileError(f"{file}: no conversations (the file has no JSON lines)")
        raise SftFileError(
            f"{file}: none of its {read} conversation(s) fits spec.sft.maxTokens {max_tokens} "
            f"(the shortest takes {shortest} tokens, prompt included)"
        )
    return SftFile(examples=examples, conversations=read, dropped_too_long=dropped)


def read_sft_file(
    path: str | Path,
    tokenizer: ChatTokenizer,
    limit: int | None,
    max_tokens: int,
    instructions: str = DEFAULT_INSTRUCTIONS,
) -> list[SftExample]:
    """The examples of `load_sft_file` (without the count of dropped conversations)."""
    return load_sft_file(path, tokenizer, limit, max_tokens, instructions).examples
