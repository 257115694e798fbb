"""The real parts the integration tests need, found or prepared one way for every suite:
a python with vLLM, the offline test models, importable optional packages.

Outside CI a test whose real part is missing is skipped, saying why. Under CI (`CI=true`, or
`KUBESTAR_REQUIRE_REAL_PARTS=1`) it fails instead: a skip would count as green, and CI exists
to prove that every part is there and works.

This is the suite's only way to skip (tests/test_skip_policy.py refuses `pytest.skip`,
`skipif` and `importorskip` anywhere else): `missing(reason)` in a test or fixture,
`requires_root(reason)` as a mark for what only root can run (namespaces, other uids).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest
from kubestar.engine import launch

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
# A tiny random Llama with SmolLM2's tokenizer: hidden 256 / 4 heads = head_dim 64, which
# vLLM's CPU attention supports (it has no kernel for head_dim 16).
TINY_MODEL = "tiny-random-llama-h256-l2-s0"


def required() -> bool:
    """Whether a missing real part fails the test run instead of skipping."""
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    return ci or os.environ.get("KUBESTAR_REQUIRE_REAL_PARTS") == "1"


def missing(reason: str) -> NoReturn:
    """Skip the test for want of a real part, or fail it under CI."""
    if required():
        pytest.fail(f"a real part is missing (CI requires it): {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def requires_root(reason: str) -> pytest.MarkDecorator:
    """Mark a test that only root can run; tests/conftest.py calls `missing(reason)` for it
    when the suite runs as another user."""
    return pytest.mark.requires_root(reason)


def require_root(reason: str) -> None:
    """In a test or fixture: go on only as root."""
    if not IS_ROOT:
        missing(f"needs root: {reason}")


def require_modules(*names: str) -> None:
    """The optional packages a test imports (the dev extra installs all of them)."""
    absent = [name for name in names if importlib.util.find_spec(name) is None]
    if absent:
        missing(
            f"{', '.join(absent)} not importable by {sys.executable} (`make setup` installs it)"
        )


@functools.cache
def _engine_python_or_reason() -> tuple[str, str]:
    python = launch.engine_python()
    reason = launch.vllm_missing(python)
    return ("", reason) if reason else (python, "")


def vllm_missing() -> str:
    """Why real engines cannot run here ("" when they can)."""
    return _engine_python_or_reason()[1]


def engine_python() -> str:
    """The python that runs vLLM (KUBESTAR_ENGINE_PYTHON, default this one)."""
    python, reason = _engine_python_or_reason()
    if reason:
        missing(reason)
    return python


@functools.cache
def prepared_model(name: str = TINY_MODEL) -> Path:
    """An offline model folder (`kubestar model prepare NAME`), made with the engine's python
    (it has torch and transformers) into the model cache on first use."""
    code = (
        "import sys; from kubestar.engine.models import resolve_model as r; print(r(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "services")}
    try:
        done = subprocess.run(
            [engine_python(), "-c", code, name],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
    except subprocess.TimeoutExpired:
        missing(f"preparing model {name} took over 900 s")
    if done.returncode != 0:
        raise RuntimeError(f"preparing model {name} failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


# The context of the session's engine on the tiny model (`engine` in tests/conftest.py).
MAX_MODEL_LEN = 1024


def tiny_model(hidden_size: int = 256) -> Path:
    return prepared_model(f"tiny-random-llama-h{hidden_size}-l2-s0")


# -- the policy, checked by tests/test_skip_policy.py -----------------------------------------
# real_parts is the policy; the e2e journey skips the tests after a failed one (that failure
# already fails the run).
SKIP_ALLOWED_IN = {"tests/real_parts.py", "e2e/tests/conftest.py"}
_SKIP_NAMES = {"skip", "skipif", "importorskip", "skipIf", "skipUnless", "SkipTest"}


def direct_skips(source: str) -> list[int]:
    """Lines of `source` that skip without the policy."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in _SKIP_NAMES:
            owner = ast.unparse(node.value)
            if owner in ("pytest", "pytest.mark", "unittest"):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module in ("pytest", "unittest")
            and any(alias.name in _SKIP_NAMES for alias in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)
