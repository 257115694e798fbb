"""Infrastructure failures kept apart from the policy's mistakes: spoiled trajectories enter
no group and no tool-error count, and a step with too many is rolled out again (against a
real sandbox that is away for the first attempt) or fails the run."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import pytest
from aiohttp import web
from kubestar.api.conditions import ConditionStatus, ConditionType, Reason
from kubestar.api.trainer_contract import rollouts_condition, trainer_patch
from kubestar.api.v1alpha1 import ResilienceSpec, RolloutRetry, TrainingRunStatus
from kubestar.common.net import free_port
from kubestar.operator.trainingrun import reported_status
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.server import SchedulerServer, ServerConfig
from kubestar.training.datasets import Problem
from kubestar.training.executors import SandboxStreamExecutor
from kubestar.training.generators import (
    GenerationError,
    Sampling,
    SchedulerGenerator,
    ScriptedGenerator,
)
from kubestar.training.progress import set_rollouts_condition
from kubestar.training.resilience import (
    InfrastructureFailure,
    Retries,
    count_spoiled,
    ensure_weights,
    push_weights,
    rollout_step,
    with_retries,
)
from kubestar.training.rollout import AgentLoop, RolloutConfig, rollout
from kubestar.training.trainer import AlgorithmConfig, rollout_metrics, select_groups
from kubestar.training.trajectory import ANSWERED, ERROR, ToolCallRecord, Trajectory
from kubestar.v1 import rollout_pb2 as pb

from tests.sandbox.support import ThreadedServer
from tests.scheduler.conftest import fast_config
from tests.scheduler.fake_engine import FakeEngine
from tests.training.rollout_support import chat_tokenizer, start_sandbox, tool_call


def trajectory(
    name: str, reward: float, statuses: tuple[str, ...] = ("ok",), finish: str = ANSWERED
) -> Trajectory:
    made = Trajectory(name, "p0", 0, "q", "1", finish_reason=finish, reward=reward)
    made.tool_calls = [
        ToolCallRecord(turn=0, index=i, status=status, message=f"{status} message")
        for i, status in enumerate(statuses)
    ]
    made.boxed_answers = ["1"] if finish == ANSWERED else []
    return made


def test_what_spoils_a_trajectory() -> None:
    assert trajectory("a", 1.0, ("ok", "error", "timeout")).infra_failure == ""
    assert trajectory("b", 0.0, ("ok", "internal")).infra_failure == "sandbox-internal"
    assert trajectory("c", 0.0, ("queue-timeout",)).infra_failure == "sandbox-queue-timeout"
    failed = trajectory("d", 0.0, (), finish=ERROR)
    failed.error = "engine went away"
    assert failed.infra_failure == "generation" and failed.infra_error_text == "engine went away"


def test_the_sandboxs_failures_are_not_the_policys_tool_errors() -> None:
    mixed = trajectory("a", 1.0, ("ok", "error", "internal"))
    assert mixed.num_tool_calls == 3 and mixed.num_tool_errors == 1
    clean = trajectory("b", 0.0, ("ok", "error"))
    metrics = rollout_metrics([mixed, clean])
    # Only the clean trajectory speaks for the policy: 1 error in 2 calls, reward 0.
    assert metrics["spoiled"] == 1 and metrics["rollouts"] == 2
    assert metrics["tool_error_rate"] == 0.5 and metrics["reward"] == 0.0


@pytest.mark.parametrize("name", ["grpo-roc", "grpo"])
def test_spoiled_trajectories_enter_no_group(name: str) -> None:
    # The spoiled ones look like the best positives (reward 1, few calls): kept if counted.
    spoiled = [trajectory(f"s{i}", 1.0, ("internal",)) for i in range(4)]
    spoiled[0].finish_reason, spoiled[0].tool_calls = ERROR, []
    clean = [trajectory(f"c{i}", float(i % 2), ("ok", "error")) for i in range(4)]
    config = AlgorithmConfig(name=name, group_size=4, oversample_factor=2.0)
    (group,) = select_groups(spoiled + clean, config, random.Random(0))
    assert sorted(t.id for t in group) == ["c0", "c1", "c2", "c3"]


def test_a_group_thinned_to_one_reward_is_dropped() -> None:
    group = [trajectory("c0", 1.0), trajectory("c1", 1.0), trajectory("s0", 0.0, ("internal",))]
    assert select_groups(group, AlgorithmConfig(name="grpo", group_size=3), random.Random(0)) == []


class Attempts:
    """Rollouts whose spoiled share is given per attempt (the last repeats)."""

    def __init__(self, spoiled_per_attempt: list[int], size: int = 10) -> None:
        self.plan = spoiled_per_attempt
        self.size = size
        self.calls = 0

    def __call__(self) -> tuple[list[Trajectory], Any]:
        spoiled = self.plan[min(self.calls, len(self.plan) - 1)]
        self.calls += 1
        made = [
            trajectory(f"t{i}", 1.0, ("internal",) if i < spoiled else ("ok",))
            for i in range(self.size)
        ]
        return made, {"attempt": self.calls}


def test_a_spoiled_step_is_rolled_out_again_then_trained() -> None:
    rollouts = Attempts([5, 1])
    retries: list[RolloutRetry] = []
    waits: list[float] = []
    spec = ResilienceSpec(max_infra_failure_fraction=0.1, retry_backoff_seconds=7)
    trajectories, stats, attempts = rollout_step(rollouts, spec, 3, retries.append, waits.append)
    assert attempts == 2 and rollouts.calls == 2 and stats == {"attempt": 2}
    assert count_spoiled(trajectories).spoiled == 1  # 10%: at the limit, trained
    (retry,) = retries
    assert (retry.step, retry.attempt, retry.spoiled, retry.trajectories) == (3, 1, 5, 10)
    assert "sandbox-internal 5" in retry.message and "internal message" in retry.message
    assert waits == [7]


def test_after_the_last_attempt_the_run_fails() -> None:
    rollouts = Attempts([3])
    retries: list[RolloutRetry] = []
    waits: list[float] = []
    spec = ResilienceSpec(
        max_infra_failure_fraction=0.25, rollout_attempts=3, retry_backoff_seconds=2
    )
    with pytest.raises(InfrastructureFailure, match="giving up"):
        rollout_step(rollouts, spec, 1, retries.append, waits.append)
    assert rollouts.calls == 3 and [r.attempt for r in retries] == [1, 2, 3]
    assert waits == [2, 4]  # doubled; none after the last attempt


def test_the_fraction_is_the_limit() -> None:
    spec = ResilienceSpec(max_infra_failure_fraction=0.0, rollout_attempts=1)
    with pytest.raises(InfrastructureFailure):
        rollout_step(Attempts([1]), spec, 1, lambda _: None, lambda _: None)
    loose = ResilienceSpec(max_infra_failure_fraction=0.5, rollout_attempts=1)
    assert rollout_step(Attempts([5]), loose, 1, lambda _: None, lambda _: None)[2] == 1


def test_the_status_says_why_and_clears() -> None:
    retry = RolloutRetry(step=4, attempt=1, attempts=4, spoiled=9, trajectories=32, message="m")
    status = TrainingRunStatus(step=3, rollout_retry=retry)
    # The trainer's patch carries it; the operator reads it back into the same condition.
    body = trainer_patch(status)["status"]
    assert body["rolloutRetry"]["spoiled"] == 9
    derived = rollouts_condition(reported_status({"status": body}))
    assert derived is not None
    assert (derived.type, derived.status, derived.reason, derived.message) == (
        ConditionType.ROLLOUTS_HEALTHY,
        ConditionStatus.FALSE,
        Reason.INFRASTRUCTURE_FAILURES,
        "m",
    )
    status.rollout_retry = None
    status.step = 4
    assert trainer_patch(status)["status"]["rolloutRetry"] is None  # a merge patch removes it
    set_rollouts_condition(status)
    (healthy,) = [c for c in status.conditions if c.type == ConditionType.ROLLOUTS_HEALTHY]
    assert healthy.status == ConditionStatus.TRUE and healthy.reason == Reason.HEALTHY
    assert rollouts_condition(TrainingRunStatus()) is None  # nothing before the first step


@pytest.fixture(scope="module")
def sandbox() -> Iterator[ThreadedServer]:
    server = start_sandbox(executors=2)
    yield server
    server.stop()


def test_a_sandbox_away_for_the_first_attempt_costs_a_rollout_not_the_step(
    sandbox: ThreadedServer,
) -> None:
    """A real sandbox: the first attempt's calls go where nothing listens (as while a
    dispatcher pod restarts), the second's to the server; the step trains on the second."""
    endpoints = [f"127.0.0.1:{free_port()}", sandbox.endpoint]
    problems = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(3)]

    def attempt() -> tuple[list[Trajectory], Any]:
        endpoint = endpoints.pop(0)

        async def run() -> tuple[list[Trajectory], Any]:
            tools = SandboxStreamExecutor(endpoint, deadline=2.0)
            generator = ScriptedGenerator(
                chat_tokenizer(),
                lambda _id, turn, context: tool_call("print(7)") if turn == 0 else "\\boxed{1}",
            )
            loop = AgentLoop(generator, tools, chat_tokenizer(), RolloutConfig())
            try:
                return await rollout(loop, problems, samples=2)
            finally:
                await tools.close()

        return asyncio.run(run())

    retries: list[RolloutRetry] = []
    spec = ResilienceSpec(retry_backoff_seconds=0)
    trajectories, _, attempts = rollout_step(attempt, spec, 1, retries.append)
    assert attempts == 2 and [r.spoiled for r in retries] == [6]
    assert "sandbox-internal 6" in retries[0].message
    assert all(t.tool_calls[0].status == "ok" and not t.infra_failure for t in trajectories)
    assert rollout_metrics(trajectories)["spoiled"] == 0


