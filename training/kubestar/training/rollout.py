"""The agent loop: trajectories of reasoning, Python tool calls and answers, thousands at once.

One trajectory::

    prompt = system (declares the python tool) + user (the problem) + "<|im_start|>assistant\\n"
    repeat:
        generate until </tool_call>, the end of the turn (<|im_end|>) or the length budget
        no tool call in the turn      -> finished: answered (\\boxed{}) or no_answer
        cut off by the length budget  -> finished: max_length (an unclosed call is `truncated`)
        the last allowed turn          -> finished: max_turns (its calls are `skipped`)
        parse the call(s); run the valid ones in the sandbox (a malformed one is answered
        with what was wrong); append the tool turn:
            [<|im_end|>]\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
            <|im_start|>assistant\\n
        if the response has no room left -> finished: max_length

Token ownership: what the generator returned is the model's (mask 1, its log-probabilities);
what the loop inserted (the tool turn, including the `<|im_end|>` that closes a turn stopped
at `</tool_call>`) is the tool's (mask 0, log-probability 0). `max_response_tokens` counts
both. The context sent to the generator is always prompt_ids + response_ids: the model's
tokens are never re-tokenized.

Every trajectory is a coroutine. Generation and tool calls are awaited per trajectory, so a
slow tool call (or a slow turn) holds up only its own trajectory; the tool calls of all
trajectories share one connection to the sandbox (see executors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kubestar.sandbox.client import Call
from kubestar.sandbox.metrics import status_label
from kubestar.sandbox.retries import internal_result
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem
from kubestar.training.executors import ToolExecutor
from kubestar.training.generators import LENGTH, Generation, GenerationError, Generator, Sampling
from kubestar.training.rewards import RewardScorer
from kubestar.training.tools import (
    DEFAULT_INSTRUCTIONS,
    PARSE_ERRORS,
    PENDING,
    SKIPPED,
    TRUNCATED,
    ParsedCall,
    extract_boxed,
    parse_tool_calls,
    render_prompt,
    render_result,
    render_tool_turn,
    system_prompt,
)
from kubestar.training.trajectory import (
    ANSWERED,
    ERROR,
    MAX_LENGTH,
    MAX_TURNS,
    MODEL,
    NO_ANSWER,
    TOOL,
    Segment,
    ToolCallRecord,
    Trajectory,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    max_turns: int = 10  # model turns (generations) per trajectory
    max_response_tokens: int = 4096  # model + tool tokens after the prompt
    # The engine's context length (prompt + response); 0 when unknown.
    max_context_tokens: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    # Sandbox limits per call (0: the sandbox's defaults).
    tool_timeout_seconds: float = 0.0
    tool_memory_bytes: int = 0
    tool_output_bytes: int = 0
    # Characters of a tool's output the model reads (head and tail kept).
    max_tool_response_chars: int = 2048
    max_calls_per_turn: int = 4
    instructions: str = DEFAULT_INSTRUCTIONS
    user_template: str = "{question}"  # "{question}" is replaced (no other formatting)
    # Trajectories in flight at once (the rest wait for a slot).
    max_concurrency: int = 4096


class AgentLoop:
    def __init__(
        self,
        generator: Generator,
        tools: ToolExecutor,
        tokenizer: ChatTokenizer,
        config: RolloutConfig | None = None,
    ) -> None:
        self.generator = generator
        self.tools = tools
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.system = system_prompt(self.config.instructions)

    def prompt(self, question: str) -> str:
        return render_prompt(self.config.user_template.replace("{question}", question), self.system)

    def _turn_sampling(self, trajectory_id: str, turn: int) -> Sampling:
        sampling = self.config.sampling
        if not sampling.seed:
            return sampling
        digest = hashlib.blake2b(f"{sampling.seed}/{trajectory_id}/{turn}".encode(), digest_size=4)
        return replace(sampling, seed=int.from_bytes(digest.digest(), "big") & 0x7FFFFFFF or 1)

    async def run_trajectory(
        self, problem: Problem, sample_index: int = 0, trajectory_id: str = ""
    ) -> Trajectory:
        started = time.monotonic()
        prompt_text = self.prompt(problem.question)
        trajectory = Trajectory(
            id=trajectory_id or f"{problem.id}-{sample_index}-{uuid.uuid4().hex[:8]}",
            problem_id=problem.id,
            sample_index=sample_index,
            question=problem.question,
            reference=problem.answer,
            prompt_ids=self.tokenizer.encode(prompt_text),
            prompt_text=prompt_text,
        )
        try:
            await self._run(trajectory)
        except GenerationError as exc:
            trajectory.finish_reason = ERROR
            trajectory.error = str(exc)
        except Exception as exc:  # one broken trajectory must not end a rollout of thousands
            log.exception("trajectory failed", extra={"fields": {"trajectory": trajectory.id}})
            trajectory.finish_reason = ERROR
            trajectory.error = f"{type(exc).__name__}: {exc}"
        finally:
            trajectory.wall_s = time.monotonic() - started
            with contextlib.suppress(Exception):  # affinity bookkeeping only
                await self.generator.end_trajectory(trajectory.id)
        return trajectory

    def _room(self, trajectory: Trajectory) -> int:
        config = self.config
        room = config.max_response_tokens - len(trajectory.response_ids)
        if config.max_context_tokens:
            used = len(trajectory.prompt_ids) + len(trajectory.response_ids)
            room = min(room, config.max_context_tokens - used)
        return room

    def _append(
        self,
        trajectory: Trajectory,
        owner: str,
        ids: list[int],
        logprobs: list[float] | None,
        turn: int,
        generation: Generation | None = None,
        latency: float = 0.0,
    ) -> Segment:
        start = len(trajectory.response_ids)
        trajectory.response_ids += ids
        trajectory.response_mask += [1 if owner == MODEL else 0] * len(ids)
        if logprobs is not None and len(logprobs) == len(ids):
            trajectory.response_logprobs += [float(x) for x in logprobs]
        else:
            trajectory.response_logprobs += [0.0] * len(ids)
            if owner == MODEL and self.config.sampling.logprobs:
                trajectory.metadata["missing_logprobs"] = True
        segment = Segment(
            owner=owner,
            turn=turn,
            start=start,
            end=len(trajectory.response_ids),
            text=self.tokenizer.decode(ids),
            latency_s=latency,
        )
        if generation is not None:
            segment.finish_reason = generation.finish_reason
            segment.stop_reason = generation.stop_reason
            segment.engine = generation.engine
            segment.weights_version = generation.weights_version
        trajectory.segments.append(segment)
        return segment

    def _record(self, trajectory: Trajectory, turn: int, call: ParsedCall, status: str) -> None:
        trajectory.tool_calls.append(
            ToolCallRecord(
                turn=turn,
                index=len(trajectory.tool_calls),
                status=status,
                name=call.name,
                code=call.code,
                raw=call.raw,
                response=call.error if status in PARSE_ERRORS else "",
            )
        )

    async def _run(self, trajectory: Trajectory) -> None:
        config = self.config
        turn = 0
        while True:
            room = self._room(trajectory)
            if room <= 0:
                trajectory.finish_reason = MAX_LENGTH
                return
            context = trajectory.prompt_ids + trajectory.response_ids
            sampling = self._turn_sampling(trajectory.id, turn)
            began = time.monotonic()
            generation = await self.generator.generate(trajectory.id, context, room, sampling)
            latency = time.monotonic() - began
            trajectory.generate_s += latency
            ids = list(generation.token_ids[:room])
            logprobs = generation.logprobs[: len(ids)] if generation.logprobs else None
            segment = self._append(
                trajectory, MODEL, ids, logprobs, turn, generation, latency=latency
            )
            trajectory.num_turns = turn + 1
            trajectory.boxed_answers += extract_boxed(segment.text)
            cut = generation.finish_reason == LENGTH or len(generation.token_ids) > room
            calls = parse_tool_calls(
                segment.text, truncated=cut, max_calls=config.max_calls_per_turn
            )
            if cut:
                for call in calls:
                    status = TRUNCATED if call.status == TRUNCATED else SKIPPED
                    self._record(trajectory, turn, call, status)
                trajectory.finish_reason = MAX_LENGTH
                return
            if not calls:
                answers = trajectory.boxed_answers
                trajectory.answer = answers[-1] if answers else None
                trajectory.finish_reason = ANSWERED if answers else NO_ANSWER
                return
            last_turn = turn + 1 >= config.max_turns
            if last_turn or self._room(trajectory) <= 0:
                for call in calls:
                    self._record(trajectory, turn, call, SKIPPED)
                trajectory.finish_reason = MAX_TURNS if last_turn else MAX_LENGTH
                return
            responses = await self._run_calls(trajectory, turn, calls)
            closed = bool(ids) and ids[-1] == self.tokenizer.eos_id
            tool_ids = self.tokenizer.encode(render_tool_turn(responses, model_closed_turn=closed))
            room = self._room(trajectory)
            self._append(trajectory, TOOL, tool_ids[:room], None, turn)
            turn += 1
            if len(tool_ids) >= room:
                trajectory.finish_reason = MAX_LENGTH
                return

    async def _run_calls(
        self, trajectory: Trajectory, turn: int, calls: list[ParsedCall]
    ) -> list[str]:
        config = self.config
        first = len(trajectory.tool_calls)
        for call in calls:
            self._record(trajectory, turn, call, call.status)
        runnable = [(first + i, call) for i, call in enumerate(calls) if call.status == PENDING]

        async def run(index: int, call: ParsedCall) -> None:
            record = trajectory.tool_calls[index]
            began = time.monotonic()
            try:
                result = await self.tools.execute(
                    Call(
                        code=call.code,
                        timeout_seconds=config.tool_timeout_seconds,
                        memory_bytes=config.tool_memory_bytes,
                        output_bytes=config.tool_output_bytes,
                    )
                )
            except Exception as exc:  # the executor's fault, not the code's
                result = internal_result("", f"{type(exc).__name__}: {exc}")
            record.latency_s = time.monotonic() - began
            record.status = status_label(result.status)
            record.stdout = result.stdout
            record.stderr = result.stderr
            record.exit_code = result.exit_code
            record.message = result.message
            record.wall_ms = result.wall_ms
            record.response = render_result(result, config.max_tool_response_chars)

        began = time.monotonic()
        await asyncio.gather(*(run(index, call) for index, call in runnable))
        trajectory.tool_s += time.monotonic() - began
        return [record.response for record in trajectory.tool_calls[first:]]

    async def run_many(
        self,
        problems: Sequence[Problem],
        samples: int = 1,
        on_done: Callable[[Trajectory], Awaitable[None] | None] | None = None,
        run_id: str = "",
    ) -> list[Trajectory]:
        """Every problem `samples` times, all concurrently (up to max_concurrency in flight).

        Results are in problem order, samples of a problem together. `on_done` is called as
        each trajectory finishes (e.g. to score it, or to move a progress bar).
        """
        run_id = run_id or uuid.uuid4().hex[:8]
        slots = asyncio.Semaphore(self.config.max_concurrency)

        async def one(problem_index: int, problem: Problem, sample: int) -> Trajectory:
            async with slots:
                trajectory = await self.run_trajectory(
                    problem, sample, f"{run_id}-{problem_index}-{sample}"
                )
            if on_done is not None:
                maybe = on_done(trajectory)
                if maybe is not None:
                    await maybe
            return trajectory

        return list(
            await asyncio.gather(
                *(
                    one(index, problem, sample)
                    for index, problem in enumerate(problems)
                    for sample in range(samples)
                )
            )
        )


@dataclass
class RolloutStats:
    trajectories: int
    problems: int
    samples: int
    accuracy: float  # mean reward
    pass_at_samples: float  # problems with at least one correct sample
    finish_reasons: dict[str, int]
    tool_calls_per_trajectory: float
    tool_calls: int
    tool_errors: int
    tool_error_rate: float
    tool_statuses: dict[str, int]
    mean_turns: float
    response_tokens_mean: float
    response_tokens_p50: float
    response_tokens_max: int
    model_tokens: int
    tool_tokens: int
    wall_s: float
    trajectories_per_s: float
    tokens_per_s: float  # response tokens (model + tool) per second
    generated_tokens_per_s: float  # model tokens per second
    errors: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(trajectories: Sequence[Trajectory], wall_s: float) -> RolloutStats:
    n = len(trajectories)
    lengths = [t.response_length for t in trajectories] or [0]
    rewards = [t.reward or 0.0 for t in trajectories]
    by_problem: dict[str, bool] = {}
    for t in trajectories:
        by_problem[t.problem_id] = by_problem.get(t.problem_id, False) or (t.reward or 0) > 0
    calls = sum(t.num_tool_calls for t in trajectories)
    errors = sum(t.num_tool_errors for t in trajectories)
    statuses = Counter(c.status for t in trajectories for c in t.tool_calls)
    model_tokens = sum(t.model_tokens for t in trajectories)
    tool_tokens = sum(t.tool_tokens for t in trajectories)
    wall = max(wall_s, 1e-9)
    return RolloutStats(
        trajectories=n,
        problems=len(by_problem),
        samples=round(n / len(by_problem)) if by_problem else 0,
        accuracy=sum(rewards) / n if n else 0.0,
        pass_at_samples=sum(by_problem.values()) / len(by_problem) if by_problem else 0.0,
        finish_reasons=dict(Counter(t.finish_reason for t in trajectories)),
        tool_calls_per_trajectory=calls / n if n else 0.0,
        tool_calls=calls,
        tool_errors=errors,
        tool_error_rate=errors / calls if calls else 0.0,
        tool_statuses=dict(statuses),
        mean_turns=sum(t.num_turns for t in trajectories) / n if n else 0.0,
        response_tokens_mean=sum(lengths) / len(lengths),
        response_tokens_p50=float(statistics.median(lengths)),
        response_tokens_max=max(lengths),
        model_tokens=model_tokens,
        tool_tokens=tool_tokens,
        wall_s=wall_s,
        trajectories_per_s=n / wall,
        tokens_per_s=(model_tokens + tool_tokens) / wall,
        generated_tokens_per_s=model_tokens / wall,
        errors=sum(1 for t in trajectories if t.finish_reason == ERROR),
    )


async def rollout(
    loop: AgentLoop,
    problems: Sequence[Problem],
    samples: int,
    scorer: RewardScorer | None = None,
    on_done: Callable[[Trajectory], None] | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """Run and score N problems x `samples` trajectories; the trajectories and their stats."""
    started = time.monotonic()

    async def done(trajectory: Trajectory) -> None:
        if scorer is not None:
            await scorer.score_trajectory(trajectory)
        if on_done is not None:
            on_done(trajectory)

    trajectories = await loop.run_many(problems, samples, on_done=done)
    return trajectories, summarize(trajectories, time.monotonic() - started)
