"""The `kubestar` command."""

from __future__ import annotations

import os
import sys

import click
from kubestar.cli.engine import engine, model
from kubestar.cli.errors import DEBUG_ENV, debug_requested, describe
from kubestar.cli.eval import evaluate
from kubestar.cli.evolve import evolve
from kubestar.cli.operator import operator
from kubestar.cli.ppm import ppm
from kubestar.cli.report import report
from kubestar.cli.rollout import rollout
from kubestar.cli.sandbox import sandbox
from kubestar.cli.scheduler import scheduler
from kubestar.cli.solve import solve
from kubestar.cli.train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kubestar")
@click.option("--debug", is_flag=True, help=f"Show tracebacks (also {DEBUG_ENV}=1).")
def cli(debug: bool) -> None:
    """kubestar: agentic RL with a code tool, on Kubernetes or one machine."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


cli.add_command(sandbox)
cli.add_command(scheduler)
cli.add_command(rollout)
cli.add_command(engine)
cli.add_command(model)
cli.add_command(operator)
cli.add_command(train)
cli.add_command(evaluate)
cli.add_command(report)
cli.add_command(ppm)
cli.add_command(solve)
cli.add_command(evolve)


def main() -> None:
    """Run the command; an error is one line on stderr and a non-zero exit code."""
    try:
        code = cli.main(prog_name="kubestar", standalone_mode=False)
    except click.UsageError as error:
        help_command = f"{error.ctx.command_path} --help" if error.ctx else "kubestar --help"
        fail(f"{error.format_message()} (see `{help_command}`)", error.exit_code)
    except click.ClickException as error:
        fail(error.format_message(), error.exit_code)
    except (click.Abort, KeyboardInterrupt):
        fail("interrupted", 130)
    except Exception as error:
        if debug_requested():
            raise
        fail(describe(error), 1)
    sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, code: int) -> None:
    click.echo(f"kubestar: error: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