# --- Weights through a scheduler that restarts, goes away or hangs ---------------------------


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    started = [await FakeEngine().start(), await FakeEngine().start()]
    yield started
    for engine in started:
        await engine.stop()


async def start_scheduler(
    engines: Sequence[FakeEngine], port: int, **config: Any
) -> SchedulerServer:
    server = SchedulerServer(
        ServerConfig(
            listen=f"127.0.0.1:{port}",
            engines=[(f"e{i}", e.url) for i, e in enumerate(engines)],
            scheduler=fast_config(**config),
            drain_seconds=1.0,
        )
    )
    await server.start()
    return server


async def test_a_restarted_scheduler_gets_the_latest_weights_again(
    engines: list[FakeEngine],
) -> None:
    port = free_port()
    spec = ResilienceSpec(retry_backoff_seconds=0)
    server = await start_scheduler(engines, port)
    async with SchedulerClient(f"127.0.0.1:{port}", timeout=10) as client:
        await push_weights(client, "/weights/v000003", 3, spec)
        assert not await ensure_weights(client, "/weights/v000003", 3, spec)
        await server.stop(grace_seconds=1.0)
        for engine in engines:  # restarted with the scheduler's pods, as engines may be
            engine.weights = "base"
        server = await start_scheduler(engines, port)
        try:
            assert (await client.status()).weights_version == 0  # it forgot
            assert await ensure_weights(client, "/weights/v000003", 3, spec)
            status = await client.status()
            assert (status.weights_version, status.weights_path) == (3, "/weights/v000003")
            assert [e.weights for e in engines] == ["/weights/v000003"] * 2
        finally:
            await server.stop(grace_seconds=1.0)


