"""Non-reasoning SFT: the synthetic examples (format, masks, REAL sandbox outputs) and a short
training run on a tiny model that lowers the loss.

The examples are built through the real agent loop and a real sandbox server; the checks
decode the masked tokens and compare them with the assistant turns, and re-run every tool
call through the sandbox to compare what the model reads with what the code prints.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox.client import SandboxClient
from kubestar.training.chat import ChatTokenizer
from kubestar.training.sft_data import (
    FINALS,
    INTROS,
    SftExample,
    agrees,
    build_sft_examples,
    format_tool_call,
    make_plans,
    plain_answer,
    write_examples,
)
from kubestar.training.tools import (
    IM_END,
    last_boxed,
    parse_tool_calls,
    render_prompt,
    render_result,
    render_tool_turn,
    system_prompt,
)
from kubestar.v1 import sandbox_pb2 as pb

from tests.real_parts import require_modules, tiny_model
from tests.sandbox.support import ThreadedServer
from tests.training.rollout_support import start_sandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[ThreadedServer]:
    server = start_sandbox(executors=4)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    """SmolLM2's tokenizer (the tiny test model carries it)."""
    return ChatTokenizer.from_model(tiny_model(hidden_size=64))


@pytest.fixture(scope="module")
def examples(sandbox: ThreadedServer, tokenizer: ChatTokenizer) -> list[SftExample]:
    return build_sft_examples(48, sandbox.endpoint, tokenizer, seed=3, error_fraction=0.3)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: (value, start, end)."""
    found: list[tuple[int, int, int]] = []
    start = 0
    for index in range(1, len(mask) + 1):
        if index == len(mask) or mask[index] != mask[start]:
            found.append((mask[start], start, index))
            start = index
    return found


def test_masked_tokens_are_exactly_the_assistant_turns(
    examples: list[SftExample], tokenizer: ChatTokenizer
) -> None:
    assert len(examples) == 48
    for example in examples:
        # The prompt is the RL prompt: system (tools declared), user, open assistant turn.
        assert example.prompt_text == render_prompt(example.question, system_prompt())
        assert tokenizer.decode(example.prompt_ids) == example.prompt_text
        assert len(example.response_ids) == len(example.response_mask)

        # The response alternates: turn 0, tool turn 0, turn 1, ..., the final turn. Tool
        # turns are exactly what the agent loop inserts after `</tool_call>`.
        calls = len(example.tool_codes)
        assert len(example.assistant_turns) == calls + 1
        tool_turns = [
            render_tool_turn([response], model_closed_turn=False)
            for response in example.tool_responses
        ]
        bug_turns = {turn for turn, status in enumerate(example.tool_statuses) if status == "error"}
        pieces = [
            (piece, index % 2 == 0 and index // 2 not in bug_turns)
            for index, piece in enumerate(
                part
                for pair in zip(example.assistant_turns, [*tool_turns, ""], strict=True)
                for part in pair
                if part
            )
        ]
        # Trained (mask 1): the assistant's turns, except one that sent a planted bug.
        expected: list[tuple[bool, str]] = []
        for piece, trained in pieces:
            if expected and expected[-1][0] == trained:
                expected[-1] = (trained, expected[-1][1] + piece)
            else:
                expected.append((trained, piece))
        decoded = [
            (value == 1, tokenizer.decode(example.response_ids[s:e]))
            for value, s, e in runs(example.response_mask)
        ]
        assert decoded == expected
        assert example.response_mask[-1] == 1
        assert (example.response_mask[0] == 1) == (not example.fixes_error)

        for turn, code in zip(example.assistant_turns, example.tool_codes, strict=False):
            # A call turn: one sentence, then exactly one well-formed call, ending the turn.
            assert turn.endswith(format_tool_call(code))
            parsed = parse_tool_calls(turn)
            assert len(parsed) == 1 and parsed[0].runnable and parsed[0].code == code
        assert example.assistant_turns[0].split("\n")[0] in INTROS
        final = example.assistant_turns[-1]
        assert final.endswith(IM_END) and "<tool_call>" not in final
        assert last_boxed(final) == example.answer

        # Mask 0 + mask 1 tile the whole sequence: nothing else was trained or hidden.
        rebuilt = example.prompt_text + "".join(piece for piece, _ in pieces)
        assert tokenizer.decode(example.prompt_ids + example.response_ids) == rebuilt


def test_tool_outputs_are_the_real_sandbox_outputs(
    examples: list[SftExample], sandbox: ThreadedServer
) -> None:
    with SandboxClient(sandbox.endpoint, timeout=120) as client:
        for example in examples:
            for code, response, status in zip(
                example.tool_codes, example.tool_responses, example.tool_statuses, strict=True
            ):
                result = client.execute(code)
                assert render_result(result) == response
                assert (status == "ok") == (result.status == pb.EXECUTION_STATUS_OK)
            # The final turn states what the last call printed, and it is the right answer.
            printed = example.tool_responses[-1].strip()
            assert printed in example.assistant_turns[-1]
            assert agrees(printed, example.answer)


def test_some_examples_read_an_error_and_fix_it(examples: list[SftExample]) -> None:
    fixing = [e for e in examples if e.fixes_error]
    assert len(fixing) >= 3
    for example in fixing:
        assert example.tool_statuses == ["error", "ok"]
        error = example.tool_responses[0]
        assert 'File "<tool_call>", line ' in error  # where it failed, as Python shows it
        last_line = error.strip().splitlines()[-1].strip()
        assert re.match(r"^(NameError|SyntaxError|TypeError): ", last_line)
        # The second turn quotes the real error, then calls the fixed code.
        assert f"`{last_line}`" in example.assistant_turns[1]
        assert example.tool_codes[0] != example.tool_codes[1]
    assert all(e.tool_statuses == ["ok"] for e in examples if not e.fixes_error)


def test_the_set_is_varied_and_reproducible(
    examples: list[SftExample], sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    families = Counter(e.family for e in examples)
    assert {"basic_arithmetic", "instruction"} <= set(families) and len(families) >= 4
    assert len({e.assistant_turns[0].split("\n")[0] for e in examples}) >= 3
    templates = {f.split("{")[0] for f in FINALS}
    assert len({t for t in templates for e in examples if e.assistant_turns[-1].startswith(t)}) >= 3
    assert len({e.question for e in examples}) == len(examples)
    again = build_sft_examples(48, sandbox.endpoint, tokenizer, seed=3, error_fraction=0.3)
    assert [(e.id, e.response_ids) for e in again] == [(e.id, e.response_ids) for e in examples]
    other = make_plans(20, seed=4)
    assert {p.problem.question for p in other} != {e.question for e in examples[:20]}


def test_dump_and_answers(examples: list[SftExample], tmp_path: Path) -> None:
    import json

    path = write_examples(examples[:5], tmp_path / "sft.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [e.id for e in examples[:5]]
    assert "response_ids" not in rows[0] and rows[0]["assistant_turns"]
    assert plain_answer("$244/607$") == "244/607"
    assert plain_answer("\\dfrac{184}{823}") == "184/823"
    assert agrees("23.0", "23") and agrees("-4", "-4") and not agrees("23.5", "23")
    assert agrees("nohtyp", "nohtyp") and not agrees("python", "nohtyp")


def test_too_small_a_token_budget_is_reported(
    sandbox: ThreadedServer, tokenizer: ChatTokenizer
) -> None:
    with pytest.raises(RuntimeError, match="prompt alone takes"):
        build_sft_examples(4, sandbox.endpoint, tokenizer, max_tokens=64)


def test_a_sandbox_that_does_not_answer_fails_the_build(tokenizer: ChatTokenizer) -> None:
    """A gRPC server that is no sandbox refuses every call at once (an address where nothing
    listens is asked again for about 25 s first: sandbox.client.RETRY_DELAYS); the build fails
    with the refusal instead of making examples whose tool turns say the sandbox failed."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(RuntimeError) as failed:
            build_sft_examples(2, f"127.0.0.1:{port}", tokenizer)
        # One line, naming the sandbox and the refusal.
        assert str(failed.value) == (
            f"the sandbox at 127.0.0.1:{port} did not answer: UNIMPLEMENTED: Method not found!"
        )
    finally:
        server.stop(grace=None)


