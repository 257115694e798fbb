"""Options several `kubestar` commands share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE

F = TypeVar("F", bound=Callable[..., Any])

SERVER_AUTH_HELP = (
    "A file holding the installation's bearer token: every call (health checks aside) must "
    f"then carry it [env: {ENV_TOKEN_FILE}; else the token itself in {ENV_TOKEN}; neither: no "
    "authentication]."
)


def auth_token_file_option(text: str = SERVER_AUTH_HELP) -> Callable[[F], F]:
    """`--auth-token-file` (KUBESTAR_AUTH_TOKEN_FILE when not given)."""
    return click.option(
        "--auth-token-file",
        type=click.Path(dir_okay=False),
        envvar=ENV_TOKEN_FILE,
        default=None,
        help=text,
    )
