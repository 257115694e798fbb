"""What the machine needs before `make setup` makes the virtualenv: one line for each thing
missing, naming what to install or change. It runs on the system's Python, before kubestar
is installed, so it imports the standard library only.

    python3 cli/kubestar/cli/prerequisites.py     # `make setup` runs it first

Missing Linux, Python 3.11+, its venv module or headers, or a C compiler stops the setup
(exit 1). What only `make train` needs (root or user namespaces for the sandbox, memory) and
what only makes it slower (AVX-512) is said as a note, and the setup goes on."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIN_PYTHON = (3, 11)
# `make train` holds 11-13 GB (the engine, the trainer, Ray and the sandbox).
MIN_MEMORY_GIB = 16
COMPILERS = ("cc", "gcc", "clang")


@dataclass(frozen=True)
class Machine:
    """What the checks read, gathered once by `Machine.this` (tests describe one by hand)."""

    system: str
    arch: str
    python: tuple[int, int]
    has_venv: bool  # venv and ensurepip (Debian and Ubuntu ship them as python3.X-venv)
    has_headers: bool  # Python.h, for the sandbox's C extension
    compiler: str  # "" when none is on PATH
    root: bool
    user_namespaces: str  # "" when `unshare --user` works, else why it did not
    memory_gib: float
    cpu_flags: frozenset[str]

    @classmethod
    def this(cls) -> Machine:
        return cls(
            system=platform.system(),
            arch=platform.machine(),
            python=(sys.version_info.major, sys.version_info.minor),
            has_venv=all(importlib.util.find_spec(m) is not None for m in ("venv", "ensurepip")),
            has_headers=(Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
            compiler=next(
                (c for c in (os.environ.get("CC", ""), *COMPILERS) if c and shutil.which(c)), ""
            ),
            root=hasattr(os, "geteuid") and os.geteuid() == 0,
            user_namespaces=_user_namespaces(),
            memory_gib=_memory_gib(),
            cpu_flags=_cpu_flags(),
        )


@dataclass(frozen=True)
class Finding:
    blocking: bool  # the setup cannot succeed without it
    line: str

    def __str__(self) -> str:
        return f"{'missing' if self.blocking else 'note'}: {self.line}"


def findings(machine: Machine) -> list[Finding]:
    """Everything missing on `machine`, blocking first, one line each (on another system
    than Linux, only what blocks)."""
    version = "{}.{}".format(*machine.python)
    found: list[Finding] = []
    if machine.system != "Linux":
        found.append(
            Finding(
                True,
                f"Linux: kubestar's sandbox uses Linux namespaces and seccomp; this is "
                f"{machine.system}",
            )
        )
    if machine.python < MIN_PYTHON:
        found.append(
            Finding(
                True,
                f"Python 3.11 or newer: this is {version}; name another with "
                "`make setup PYTHON=python3.11`",
            )
        )
    if not machine.has_venv:
        found.append(
            Finding(
                True,
                f"Python's venv module: install python{version}-venv (Debian, Ubuntu) and "
                "run make again",
            )
        )
    if not machine.has_headers:
        found.append(
            Finding(
                True,
                f"Python's headers (Python.h), for the sandbox's C extension: install "
                f"python{version}-dev (Debian, Ubuntu) or python3-devel (Fedora)",
            )
        )
    if not machine.compiler:
        found.append(
            Finding(
                True,
                "a C compiler (cc, gcc or clang on PATH, or CC), for the sandbox's C extension: "
                "install gcc",
            )
        )
    if machine.system != "Linux":
        return found
    if not machine.root and machine.user_namespaces:
        found.append(
            Finding(
                False,
                f"the sandbox needs root or user namespaces, and `unshare --user` failed "
                f"({machine.user_namespaces}): `make train` would refuse to start it. Run as "
                "root, allow user namespaces (Ubuntu 24.04: the sysctl "
                "kernel.apparmor_restrict_unprivileged_userns=0), or set the SandboxPool's "
                "isolation: Disabled on a machine you trust (docs/security.md)",
            )
        )
    if 0 < machine.memory_gib < MIN_MEMORY_GIB:
        found.append(
            Finding(
                False,
                f"{machine.memory_gib:.0f} GiB of memory: `make train` holds 11-13 GB; give it "
                f"{MIN_MEMORY_GIB} GiB or expect it to be killed",
            )
        )
    if machine.arch == "x86_64" and "avx512f" not in machine.cpu_flags:
        found.append(
            Finding(
                False,
                "the CPU has no AVX-512: vLLM on CPU decodes 4-5x slower, and `make train` "
                "takes that much longer than bench/RESULTS.md's AVX-512 rows",
            )
        )
    return sorted(found, key=lambda finding: not finding.blocking)


def _user_namespaces() -> str:
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare command (util-linux)"
    try:
        done = subprocess.run(
            [unshare, "--user", "true"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return "" if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def main() -> int:
    found = findings(Machine.this())
    for finding in found:
        print(finding, file=sys.stderr)
    return 1 if any(finding.blocking for finding in found) else 0


if __name__ == "__main__":
    sys.exit(main())