async def test_a_turn_served_by_other_weights_than_pushed_is_an_infrastructure_failure(
    engines: list[FakeEngine],
) -> None:
    """A scheduler restarted in the middle of a rollout serves its next turns with the
    engines' own weights (version 0) until it gets the pushed ones back: such a turn fails
    (its trajectory is spoiled, not trained on), and turns on the pushed weights pass."""
    port = free_port()
    server = await start_scheduler(engines, port)
    generator = SchedulerGenerator(f"127.0.0.1:{port}", timeout=10)
    sampling = Sampling(stop=())
    try:
        await push_weights(generator.client, "/weights/v000002", 2, ResilienceSpec())
        generator.expected_weights_version = 2
        assert (await generator.generate("t1", [1, 2, 3], 4, sampling)).weights_version == 2
        await server.stop(grace_seconds=1.0)
        server = await start_scheduler(engines, port)
        with pytest.raises(GenerationError, match=r"served by weights v0, not v2"):
            await generator.generate("t2", [1, 2, 3], 4, sampling)
        await push_weights(generator.client, "/weights/v000002", 2, ResilienceSpec())
        assert (await generator.generate("t3", [1, 2, 3], 4, sampling)).weights_version == 2
    finally:
        await generator.close()
        await server.stop(grace_seconds=1.0)


