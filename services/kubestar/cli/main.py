"""The `kubestar` command."""

from __future__ import annotations

import click
from kubestar.cli.engine import engine, model
from kubestar.cli.eval import evaluate
from kubestar.cli.operator import operator
from kubestar.cli.rollout import rollout
from kubestar.cli.sandbox import sandbox
from kubestar.cli.scheduler import scheduler
from kubestar.cli.train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kubestar")
def cli() -> None:
    """kubestar: agentic RL with a code tool, on Kubernetes or one machine."""


cli.add_command(sandbox)
cli.add_command(scheduler)
cli.add_command(rollout)
cli.add_command(engine)
cli.add_command(model)
cli.add_command(operator)
cli.add_command(train)
cli.add_command(evaluate)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
