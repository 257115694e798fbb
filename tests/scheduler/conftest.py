"""Fixtures of the scheduler tests: in-process fake engines and schedulers with fast timings,
and one pair of real vLLM engines for the session's integration tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import pytest
from kubestar.engine.launch import EngineProcess
from kubestar.scheduler.config import SchedulerConfig
from kubestar.scheduler.scheduler import Scheduler

from tests.real_parts import tiny_model
from tests.scheduler.engines import running_engines
from tests.scheduler.fake_engine import FakeEngine

MakeScheduler = Callable[..., Awaitable[Scheduler]]


def fast_config(**overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = {
        "poll_interval": 0.02,
        "probe_interval": 0.05,
        "scrape_timeout": 1.0,
        "failure_threshold": 2,
        "startup_timeout": 5.0,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeEngine]]:
    """Two fake engines with 16 usable blocks of 16 tokens (256 tokens) each."""
    engines = [await FakeEngine().start(), await FakeEngine().start()]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest.fixture
async def make_scheduler() -> AsyncIterator[MakeScheduler]:
    started: list[Scheduler] = []

    async def make(engines: list[FakeEngine], **overrides: Any) -> Scheduler:
        scheduler = Scheduler(
            [(f"e{i}", e.url) for i, e in enumerate(engines)], fast_config(**overrides)
        )
        await scheduler.start()
        started.append(scheduler)
        return scheduler

    yield make
    for scheduler in started:
        await scheduler.stop()


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sequence[EngineProcess]]:
    """Two real engines on the tiny model with tests/scheduler/engines.py's small KV cache,
    started once: each module borrows them through `engines.as_found` (test_vllm's last tests
    kill them; the next borrower gets them started again)."""
    started = time.monotonic()
    with running_engines(2, tmp_path_factory.mktemp("engines"), tiny_model()) as pair:
        print(f"\n[vllm] two engines ready in {time.monotonic() - started:.1f}s")
        yield pair
