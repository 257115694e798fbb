"""Every suite: the `requires_root` mark, the session's vLLM engine on the tiny model (borrowed
by the training and search tests; a test that loads weights into it loads the model's own),
and at the end of a run how many tests were skipped and why, grouped by reason
(tests/real_parts.py turns a missing real part into a failure under CI)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.common.net import free_port
from kubestar.engine.launch import EngineProcess, EngineSettings

from tests.real_parts import MAX_MODEL_LEN, engine_python, require_root, required, tiny_model


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "requires_root(reason): only root can run it (tests/real_parts.requires_root)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("requires_root")
    if marker is not None:
        require_root(marker.args[0] if marker.args else item.nodeid)


@pytest.fixture(scope="session")
def python() -> str:
    return engine_python()


@pytest.fixture(scope="session")
def model(python: str) -> Path:
    return tiny_model()


@pytest.fixture(scope="session")
def engine(
    python: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    settings = EngineSettings(
        model=str(model), port=free_port(), python=python, max_model_len=MAX_MODEL_LEN
    )
    process = EngineProcess(settings, log_path=log)
    try:
        process.start(timeout=600)
    except (RuntimeError, TimeoutError) as exc:
        process.stop()
        raise RuntimeError(f"{exc}\n{log.read_text()[-3000:]}") from exc
    yield process
    process.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    total = sum(reasons.values())
    mode = "missing real parts fail the run" if required() else "missing real parts skip"
    terminalreporter.write_sep("=", f"{total} skipped ({mode})")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:4d}  {reason}")
