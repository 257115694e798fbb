"""The end-to-end journey's skips (e2e/tests/conftest.py), on a journey of empty tests: a
failed test skips only the later tests that need what it set up or put at stake, each
naming it; tests that name nothing stop at the first failure, as the whole journey used to."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
# The suite's conftest as a plugin of the inner runs (which need no asyncio).
PLUGINS = ("-p", "e2e.tests.conftest", "-p", "no:asyncio")

JOURNEY = """
import pytest
from e2e.tests.conftest import at_stake, needs, provides
from tests.real_parts import missing

pytestmark = pytest.mark.journey

@provides("chart")
def test_install():
    assert INSTALLS

@needs("chart")
@provides("fleet", "pool", "run")
def test_apply():
    pass

@needs("chart", "fleet", "pool", "run")
def test_run_succeeds():
    raise AssertionError("the run failed")

@needs("chart", "fleet", "pool")
def test_faults():
    pass

@needs("chart", "pool")
def test_pool_without_its_isolation(request):
    with at_stake(request, "pool"):
        missing("not on this node")

@needs("chart", "run")
def test_operator_killed(request):
    with at_stake(request, "chart"):
        raise AssertionError("no new leader")

@needs("chart", "pool")
def test_after_the_operator():
    pass

def test_unmarked():
    pass
"""


def outcomes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, installs: bool
) -> dict[str, tuple[str, str]]:
    """Each test's outcome and, for a skip, its reason. The inner journey runs as outside CI,
    where a missing part (tests/real_parts.missing) skips: that skip is what it is about."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KUBESTAR_REQUIRE_REAL_PARTS", raising=False)
    pytester.makepyfile(test_journey=JOURNEY.replace("INSTALLS", str(installs)))
    recorded = pytester.inline_run(*PLUGINS)
    seen: dict[str, tuple[str, str]] = {}
    for report in recorded.getreports("pytest_runtest_logreport"):
        name = report.nodeid.split("::")[-1]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            reason = report.longrepr[2] if report.skipped else ""  # type: ignore[index]
            seen[name] = (report.outcome, str(reason))
    return seen


def test_a_failed_run_skips_only_what_needs_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    chart = "needs the chart installed with a leading operator, which test_operator_killed "
    assert outcomes(pytester, monkeypatch, installs=True) == {
        "test_install": ("passed", ""),
        "test_apply": ("passed", ""),
        "test_run_succeeds": ("failed", ""),
        "test_faults": ("passed", ""),  # needs the fleet and the pool, not the run
        "test_pool_without_its_isolation": ("skipped", "Skipped: not on this node"),
        "test_operator_killed": ("failed", ""),
        "test_after_the_operator": ("skipped", f"Skipped: {chart}left broken"),
        "test_unmarked": ("skipped", "Skipped: the journey stopped at test_run_succeeds"),
    }


def test_a_failed_install_skips_everything_after_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = outcomes(pytester, monkeypatch, installs=False)
    assert seen.pop("test_install") == ("failed", "")
    assert {outcome for outcome, _ in seen.values()} == {"skipped"}
    assert seen["test_faults"][1] == (
        "Skipped: needs the chart installed with a leading operator, which test_install left broken"
    )


def test_a_resource_no_test_sets_up_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_journey="""
import pytest
from e2e.tests.conftest import needs

@needs("cluster")
def test_typo():
    pass
"""
    )
    result = pytester.runpytest(*PLUGINS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "@needs names no journey resource: ['cluster']" in result.stderr.str()
