"""An elastic fleet (issue 38): engines join and leave while a rollout runs, through the
scheduler's API, the AddEngine/RemoveEngine RPCs or Kubernetes discovery. Nothing is lost or
answered twice, and an engine that joins late takes its first turn with the current weights."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubestar.scheduler.client import SchedulerClient
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.discovery import KubernetesDiscovery
from kubestar.scheduler.records import SegmentCallback
from kubestar.scheduler.scheduler import Scheduler
from kubestar.scheduler.server import SchedulerServer, ServerConfig

from tests.scheduler.conftest import MakeScheduler, fast_config, wait_for
from tests.scheduler.fake_engine import FakeEngine

WAYS = ["api", "rpc", "discovery"]
TRAJECTORIES = 10
TURNS = 3
# 40 new tokens a turn in segments of at most 16 (ending on 16-token blocks): each turn of
# each trajectory runs as three or four admissions.
NEW = 40
SEGMENT = 16


class ListedDiscovery(KubernetesDiscovery):
    """Discovery whose pod list is `pods` (name -> engine URL, all ready), no API server (the
    listing itself is test_discovery's)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler, "app=engine")
        self.pods: dict[str, str] = {}

    async def list_pods(self) -> list[dict[str, Any]]:
        return [
            {
                "metadata": {"name": name},
                "status": {
                    "phase": "Running",
                    "podIP": url,
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
            for name, url in self.pods.items()
        ]

    def engines(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        return {name: self.pods[name] for name in super().engines(pods)}


@dataclass
class Fleet:
    """A scheduler with no engine given at start, and how engines join and leave it."""

    scheduler: Scheduler
    add: Callable[[str, str], Awaitable[None]]
    remove: Callable[[str], Awaitable[None]]


@contextlib.asynccontextmanager
async def elastic(way: str, config: SchedulerConfig) -> AsyncIterator[Fleet]:
    if way == "rpc":
        server = SchedulerServer(ServerConfig(listen="127.0.0.1:0", scheduler=config))
        await server.start()
        try:
            async with SchedulerClient(f"127.0.0.1:{server.port}", timeout=30) as client:
                yield Fleet(server.scheduler, client.add_engine, client.remove_engine)
        finally:
            await server.stop(grace_seconds=1.0)
        return
    scheduler = Scheduler([], config)
    await scheduler.start()
    try:
        if way == "api":
            yield Fleet(scheduler, scheduler.add_engine, scheduler.remove_engine)
        else:
            discovery = ListedDiscovery(scheduler)

            async def add(name: str, url: str) -> None:
                discovery.pods[name] = url
                await discovery.sync()

            async def remove(name: str) -> None:
                del discovery.pods[name]
                await discovery.sync()

            yield Fleet(scheduler, add, remove)
    finally:
        await scheduler.stop()


def prompt(i: int) -> list[int]:
    return [i + 1, *range(2, 21)]


def collect(parts: list[list[int]]) -> SegmentCallback:
    def on_segment(token_ids: list[int], text: str, logprobs: list[float]) -> None:
        parts.append(token_ids)

    return on_segment


async def rollout(
    scheduler: Scheduler, i: int, answers: Counter[str]
) -> list[tuple[list[int], list[int]]]:
    """Trajectory i: TURNS turns, each prompt the last one + its output + a tool's token.
    Each turn's (output, segments' tokens joined); `answers` counts the answers per turn."""
    context = prompt(i)
    turns: list[tuple[list[int], list[int]]] = []
    for turn in range(TURNS):
        parts: list[list[int]] = []
        response = await scheduler.generate(f"t{i}", context, NEW, on_segment=collect(parts))
        answers[f"t{i}/{turn}"] += 1
        output = list(response.token_ids)
        turns.append((output, [token for part in parts for token in part]))
        context = [*context, *output, 7]
    scheduler.end_trajectory(f"t{i}")
    return turns


async def reference() -> list[list[tuple[list[int], list[int]]]]:
    """The same rollouts on one large engine that stays: what every turn must answer (the
    fake engines answer by context alone, and the segments end on the same blocks)."""
    async with FakeEngine(num_blocks=200, token_delay=0.0005) as engine:
        scheduler = Scheduler([("only", engine.url)], fast_config(segment_tokens=SEGMENT))
        await scheduler.start()
        try:
            answers: Counter[str] = Counter()
            return list(
                await asyncio.gather(*(rollout(scheduler, i, answers) for i in range(TRAJECTORIES)))
            )
        finally:
            await scheduler.stop()


def turns(engine: FakeEngine) -> int:
    return sum(kind == "turn" for kind, _ in engine.events)


def completed(scheduler: Scheduler) -> float | None:
    return scheduler.metrics.registry.get_sample_value("kubestar_scheduler_completed_total")


@pytest.mark.parametrize("way", WAYS)
async def test_a_scale_event_mid_rollout_loses_and_duplicates_nothing(
    way: str, fakes: list[FakeEngine]
) -> None:
    expected = await reference()
    first, late = fakes
    first.token_delay = late.token_delay = 0.003
    async with elastic(way, fast_config(segment_tokens=SEGMENT)) as fleet:
        scheduler = fleet.scheduler
        await fleet.add("first", first.url)
        answers: Counter[str] = Counter()
        work = asyncio.gather(
            *(rollout(scheduler, i, answers) for i in range(TRAJECTORIES)),
            return_exceptions=True,
        )
        # Scale up: the first engine is full (its 256 tokens hold a few turns), turns queue.
        await wait_for(lambda: len(first.running) >= 2 and scheduler.status().queued > 0)
        await fleet.add("late", late.url)
        await wait_for(lambda: turns(late) > 0 and not work.done())
        # Scale down: the first engine's turns stall there, so they are under way when it
        # leaves; they go on on the late engine, from the segments already done.
        first.paused = True
        await wait_for(lambda: bool(first.running))
        retried, moved = scheduler.retried_total, moved_total(scheduler)
        await fleet.remove("first")
        taken = turns(first)
        results = await work
        assert [e.name for e in scheduler.engines()] == ["late"]

    assert [r for r in results if isinstance(r, BaseException)] == []
    # Every turn of every trajectory was answered exactly once, with what it answers on a
    # fleet that never changes: its full output, each segment's tokens once, in order.
    assert answers == Counter({f"t{i}/{t}": 1 for i in range(TRAJECTORIES) for t in range(TURNS)})
    assert completed(scheduler) == TRAJECTORIES * TURNS
    assert results == expected
    for output, segments in (turn for trajectory in expected for turn in trajectory):
        assert len(output) == NEW and segments == output
    # The turns under way on the removed engine moved (no attempt spent: nothing failed),
    # and it got none afterwards; the late engine took turns.
    assert moved_total(scheduler) > moved and scheduler.retried_total == retried
    assert turns(first) == taken
    assert turns(late) > 0


def moved_total(scheduler: Scheduler) -> float:
    return scheduler.metrics.registry.get_sample_value("kubestar_scheduler_moved_total") or 0.0


def loads_before_first_turn(engine: FakeEngine) -> list[tuple[str, str]]:
    """The weight loads an engine received before its first turn."""
    kinds = [kind for kind, _ in engine.events]
    return engine.events[: kinds.index("turn")]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("version", [3, 0])
async def test_a_late_engine_takes_its_first_turn_with_the_current_weights(
    way: str, version: int, fakes: list[FakeEngine]
) -> None:
    # Version 0 included: the trainer pushes its SFT weights as version 0 (an engine that
    # never loaded anything must load them too).
    path = f"/weights/step-{version}"
    first, late = fakes
    first.token_delay = late.token_delay = 0.005
    late.reload_delay = 0.2  # turns are waiting while it loads
    async with elastic(way, fast_config()) as fleet:
        scheduler = fleet.scheduler
        await fleet.add("first", first.url)
        await scheduler.update_weights(path, version)
        work = asyncio.gather(
            *(scheduler.generate(f"t{i}", prompt(i), NEW) for i in range(16)),
        )
        await wait_for(lambda: scheduler.status().queued > 0)
        await fleet.add("late", late.url)
        responses = await work
        assert {e.weights_version for e in scheduler.engines()} == {version}
    assert loads_before_first_turn(late) == [("load", path), ("loaded", path)]
    assert late.weights == path
    assert {r.engine for r in responses} == {"first", "late"}
    assert {r.weights_version for r in responses} == {version}


async def test_an_update_while_a_late_engine_loads_ends_with_the_newest_weights(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    first, late = fakes
    late.reload_delay = 0.3
    scheduler = await make_scheduler([first])
    await scheduler.update_weights("/weights/step-1", 1)
    adding = asyncio.create_task(scheduler.add_engine("late", late.url))
    # The late engine is loading step 1 when the trainer pushes step 2.
    await wait_for(lambda: ("load", "/weights/step-1") in late.events)
    update = asyncio.create_task(scheduler.update_weights("/weights/step-2", 2))
    answer = await update
    await adding
    assert answer.version == 2 and sorted(answer.engines) == ["e0", "late"]
    assert late.events[:4] == [
        ("load", "/weights/step-1"),
        ("loaded", "/weights/step-1"),
        ("load", "/weights/step-2"),
        ("loaded", "/weights/step-2"),
    ]
    responses = await asyncio.gather(
        *(scheduler.generate(f"t{i}", prompt(i), NEW) for i in range(8))
    )
    assert {r.engine for r in responses} == {"e0", "late"}
    assert {r.weights_version for r in responses} == {2}
    assert late.weights == "/weights/step-2"


async def test_an_engine_that_restarts_during_an_update_reloads_on_return(
    fakes: list[FakeEngine], make_scheduler: MakeScheduler
) -> None:
    # It loaded the new weights, then restarted (with its original ones) while the other
    # engine was still loading: it must load them again before its next turn.
    quick, slow = fakes
    slow.reload_delay = 0.5
    scheduler = await make_scheduler(fakes)
    update = asyncio.create_task(scheduler.update_weights("/weights/step-1", 1))
    await wait_for(lambda: ("loaded", "/weights/step-1") in quick.events)
    port = quick.port
    await quick.crash()
    await wait_for(lambda: not scheduler.status().engines[0].healthy)
    quick.weights = "base"
    quick.events.clear()
    await quick.start(port)
    answer = await update
    assert answer.version == 1
    await wait_for(lambda: scheduler.status().engines[0].healthy)
    responses = await asyncio.gather(
        *(scheduler.generate(f"t{i}", prompt(i), NEW) for i in range(8))
    )
    assert {r.engine for r in responses} == {"e0", "e1"}
    assert loads_before_first_turn(quick) == [
        ("load", "/weights/step-1"),
        ("loaded", "/weights/step-1"),
    ]
    assert quick.weights == "/weights/step-1"
    assert {r.weights_version for r in responses} == {1}
