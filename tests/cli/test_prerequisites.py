"""`make setup`'s first step: on a machine that lacks something, one line naming it and what
to do; the setup stops only for what it cannot do without."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from kubestar.cli import prerequisites
from kubestar.cli.prerequisites import Machine, findings

from tests.real_parts import REPO

READY = Machine(
    system="Linux",
    arch="x86_64",
    python=(3, 11),
    has_venv=True,
    has_headers=True,
    compiler="cc",
    root=False,
    user_namespaces="",
    memory_gib=32.0,
    cpu_flags=frozenset({"avx2", "avx512f"}),
)

# Each lack, whether it stops the setup, and words its one line must hold.
LACKS = {
    "old python": ({"python": (3, 10)}, True, ["3.10", "PYTHON=python3.11"]),
    "no venv": ({"has_venv": False}, True, ["python3.11-venv"]),
    "no headers": ({"has_headers": False}, True, ["Python.h", "python3.11-dev"]),
    "no compiler": ({"compiler": ""}, True, ["C compiler", "install gcc"]),
    "no user namespaces": (
        {"user_namespaces": "unshare: unshare failed: Operation not permitted"},
        False,
        ["Operation not permitted", "isolation: Disabled", "root"],
    ),
    "little memory": ({"memory_gib": 8.0}, False, ["8 GiB", "16 GiB"]),
    "no avx-512": ({"cpu_flags": frozenset({"avx2"})}, False, ["AVX-512"]),
}


def test_a_ready_machine_has_nothing_missing() -> None:
    assert findings(READY) == []
    # root needs no user namespaces; an ARM CPU is not asked for AVX-512
    no_userns = dataclasses.replace(READY, root=True, user_namespaces="denied")
    assert findings(dataclasses.replace(no_userns, arch="aarch64", cpu_flags=frozenset())) == []


@pytest.mark.parametrize("lack", sorted(LACKS))
def test_each_lack_is_one_line_naming_it(lack: str) -> None:
    changes, blocking, words = LACKS[lack]
    (finding,) = findings(dataclasses.replace(READY, **changes))  # type: ignore[arg-type]
    assert finding.blocking is blocking
    line = str(finding)
    assert line.startswith("missing: " if blocking else "note: ") and "\n" not in line
    for word in words:
        assert word in line, line


def test_another_system_is_told_linux_only_and_nothing_linux_specific() -> None:
    mac = dataclasses.replace(READY, system="Darwin", arch="arm64", user_namespaces="no unshare")
    (finding,) = findings(mac)
    assert finding.blocking and "Linux" in finding.line and "Darwin" in finding.line


def test_main_stops_only_for_what_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lacking = dataclasses.replace(READY, compiler="", memory_gib=8.0)
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: lacking))
    assert prerequisites.main() == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["missing", "note"]
    monkeypatch.setattr(
        Machine, "this", classmethod(lambda cls: dataclasses.replace(lacking, compiler="gcc"))
    )
    assert prerequisites.main() == 0


def test_this_machine_as_make_setup_runs_it() -> None:
    """The script by its path, on the Python running the tests (with no kubestar on its path),
    passes here: this machine set the project up."""
    done = subprocess.run(
        [sys.executable, "-I", str(REPO / "cli/kubestar/cli/prerequisites.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert all(line.startswith("note: ") for line in done.stderr.splitlines()), done.stderr
    machine = Machine.this()
    assert machine.system == "Linux" and machine.python >= (3, 11) and machine.memory_gib > 0
