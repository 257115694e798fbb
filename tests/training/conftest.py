"""A sandbox per module for the training tests (the session's engine is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sandbox.support import ThreadedServer
from tests.training.rollout_support import start_sandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[ThreadedServer]:
    server = start_sandbox(executors=2)
    yield server
    server.stop()
