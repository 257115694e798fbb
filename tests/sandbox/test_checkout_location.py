"""The sandbox serves wherever kubestar is: a checkout under /tmp (which every executor covers
with a private tmpfs), a checkout behind a path given to --hide, or an installed wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox.client import SandboxClient
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import REPO, ServerProcess, descendants

# The folders that hold kubestar's subpackages (pyproject's package-dir).
PACKAGE_FOLDERS = ("protos", "services", "training", "operator", "cli")


@pytest.fixture
def checkout_under_tmp() -> Iterator[Path]:
    """A copy of the package sources (with the built stubs and fork server) under /tmp."""
    checkout = Path(tempfile.mkdtemp(prefix="kubestar-checkout-", dir="/tmp"))
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(
            REPO / folder / "kubestar",
            checkout / folder / "kubestar",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    yield checkout
    shutil.rmtree(checkout, ignore_errors=True)


def editable_from(checkout: Path) -> Path:
    """A folder for PYTHONPATH whose sitecustomize makes every python load kubestar from
    `checkout` without putting `checkout` on the import path, as an editable install does."""
    folder = checkout / "site"
    folder.mkdir()
    portions = [str(checkout / name / "kubestar") for name in PACKAGE_FOLDERS]
    (folder / "sitecustomize.py").write_text(f"import kubestar\nkubestar.__path__ = {portions!r}\n")
    return folder


def serve_and_call(log_dir: Path, source: Path, pythonpath: list[Path], *args: str) -> None:
    """`kubestar sandbox serve` with kubestar imported from `pythonpath`: a call runs, and the
    executors run the zygote from `source`."""
    env = {"PYTHONPATH": ":".join(str(path) for path in pythonpath)}
    server = ServerProcess(log_dir, *args, env=env, executors=1).wait_ready()
    try:
        with SandboxClient(server.endpoint, timeout=60) as client:
            result = client.execute("print(6 * 7)")
        assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "42\n"), result
        zygotes = [
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for pid in descendants(server.pid)
            if Path(f"/proc/{pid}/cmdline").exists()
        ]
        scripts = [
            arg.decode() for cmdline in zygotes for arg in cmdline if arg.endswith(b"zygote.py")
        ]
        assert scripts and all(script.startswith(str(source)) for script in scripts), scripts
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()


@pytest.mark.parametrize("hide", [False, True], ids=["plain", "hidden"])
def test_a_checkout_under_tmp_serves(checkout_under_tmp: Path, log_dir: Path, hide: bool) -> None:
    args = ("--hide", str(checkout_under_tmp)) if hide else ()
    serve_and_call(log_dir, checkout_under_tmp, [editable_from(checkout_under_tmp)], *args)


@pytest.mark.slow
def test_an_installed_wheel_serves(log_dir: Path) -> None:
    """A non-editable install (`pip install .`, as images do), into a folder under /tmp."""
    work = Path(tempfile.mkdtemp(prefix="kubestar-wheel-", dir="/tmp"))
    try:
        # Built from a copy: pip builds in the source tree, which must stay as it is.
        source = work / "source"
        shutil.copytree(
            REPO,
            source,
            ignore=shutil.ignore_patterns(
                ".git", ".venv", "build", "runs", "*.egg-info", "__pycache__", "*.so", "*_pb2*"
            ),
        )
        target = work / "site"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                str(source),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        serve_and_call(log_dir, target / "kubestar", [target])
    finally:
        shutil.rmtree(work, ignore_errors=True)