async def test_a_turn_sent_before_a_push_may_finish_on_the_weights_it_began_with(
    engines: list[FakeEngine],
) -> None:
    """algorithm.maxStaleness: the next step's rollouts run while the trainer pushes. A push
    lets the turns in flight finish on the old weights; such a turn is kept (the staleness
    bound and the importance weights deal with it), not failed as a restarted scheduler's."""
    port = free_port()
    server = await start_scheduler(engines, port)
    generator = SchedulerGenerator(f"127.0.0.1:{port}", timeout=10)
    try:
        await push_weights(generator.client, "/weights/v000001", 1, ResilienceSpec())
        generator.expected_weights_version = 1
        for engine in engines:
            engine.paused = True  # the turn stays in flight until the push has begun
        turn = asyncio.ensure_future(generator.generate("t", [1, 2, 3], 4, Sampling(stop=())))
        while not any(engine.running for engine in engines):
            await asyncio.sleep(0.01)
        push = asyncio.ensure_future(
            push_weights(generator.client, "/weights/v000002", 2, ResilienceSpec())
        )
        generator.expected_weights_version = 2  # as the worker has it once the push is done
        for engine in engines:
            engine.paused = False
        assert (await turn).weights_version == 1
        assert (await push).version == 2
    finally:
        await generator.close()
        await server.stop(grace_seconds=1.0)


async def test_a_push_waits_for_a_scheduler_that_comes_back(engines: list[FakeEngine]) -> None:
    port = free_port()
    started: list[SchedulerServer] = []
    waits: list[float] = []

    async def back_after(seconds: float) -> None:
        """The back-off, during which the scheduler's pod comes back. (It lasts longer than
        gRPC's 1 s reconnect back-off: the client's channel tries to connect again.)"""
        waits.append(seconds)
        if not started:
            started.append(await start_scheduler(engines, port))
        await asyncio.sleep(seconds)

    spec = ResilienceSpec(retry_backoff_seconds=2, weights_update_attempts=3)
    try:
        async with SchedulerClient(f"127.0.0.1:{port}", timeout=10) as client:
            answer = await push_weights(client, "/weights/v000001", 1, spec, sleep=back_after)
        assert answer.version == 1 and sorted(answer.engines) == ["e0", "e1"]
        assert waits == [2]
    finally:
        for server in started:
            await server.stop(grace_seconds=1.0)


