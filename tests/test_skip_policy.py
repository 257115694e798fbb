"""One skip policy: every environment skip goes through tests/real_parts.py, which fails the
test under CI instead of skipping it. A direct skip anywhere else (pytest's or unittest's, as
a call, a mark or an import; real_parts.direct_skips lists the forms) would let CI stay green
with a real part missing."""

from __future__ import annotations

from tests.real_parts import REPO, SKIP_ALLOWED_IN, direct_skips


def test_the_check_finds_each_form_of_skip() -> None:
    # Written with <s> for the word, so that this file holds no skip of its own to find.
    source = (
        "import pytest\nfrom pytest import <s>\nimport unittest\n"
        "pytest.<s>('x')\n@pytest.mark.<s>if(True, reason='x')\ndef f(): pass\n"
        "pytest.importor<s>('numpy')\n@unittest.<s>('x')\ndef g(): pass\n"
        "s = 'pytest.<s>(\"in a string is not a skip\")'\n"
    ).replace("<s>", "skip")
    assert direct_skips(source) == [2, 4, 5, 7, 8]


def test_no_test_skips_but_through_real_parts() -> None:
    offenders = []
    for folder in ("tests", "e2e"):
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative in SKIP_ALLOWED_IN:
                continue
            offenders += [f"{relative}:{line}" for line in direct_skips(path.read_text())]
    assert not offenders, (
        "skip through tests/real_parts.py (missing, require_root, requires_root), "
        f"which fails under CI: {offenders}"
    )
