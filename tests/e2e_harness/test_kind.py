"""The kind provider (e2e/kind/run.sh), in the parts that need no Docker: on a machine that
lacks what it needs it names every missing piece at once and touches nothing, and its image
build file starts from the CPU image that images/build.sh tags."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NEEDED_TOOLS = ("docker", "kind", "kubectl", "helm", "prometheus", "ip")


def test_a_machine_without_the_tools_is_told_each_one_at_once(tmp_path: Path) -> None:
    # A PATH with what the script itself runs before its checks, and nothing else.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "date"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    out = tmp_path / "out"
    bash = shutil.which("bash")
    assert bash
    done = subprocess.run(
        [bash, str(REPO / "e2e/kind/run.sh")],
        env={
            "PATH": str(bin_dir),
            "HOME": str(tmp_path),
            "PYTHON": str(tmp_path / "no-venv/bin/python"),
            "KUBESTAR_E2E_OUT": str(out),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    for tool in NEEDED_TOOLS:
        assert any(line.endswith(f"] {tool} is not on PATH") for line in lines), done.stderr
    assert any("no venv python" in line and "make setup" in line for line in lines)
    assert any("PIP_EXTRA_INDEX_URL" in line for line in lines)
    assert any("not root" in line for line in lines) == (os.geteuid() != 0)
    assert not out.exists()  # it stopped before making anything


def test_the_suites_image_builds_on_the_cpu_image_of_the_pinned_version() -> None:
    pins = dict(
        line.split("=", 1)
        for line in (REPO / "images/pins.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    dockerfile = (REPO / "e2e/kind/Dockerfile").read_text()
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert base == f"kubestar-cpu:{pins['KUBESTAR_VERSION']}"
    assert "FROM ${BASE_IMAGE}" in dockerfile
    # The model the suite's runs name, into the cache the engines resolve names in.
    assert "prepare_default_model" in dockerfile and "KUBESTAR_CACHE=" in dockerfile
    script = (REPO / "e2e/kind/run.sh").read_text()
    assert '"$ROOT/images/build.sh" cpu' in script
    assert '--build-arg "BASE_IMAGE=kubestar-cpu:$KUBESTAR_VERSION"' in script
