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

The tests of test_journey.py are one journey, in order: when one fails the rest are skipped,
and the session's end still dumps diagnostics and removes what the suite made.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.tests.kube import CommandFailed, Tools

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
    system_namespace: str = "kubestar-system"
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
    )


@pytest.fixture(scope="session")
def tools(settings: Settings) -> Iterator[Tools]:
    tools = Tools(log=settings.out / "commands.log")
    try:
        tools.kubectl_text("version", timeout=30)
    except (CommandFailed, FileNotFoundError) as error:
        pytest.exit(f"no cluster reachable with kubectl: {error}", returncode=2)
    yield tools
    dump_diagnostics(tools, settings)
    clean_up(tools, settings)


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
    for namespace in (settings.namespace, settings.system_namespace):
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
    """Best effort, for a journey that stopped half way: the test namespace and the release."""
    tools.kubectl_run(
        "delete",
        "namespace",
        settings.namespace,
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


# --- one journey: a failed step skips the steps after it ----------------------------------


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.excinfo is not None and call.when == "call" and "journey" in item.keywords:
        item.session.__dict__["_e2e_failed"] = item.name


def pytest_runtest_setup(item: pytest.Item) -> None:
    failed = item.session.__dict__.get("_e2e_failed")
    if failed and "journey" in item.keywords:
        pytest.skip(f"the journey stopped at {failed}")


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
