"""Options several `kubestar` commands share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE

if TYPE_CHECKING:
    from kubestar.training.local import LocalServiceSettings

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


def local_services_options(function: F) -> F:
    """`--engine-python`, `--device`, `--sandbox-executors`, `--sandbox-preload`, `--log-dir`:
    how a command that starts its own engine and sandbox (as local processes) starts them."""
    options = [
        click.option(
            "--engine-python",
            default="",
            help="Python with vLLM for a local engine (default: KUBESTAR_ENGINE_PYTHON, else "
            "this one).",
        ),
        click.option(
            "--device",
            type=click.Choice(["cpu", "cuda", "rocm"]),
            default="cpu",
            show_default=True,
            help="Device of a local engine.",
        ),
        click.option(
            "--sandbox-executors", type=click.IntRange(min=1), default=4, show_default=True
        ),
        click.option(
            "--sandbox-preload",
            default="numpy,sympy",
            show_default=True,
            help="Modules a local sandbox's executors import once.",
        ),
        click.option(
            "--log-dir",
            type=click.Path(file_okay=False),
            default="",
            help="Logs of the local engine and sandbox (default: a temporary folder, or the "
            "command's own output folder where it has one).",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def local_service_settings(**changes: Any) -> LocalServiceSettings:
    """The running command's `local_services_options` (and its `--max-model-len`,
    `--scheduler-policy` where it has them) as the library's settings; `changes` override."""
    from dataclasses import fields

    from kubestar.training.local import LocalServiceSettings

    params = dict(click.get_current_context().params)
    params["sandbox_preload"] = tuple(
        name for name in params.get("sandbox_preload", "").split(",") if name
    )
    names = {field.name for field in fields(LocalServiceSettings)}
    values = {name: value for name, value in params.items() if name in names}
    return LocalServiceSettings(**{**values, **changes})


@contextmanager
def library_errors(flag: Callable[[str], str | None] | None = None) -> Iterator[None]:
    """The library's errors in the block as the CLI's: a SettingError as a mistake naming
    the flag `flag` gives for its setting (without `flag`, a usage error), a ServiceFailed (a
    local service that did not come up) as an error ending with the service's log."""
    from kubestar.api.errors import SettingError
    from kubestar.training.local import ServiceFailed

    try:
        yield
    except SettingError as error:
        if flag is None:
            raise click.UsageError(str(error)) from error
        raise click.BadParameter(str(error), param_hint=flag(error.setting)) from error
    except ServiceFailed as error:
        raise click.ClickException(str(error)) from error