# -- training -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_short_sft_run_lowers_the_loss(sandbox: ThreadedServer) -> None:
    require_modules("torch", "transformers")
    from kubestar.api.v1alpha1 import SftSpec
    from kubestar.training.policy import OptimizerConfig, Policy
    from kubestar.training.sft import run_sft

    model = tiny_model(hidden_size=64)
    policy = Policy(model, OptimizerConfig(learning_rate=1e-6), device="cpu", micro_batch_size=4)
    seen: list[tuple[str, int, int]] = []
    spec = SftSpec(examples=16, epochs=4, learning_rate=3e-3, batch_size=8, max_tokens=1024)
    metrics = run_sft(
        policy,
        model,
        spec,
        sandbox.endpoint,
        progress=lambda stage, step, total, m: seen.append((stage, step, total)),
    )
    assert metrics["examples"] == 16 and metrics["steps"] == 8 and metrics["seconds"] > 0
    assert metrics["tokens"] > 16 * 4 * 30  # assistant tokens only, over 4 epochs
    assert metrics["loss"] < metrics["first_epoch_loss"] < metrics["initial_loss"]
    assert seen == [("sft", step, 8) for step in range(1, 9)]
    # The RL optimizer is back: its learning rate, and no SFT moments.
    assert all(group["lr"] == 1e-6 for group in policy.optimizer.param_groups)
    assert not policy.optimizer.state