class WatchedClient(SchedulerClient):
    """A scheduler client that writes down its pushes and whether each status call (the
    readiness probe of a back-off) was answered."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, timeout=10)
        self.events: list[str] = []

    async def status(self) -> pb.GetSchedulerStatusResponse:
        try:
            answer = await super().status()
        except grpc.aio.AioRpcError:
            self.events.append("away")
            raise
        self.events.append("answers")
        return answer

    async def update_weights(
        self, weights_path: str, version: int | None = None, timeout: float | None = None
    ) -> pb.UpdateWeightsResponse:
        self.events.append("push")
        return await super().update_weights(weights_path, version, timeout)


async def test_a_push_is_tried_again_as_soon_as_the_scheduler_answers_again(
    engines: list[FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler is away for the first push and comes back during a back-off that would
    last 10 minutes (the injected back-off never ends by itself): the push is tried again
    right after the scheduler first answers again, and that second try is the retry."""
    port = free_port()
    started: list[SchedulerServer] = []
    waits: list[float] = []
    cut_short: list[float] = []
    client = WatchedClient(f"127.0.0.1:{port}")

    async def back_off(seconds: float) -> None:
        waits.append(seconds)
        while client.events.count("away") < 2:  # the probes find it away first
            await asyncio.sleep(0.05)
        started.append(await start_scheduler(engines, port))
        client.events.append("up")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cut_short.append(seconds)
            raise

    spec = ResilienceSpec(retry_backoff_seconds=600, weights_update_attempts=3)
    caplog.set_level(logging.WARNING, logger="kubestar.training.resilience")
    try:
        async with client:
            push = push_weights(client, "/weights/v000001", 1, spec, sleep=back_off)
            answer = await asyncio.wait_for(push, 15)
        assert answer.version == 1 and sorted(answer.engines) == ["e0", "e1"]
        assert waits == [600] and cut_short == [600]  # one retry, its back-off cut short
        events = client.events
        assert events[:3] == ["push", "away", "away"] and events.count("push") == 2
        # Away until it is up; the first answer is followed at once by the second try.
        assert set(events[: events.index("up")]) == {"push", "away"}
        assert events.index("answers") > events.index("up")
        assert events[-2:] == ["answers", "push"] and events.count("answers") == 1
        early = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
        assert len(early) == 1 and f"127.0.0.1:{port}" in early[0]
        assert "into the 600 s back-off: attempt 2 of 3 now" in early[0]
    finally:
        for server in started:
            await server.stop(grace_seconds=1.0)


