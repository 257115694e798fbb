"""Every suite: the `requires_root` mark, and at the end of a run how many tests were skipped
and why, grouped by reason (tests/real_parts.py turns a missing real part into a failure
under CI)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.real_parts import require_root, required


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "requires_root(reason): only root can run it (tests/real_parts.requires_root)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("requires_root")
    if marker is not None:
        require_root(marker.args[0] if marker.args else item.nodeid)


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
