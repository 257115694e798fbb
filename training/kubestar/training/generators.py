"""Where the agent loop gets its tokens: one turn of generation for a trajectory.

`Generator` has the shape of the rollout scheduler's Generate RPC (see
protos/kubestar/v1/rollout.proto). Implementations:

* `SchedulerGenerator`: the KV-aware rollout scheduler (gRPC) in front of a fleet of engines.
* `EngineGenerator`: one vLLM engine directly (a laptop, tests).
* `ScriptedGenerator`: prepared text per turn, for tests and demos of the loop's mechanics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import grpc
from kubestar.engine.client import EngineClient
from kubestar.training.chat import ChatTokenizer
from kubestar.training.tools import TOOL_CALL_CLOSE
from kubestar.v1 import rollout_pb2 as rpb

STOP = "stop"
LENGTH = "length"


class GenerationError(RuntimeError):
    """A turn could not be generated (engine or scheduler failure)."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Generation also stops at the tokenizer's end of turn (the engine's EOS).
    stop: tuple[str, ...] = (TOOL_CALL_CLOSE,)
    seed: int = 0  # 0: unseeded
    logprobs: bool = True


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # STOP (end of turn or a stop string) | LENGTH (max_new_tokens)
    stop_reason: str = ""  # the stop string that ended it, if any
    logprobs: list[float] = field(default_factory=list)
    engine: str = ""
    weights_version: int = 0


class Generator(Protocol):
    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation: ...

    async def end_trajectory(self, trajectory_id: str) -> None: ...

    async def close(self) -> None: ...


class EngineGenerator:
    """One vLLM engine's OpenAI-compatible server, called with token ids."""

    def __init__(self, url: str, name: str = "", timeout: float = 600.0) -> None:
        self.client = EngineClient(url, timeout=timeout)
        self.name = name or url

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation:
        from kubestar.engine.client import EngineError

        try:
            completion = await self.client.complete(
                list(prompt_token_ids),
                max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop=list(sampling.stop),
                seed=sampling.seed or None,
                logprobs=sampling.logprobs,
            )
        except EngineError as exc:
            raise GenerationError(str(exc)) from exc
        return Generation(
            token_ids=completion.token_ids,
            text=completion.text,
            finish_reason=LENGTH if completion.finish_reason == LENGTH else STOP,
            stop_reason=completion.stop_reason,
            logprobs=completion.logprobs,
            engine=self.name,
        )

    async def max_model_len(self) -> int:
        """The engine's context length (from /v1/models), 0 when it does not say."""
        try:
            async with self.client._client().get(f"{self.client.url}/v1/models") as response:
                if response.status != 200:
                    return 0
                models = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return 0
        for model in models.get("data") or []:
            value = model.get("max_model_len")
            if isinstance(value, int):
                return value
        return 0

    async def end_trajectory(self, trajectory_id: str) -> None:
        return None

    async def close(self) -> None:
        await self.client.close()


_FINISH = {rpb.FINISH_REASON_LENGTH: LENGTH, rpb.FINISH_REASON_STOP: STOP}


def to_sampling_params(sampling: Sampling) -> rpb.SamplingParams:
    return rpb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop),
        seed=sampling.seed,
        logprobs=sampling.logprobs,
    )


def from_response(response: rpb.GenerateResponse) -> Generation:
    return Generation(
        token_ids=list(response.token_ids),
        text=response.text,
        finish_reason=_FINISH.get(response.finish_reason, STOP),
        stop_reason=response.stop_reason,
        logprobs=list(response.logprobs),
        engine=response.engine,
        weights_version=response.weights_version,
    )


class SchedulerGenerator:
    """The rollout scheduler's Generate RPC, through `kubestar.scheduler.client`."""

    def __init__(self, endpoint: str, timeout: float | None = 900.0) -> None:
        from kubestar.scheduler.client import SchedulerClient

        self.endpoint = endpoint
        self.client = SchedulerClient(endpoint, timeout=timeout)
        # The weights version the trainer last pushed (None: not pushed yet). A turn served
        # by weights older than those pushed when it was sent (a scheduler restarted
        # mid-rollout, with none or older ones) is an infrastructure failure: its trajectory
        # is left out rather than trained on. A turn sent before a push may finish on the
        # weights it began with (algorithm.maxStaleness: rollouts run across pushes).
        self.expected_weights_version: int | None = None

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation:
        expected = self.expected_weights_version  # when sent: a push may come meanwhile
        try:
            response = await self.client.generate(
                trajectory_id, prompt_token_ids, max_new_tokens, to_sampling_params(sampling)
            )
        except grpc.RpcError as exc:
            raise GenerationError(f"scheduler {self.endpoint}: {exc}") from exc
        if expected is not None and response.weights_version < expected:
            raise GenerationError(
                f"scheduler {self.endpoint}: served by weights v{response.weights_version}, "
                f"not v{expected} (did it restart?)"
            )
        return from_response(response)

    async def end_trajectory(self, trajectory_id: str) -> None:
        # Affinity is only a hint: a lost EndTrajectory costs nothing but a stale entry.
        with contextlib.suppress(grpc.RpcError):
            await self.client.end_trajectory(trajectory_id)

    async def close(self) -> None:
        await self.client.close()


# What a script returns for one turn: the text the "model" writes. The generator applies
# the sampling's stop strings and max_new_tokens like an engine does; a turn that reaches
# neither ends with the end-of-turn token.
Script = Callable[[str, int, str], str | Awaitable[str]]


class ScriptedGenerator:
    """A stand-in model that writes prepared text: script(trajectory_id, turn, context).

    `turn` counts from 0 per trajectory; `context` is the decoded prompt so far. `delay`
    (seconds per turn, or a function of the trajectory id and turn) simulates generation time.
    Log-probabilities are a fixed -0.5 per token.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        script: Script,
        delay: float | Callable[[str, int], float] = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.delay = delay
        self.turns: dict[str, int] = {}
        self.calls: list[tuple[str, int, float]] = []  # (trajectory, turn, time) per generate
        self.ended: set[str] = set()
        self.active = 0
        self.max_active = 0

    async def generate(
        self,
        trajectory_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Generation:
        turn = self.turns.get(trajectory_id, 0)
        self.turns[trajectory_id] = turn + 1
        self.calls.append((trajectory_id, turn, time.monotonic()))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            delay = self.delay(trajectory_id, turn) if callable(self.delay) else self.delay
            if delay:
                await asyncio.sleep(delay)
            produced = self.script(trajectory_id, turn, self.tokenizer.decode(prompt_token_ids))
            text = produced if isinstance(produced, str) else await produced
        finally:
            self.active -= 1
        stop_reason = ""
        cut = len(text)
        for stop in sampling.stop:
            found = text.find(stop)
            if found >= 0 and found + len(stop) <= cut:
                cut, stop_reason = found + len(stop), stop
        ids = self.tokenizer.encode(text[:cut])
        if not stop_reason:
            ids.append(self.tokenizer.eos_id)
        finish = STOP
        if len(ids) > max_new_tokens:
            ids, finish, stop_reason = ids[:max_new_tokens], LENGTH, ""
        return Generation(
            token_ids=ids,
            text=self.tokenizer.decode(ids),
            finish_reason=finish,
            stop_reason=stop_reason,
            logprobs=[-0.5] * len(ids),
            engine="scripted",
        )

    async def end_trajectory(self, trajectory_id: str) -> None:
        self.ended.add(trajectory_id)

    async def close(self) -> None:
        return None