async def test_a_scheduler_that_never_comes_back_uses_every_attempt_then_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing ever answers: each back-off runs to its end (the probes find the scheduler
    away throughout), every attempt is used, and the failure reads as it always did."""
    endpoint = f"127.0.0.1:{free_port()}"
    retries = Retries()
    ended: list[float] = []

    async def back_off(seconds: float) -> None:
        await retries.sleep(seconds)
        ended.append(seconds)

    spec = ResilienceSpec(retry_backoff_seconds=0.6, weights_update_attempts=3)
    caplog.set_level(logging.WARNING, logger="kubestar.training.resilience")
    async with WatchedClient(endpoint) as client:
        with pytest.raises(InfrastructureFailure) as failure:
            await asyncio.wait_for(
                push_weights(client, "/weights/v000001", 1, spec, sleep=back_off), 15
            )
    assert retries.count == 2 and ended == [0.6, 1.2]  # full back-offs, 0.6 s doubled
    assert client.events.count("push") == 3
    assert "answers" not in client.events and client.events.count("away") >= 2
    message = str(failure.value)
    assert message.startswith(
        f"pushing weights v1 (/weights/v000001) through the rollout scheduler {endpoint}: "
        "UNAVAILABLE: "
    )
    assert message.endswith("(attempt 3 of 3: giving up)")
    assert not [r for r in caplog.records if "answers again" in r.getMessage()]


async def test_a_scheduler_that_answers_throughout_gets_the_whole_back_off() -> None:
    """A call that fails while its service answers (past a deadline, overloaded) is not
    tried again early: only a service that was away and answers again cuts a back-off."""
    probes: list[str] = []
    tries: list[int] = []
    ended: list[float] = []

    async def call() -> str:
        tries.append(len(probes))
        if len(tries) == 1:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return "done"

    async def ready() -> None:
        probes.append("answers")

    async def back_off(seconds: float) -> None:
        while len(probes) < 5:  # it answers, again and again, during the back-off
            await asyncio.sleep(0.01)
        ended.append(seconds)

    answer = await with_retries(call, "a call", 3, 7.0, back_off, ready=ready, poll=0.01)
    assert answer == "done" and ended == [7.0] and tries[0] == 0 and tries[1] >= 5


class FirstReloadHangs(FakeEngine):
    """An engine whose first weight reload never ends (`reloading` is set when it starts)."""

    def __init__(self) -> None:
        super().__init__()
        self.reloading = asyncio.Event()

    async def _load_weights(self, request: web.Request) -> web.StreamResponse:
        if not self.reloading.is_set():
            self.reloading.set()
            await asyncio.Event().wait()  # cancelled when the scheduler lets go of it
        return await super()._load_weights(request)


async def test_a_push_the_scheduler_stopped_in_the_middle_is_tried_again() -> None:
    """The scheduler's pod deleted while the engines reload the pushed weights: the push
    fails, is tried again against the replacement (on the same address) and counts two
    tries; the replacement serves the pushed weights."""
    engines = [FirstReloadHangs(), FirstReloadHangs()]
    for engine in engines:
        await engine.start()
    port = free_port()
    first = await start_scheduler(engines, port)
    replacement: list[SchedulerServer] = []
    retries = Retries()
    stopped = asyncio.Event()

    async def back_off(seconds: float) -> None:
        if not replacement:
            # As a pod's replacement takes the address once the old pod has let it go (the
            # push can fail, and back off, while the old server is still stopping).
            await stopped.wait()
            replacement.append(await start_scheduler(engines, port))
        await retries.sleep(seconds)

    spec = ResilienceSpec(retry_backoff_seconds=1.5, weights_update_attempts=3)
    try:
        async with SchedulerClient(f"127.0.0.1:{port}", timeout=10) as client:
            push = asyncio.create_task(
                push_weights(client, "/weights/v000004", 4, spec, sleep=back_off)
            )
            await asyncio.gather(*(engine.reloading.wait() for engine in engines))
            await first.stop(grace_seconds=0.5)
            stopped.set()
            answer = await asyncio.wait_for(push, 30)
            status = await client.status()
        assert retries.count == 1  # two tries
        assert answer.version == 4 and sorted(answer.engines) == ["e0", "e1"]
        assert (status.weights_version, status.weights_path) == (4, "/weights/v000004")
        assert [e.reloads for e in engines] == [["/weights/v000004"]] * 2
    finally:
        for server in replacement:
            await server.stop(grace_seconds=1.0)
        for engine in engines:
            await engine.stop()


async def test_a_scheduler_that_stays_away_fails_the_run_naming_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    spec = ResilienceSpec(retry_backoff_seconds=0, weights_update_attempts=2)
    async with SchedulerClient(endpoint, timeout=10) as client:
        with pytest.raises(InfrastructureFailure) as failure:
            await push_weights(client, "/weights/v000001", 1, spec)
    assert endpoint in str(failure.value) and "UNAVAILABLE" in str(failure.value)
    assert "attempt 2 of 2: giving up" in str(failure.value)


async def test_a_push_past_its_deadline_is_tried_again_then_fails(
    engines: list[FakeEngine],
) -> None:
    """Every engine's reload hangs (and the scheduler would wait 60 s for it): each push
    gives up at its deadline and the next one is tried."""
    for engine in engines:
        engine.reload_delay = 30.0
    port = free_port()
    server = await start_scheduler(engines, port, weights_reload_timeout=60.0)
    spec = ResilienceSpec(
        retry_backoff_seconds=0, weights_update_seconds=0.5, weights_update_attempts=2
    )
    try:
        async with SchedulerClient(f"127.0.0.1:{port}", timeout=10) as client:
            with pytest.raises(InfrastructureFailure, match="DEADLINE_EXCEEDED") as failure:
                await asyncio.wait_for(push_weights(client, "/weights/v000001", 1, spec), 20)
        assert "attempt 2 of 2" in str(failure.value)
    finally:
        await server.stop(grace_seconds=0.5)
