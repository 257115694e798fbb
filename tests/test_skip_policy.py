"""One skip policy: every environment skip goes through tests/real_parts.py, which fails the
test under CI instead of skipping it. A direct `pytest.skip`, `skipif`, `importorskip` or
`unittest.skip` anywhere else would let CI stay green with a real part missing."""

from __future__ import annotations

import ast

from tests.real_parts import REPO

# real_parts is the policy; the e2e journey skips the tests after a failed one (that failure
# already fails the run).
ALLOWED = {"tests/real_parts.py", "e2e/tests/conftest.py"}
SKIPS = {"skip", "skipif", "importorskip", "skipIf", "skipUnless", "SkipTest"}


def direct_skips(source: str) -> list[int]:
    """Lines of `source` that skip without the policy."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SKIPS:
            owner = ast.unparse(node.value)
            if owner in ("pytest", "pytest.mark", "unittest"):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module in ("pytest", "unittest")
            and any(alias.name in SKIPS for alias in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_each_form_of_skip() -> None:
    source = (
        "import pytest\nfrom pytest import skip\nimport unittest\n"
        "pytest.skip('x')\n@pytest.mark.skipif(True, reason='x')\ndef f(): pass\n"
        "pytest.importorskip('numpy')\n@unittest.skip('x')\ndef g(): pass\n"
        "s = 'pytest.skip(\"in a string is not a skip\")'\n"
    )
    assert direct_skips(source) == [2, 4, 5, 7, 8]


def test_no_test_skips_but_through_real_parts() -> None:
    offenders = []
    for folder in ("tests", "e2e"):
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative in ALLOWED:
                continue
            offenders += [f"{relative}:{line}" for line in direct_skips(path.read_text())]
    assert not offenders, (
        "skip through tests/real_parts.py (missing, require_root, requires_root), "
        f"which fails under CI: {offenders}"
    )
