"""Reading steps in rStar-Math's format and in kubestar's tool-call format; replaying code."""

from __future__ import annotations

import json

from kubestar.search.steps import (
    ParsedStep,
    RStarFormat,
    StepKind,
    ToolCallFormat,
    new_output,
    replay,
)
from kubestar.search.tree import Node, add_children


def chain(*codes: str) -> list[Node]:
    node = Node.root()
    nodes = []
    for index, code in enumerate(codes):
        (node,) = add_children(node, [(f"step {index}", ())])
        node.code = code
        nodes.append(node)
    return nodes


def test_replayed_program_of_a_three_step_chain() -> None:
    first, second, third = chain("a = 1", "b = a + 1", "print(a + b)")
    assert replay(first) == "a = 1"
    assert replay(second) == "a = 1\nb = a + 1"
    assert replay(third) == "a = 1\nb = a + 1\nprint(a + b)"


def test_replay_leaves_out_an_ancestor_whose_code_failed() -> None:
    _, broken, repair = chain("a = 1", "b = a / 0", "b = a + 1\nprint(b)")
    broken.code_failed = True
    assert replay(repair) == "a = 1\nb = a + 1\nprint(b)"


def test_rstar_code_steps() -> None:
    rstar = RStarFormat()
    first = "<code>\n# Step 1: the total weight\ntotal = 2 * 20 * 12\n<end_of_step>"
    assert rstar.parse(first) == ParsedStep(
        StepKind.CODE, code="# Step 1: the total weight\ntotal = 2 * 20 * 12"
    )
    last = "\n\n# Now print the final answer\nprint(total / 30)\n<end_of_code>"
    assert rstar.parse(last).code == "# Now print the final answer\nprint(total / 30)"
    assert rstar.parse("<code>x = 1<end_of_step>").code == "x = 1"
    assert set(rstar.stops) == {"<end_of_step>", "<end_of_code>", "<end_of_answer>"}


def test_rstar_answer_and_unparsable_steps() -> None:
    rstar = RStarFormat()
    answer = "<output>16.0<end_of_output><answer>So he lifts \\boxed{16} times.\n<end_of_answer>"
    assert rstar.parse(answer) == ParsedStep(StepKind.ANSWER, answer="16")
    assert rstar.parse("\n<end_of_step>").kind is StepKind.UNPARSABLE
    assert rstar.parse("the boxed answer is missing").kind is StepKind.UNPARSABLE


def test_rstar_observation_closes_the_program() -> None:
    rstar = RStarFormat()
    middle, last = chain("x = 2", "print(x * 8)")
    middle.text, last.text = "x = 2\n<end_of_step>", "print(x * 8)\n<end_of_code>"
    last.output = "16\n"
    assert rstar.observation(middle, failed=False) == ""
    assert rstar.observation(last, failed=False) == "\n<output>16<end_of_output>"
    middle.output = "NameError: name 'y' is not defined"
    assert rstar.observation(middle, failed=True) == (
        "\n<output>NameError: name 'y' is not defined<end_of_output>"
    )


def tool_turn(code: str) -> str:
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"Let me compute it.\n<tool_call>\n{body}\n</tool_call>"


def test_tool_call_steps() -> None:
    tools = ToolCallFormat()
    assert tools.parse(tool_turn("print(6 * 7)")) == ParsedStep(StepKind.CODE, code="print(6 * 7)")
    assert tools.parse("So the answer is \\boxed{42}.<|im_end|>") == ParsedStep(
        StepKind.ANSWER, answer="42"
    )
    assert tools.parse("<tool_call>\n{not json}\n</tool_call>").kind is StepKind.UNPARSABLE
    assert tools.parse("I am not sure.<|im_end|>").kind is StepKind.UNPARSABLE
    assert tools.stops == ("</tool_call>",)
    assert tools.prompt("What is 6 * 7?").endswith(
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_call_observation_shows_what_this_step_printed() -> None:
    tools = ToolCallFormat()
    first, second = chain("a = 6\nprint(a)", "print(a * 7)")
    second.text = tool_turn("print(a * 7)")
    first.output, second.output = "6\n", "6\n42\n"
    assert new_output(second) == "42\n"
    assert tools.observation(second, failed=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    second.output = "6\n"
    assert "(no output: print() the values you want to see)" in tools.observation(second, False)
