"""Where a process finds the installation's token, and how a presented one is judged."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubestar.common.auth import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    MISSING,
    WRONG,
    AuthConfigError,
    call_metadata,
    client_token,
    load_token,
    refusal,
)

TOKEN = "kubestar-test-token-0123456789abcdef"


def test_a_flag_wins_over_the_file_variable_which_wins_over_the_token_variable(
    tmp_path: Path,
) -> None:
    flag, named = tmp_path / "flag", tmp_path / "named"
    flag.write_text("from-the-flag\n")
    named.write_text("  from-the-file-variable\n\n")
    env = {ENV_TOKEN_FILE: str(named), ENV_TOKEN: "from-the-variable"}
    assert load_token(str(flag), env) == "from-the-flag"
    assert load_token(None, env) == "from-the-file-variable"
    assert load_token(None, {ENV_TOKEN: " from-the-variable "}) == "from-the-variable"
    assert load_token(None, {}) == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [("\n", "is empty"), ("two words", "without spaces"), ("caf\u00e9", "printable ASCII")],
)
def test_an_unusable_token_file_is_refused_naming_it(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(AuthConfigError, match=message) as error:
        load_token(str(path), {})
    assert str(path) in str(error.value)
    with pytest.raises(AuthConfigError, match="cannot read the auth token file"):
        load_token(str(tmp_path / "absent"), {})


def test_client_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    assert client_token() == TOKEN
    assert client_token("") == ""  # explicitly none
    assert call_metadata("") is None
    assert call_metadata(TOKEN) == (("authorization", f"Bearer {TOKEN}"),)


def test_refusal() -> None:
    assert refusal(f"Bearer {TOKEN}", TOKEN) is None
    assert refusal(f"bearer {TOKEN}".encode(), TOKEN) is None
    assert refusal(None, TOKEN) == MISSING
    assert refusal("", TOKEN) == MISSING
    assert refusal(TOKEN, TOKEN) == MISSING  # no scheme
    assert refusal(f"Basic {TOKEN}", TOKEN) == MISSING
    assert refusal(f"Bearer {TOKEN}x", TOKEN) == WRONG
    assert refusal("Bearer caf\u00e9", TOKEN) == WRONG
