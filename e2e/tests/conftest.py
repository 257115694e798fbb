"""The end-to-end suite's settings and fixtures. It talks to whatever cluster KUBECONFIG names,
with kubectl and helm on PATH (or KUBECTL / HELM), as a user would; a provider script
(e2e/run.sh local|kind) makes the cluster, the image and the settings below, and removes
them afterwards.

Environment:
  KUBECONFIG                   the cluster (required)
  KUBESTAR_E2E_OUT             where logs, the recorded `kubectl get trainingruns -w` and the
                               diagnostics go (default runs/e2e-TIMESTAMP)
  KUBESTAR_E2E_HELM_ARGS       extra `helm install` arguments (shell words), e.g. the image,
                               pull policy and networking of the provider
  KUBESTAR_E2E_NAMESPACE       namespace of the test resources (kubestar-e2e)
  KUBESTAR_E2E_RUN_TIMEOUT     seconds the TrainingRun may take to succeed (1800)
  KUBESTAR_E2E_CHECKPOINT_HOST_DIR  the host directory behind trainer.sharedCheckpoints
                               (when the suite runs on the node: the local provider), to check
                               the checkpoint's files themselves
  KUBESTAR_E2E_UPGRADE_IMAGE   REPOSITORY:TAG of kubestar's image, present on the nodes, that
                               a `helm upgrade` during the faults run moves to (required by
                               that test)

The tests of test_journey.py are one journey, in order. Each names what it needs
(`@needs("chart", "pool", ...)`: RESOURCES) and is skipped, naming the failed test, only when a
test that sets one of those up or puts it at stake failed (`@provides(...)`, `at_stake`); a
failed run does not hide the tests that need only the chart, the fleet and the pool. The
suite's end still writes the notes, dumps diagnostics and removes what the suite made.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.tests.kube import CommandFailed, Tools
from e2e.tests.prometheus import Prometheus

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kubestar"
MANIFESTS = ROOT / "e2e" / "manifests"


@dataclass
class Settings:
    out: Path
    namespace: str
    helm_args: list[str]
    run_timeout: float
    checkpoint_host_dir: Path | None
    # REPOSITORY:TAG of kubestar's image that a chart upgrade during a run moves to (on the
    # nodes already: the upgrade must not wait on a pull).
    upgrade_image: str = ""
    system_namespace: str = "kubestar-system"
    # A second tenant's namespace, which the operator watches too: its pods hold that
    # namespace's token, which the first tenant's planes refuse (and the other way round).
    tenant_namespace: str = "kubestar-e2e-tenant"
    release: str = "kubestar"
    # Filled in as the journey goes (what to clean up, what was seen).
    installed: bool = False
    notes: dict[str, object] = field(default_factory=dict)


@pytest.fixture(scope="session")
def settings() -> Settings:
    if not os.environ.get("KUBECONFIG"):
        pytest.exit("KUBECONFIG is not set: run the suite through e2e/run.sh", returncode=2)
    out = Path(
        os.environ.get("KUBESTAR_E2E_OUT")
        or ROOT / "runs" / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out.mkdir(parents=True, exist_ok=True)
    host_dir = os.environ.get("KUBESTAR_E2E_CHECKPOINT_HOST_DIR")
    return Settings(
        out=out,
        namespace=os.environ.get("KUBESTAR_E2E_NAMESPACE", "kubestar-e2e"),
        helm_args=shlex.split(os.environ.get("KUBESTAR_E2E_HELM_ARGS", "")),
        run_timeout=float(os.environ.get("KUBESTAR_E2E_RUN_TIMEOUT", "1800")),
        checkpoint_host_dir=Path(host_dir) if host_dir else None,
        upgrade_image=os.environ.get("KUBESTAR_E2E_UPGRADE_IMAGE", ""),
    )


@pytest.fixture(scope="session")
def tools(settings: Settings) -> Iterator[Tools]:
    tools = Tools(log=settings.out / "commands.log")
    try:
        tools.kubectl_text("version", timeout=30)
    except (CommandFailed, FileNotFoundError) as error:
        pytest.exit(f"no cluster reachable with kubectl: {error}", returncode=2)
    yield tools
    (settings.out / "notes.json").write_text(json.dumps(settings.notes, indent=2, default=str))
    dump_diagnostics(tools, settings)
    clean_up(tools, settings)


@pytest.fixture(scope="session")
def prometheus(tools: Tools, settings: Settings) -> Iterator[Prometheus]:
    """A real Prometheus scraping kubestar's pods in the suite's namespaces (found through
    the cluster's API), from the first test that asks for it to the suite's end."""
    namespaces = [settings.namespace, settings.tenant_namespace, settings.system_namespace]
    server = Prometheus(settings.out / "prometheus").start(os.environ["KUBECONFIG"], namespaces)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def namespace(tools: Tools, settings: Settings) -> str:
    """The test namespace (it may exist from an earlier attempt)."""
    tools.kubectl_run("create", "namespace", settings.namespace, check=False)
    return settings.namespace


def dump_diagnostics(tools: Tools, settings: Settings) -> None:
    """Everything needed to see what happened: objects, events, every pod's log."""
    folder = settings.out / "diagnostics"
    folder.mkdir(exist_ok=True)

    def save(name: str, *args: str, only_if_ok: bool = False) -> None:
        done = tools.kubectl_run(*args, check=False, timeout=60)
        if done.returncode == 0 or not only_if_ok:
            (folder / name).write_text(done.stdout + done.stderr)

    save("all.txt", "get", "all,cm,sa,role,rolebinding,kubestar", "-A", "-o", "wide")
    save("events.txt", "get", "events", "-A", "--sort-by=.lastTimestamp")
    for namespace in (settings.namespace, settings.tenant_namespace, settings.system_namespace):
        save(f"describe-{namespace}.txt", "describe", "all,kubestar", "-n", namespace)
        pods = tools.kubectl_run(
            "get", "pods", "-n", namespace, "-o", "name", check=False, timeout=60
        ).stdout.split()
        for pod in pods:
            name = pod.split("/", 1)[-1]
            save(f"log-{namespace}-{name}.txt", "logs", "-n", namespace, pod, "--all-containers")
            save(
                f"log-{namespace}-{name}-previous.txt",
                "logs",
                "-n",
                namespace,
                pod,
                "--all-containers",
                "--previous",
                only_if_ok=True,
            )


def clean_up(tools: Tools, settings: Settings) -> None:
    """Best effort, for a journey that stopped half way: the test namespaces and the release."""
    tools.kubectl_run(
        "delete",
        "namespace",
        settings.namespace,
        settings.tenant_namespace,
        "--ignore-not-found",
        "--wait=true",
        check=False,
        timeout=300,
    )
    if settings.installed:
        tools.run(
            [
                tools.helm_bin,
                "uninstall",
                settings.release,
                "-n",
                settings.system_namespace,
                "--wait",
            ],
            check=False,
        )


# --- one journey: a test is skipped when a failed test broke what it needs ----------------

# What the journey's tests set up and share.
RESOURCES = {
    "chart": "the chart installed with a leading operator",
    "fleet": "the journey's RolloutFleet",
    "pool": "the journey's SandboxPool",
    "run": "the journey's TrainingRun",
}
needs = pytest.mark.needs
provides = pytest.mark.provides
# Resource -> the test whose failure broke it; and the first journey test that failed.
BROKEN = pytest.StashKey[dict[str, str]]()
FIRST_FAILED = pytest.StashKey[str]()


def broken(config: pytest.Config) -> dict[str, str]:
    return config.stash.setdefault(BROKEN, {})


@contextmanager
def at_stake(request: pytest.FixtureRequest, *resources: str) -> Iterator[None]:
    """A part of a test (killing the operator, say) whose failure leaves `resources` broken
    for the tests after it."""
    unknown = set(resources) - set(RESOURCES)
    assert not unknown, f"no such journey resource: {sorted(unknown)}"
    try:
        yield
    except pytest.skip.Exception:
        raise
    except BaseException:
        for resource in resources:
            broken(request.config).setdefault(resource, request.node.name)
        raise


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in ("needs", "provides"):
            for marker in item.iter_markers(name):
                unknown = set(marker.args) - set(RESOURCES)
                if unknown:
                    raise pytest.UsageError(
                        f"{item.nodeid}: @{name} names no journey resource: {sorted(unknown)}"
                    )


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    failed = call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception)
    if not failed or call.when != "call" or "journey" not in item.keywords:
        return
    item.config.stash.setdefault(FIRST_FAILED, item.name)
    for marker in item.iter_markers("provides"):
        for resource in marker.args:
            broken(item.config).setdefault(resource, item.name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "journey" not in item.keywords:
        return
    marker = item.get_closest_marker("needs")
    if marker is None:  # needs whatever came before it
        failed = item.config.stash.get(FIRST_FAILED, "")
        if failed:
            pytest.skip(f"the journey stopped at {failed}")
        return
    for resource in marker.args:
        by = broken(item.config).get(resource)
        if by:
            pytest.skip(f"needs {RESOURCES[resource]}, which {by} left broken")


# --- figures for bench/RESULTS.md, printed at the end of the suite's output ----------------

FIGURES = pytest.StashKey[list[str]]()


def figures(config: pytest.Config) -> list[str]:
    """Lines a test adds for the end of the suite's output (and so pytest.txt)."""
    return config.stash.setdefault(FIGURES, [])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "journey: a step of the end-to-end journey (in order)")
    config.addinivalue_line(
        "markers",
        "needs(*resources): the journey's resources (conftest.RESOURCES) the test uses; it is "
        "skipped when a failed test broke one",
    )
    config.addinivalue_line(
        "markers", "provides(*resources): resources a failure of the test leaves broken"
    )
