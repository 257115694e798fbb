"""`kubestar operator`: run the Kubernetes operator, or (re)generate the CRDs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import click
from kubestar.common import logs


@click.group()
def operator() -> None:
    """The kopf operator for SandboxPools, RolloutFleets and TrainingRuns."""


@operator.command("run")
@click.option("--config", "config_path", default="", help="Operator settings (YAML).")
@click.option("--kubeconfig", default="", help="Default: $KUBECONFIG, else in-cluster.")
@click.option("--namespace", "namespaces", multiple=True, help="Watch these (repeatable).")
@click.option(
    "--cluster-wide",
    is_flag=True,
    help="Watch every namespace (the operator then needs a ClusterRole).",
)
@click.option("--metrics-port", default=8080, show_default=True, help="0: off.")
@click.option("--metrics-address", default="0.0.0.0", show_default=True)
@click.option("--health-port", default=8081, show_default=True, help="Liveness probe; 0: off.")
@click.option("--health-address", default="0.0.0.0", show_default=True)
@click.option(
    "--leader-election/--no-leader-election",
    default=True,
    show_default=True,
    help="Hold a Lease so that only one replica reconciles.",
)
@click.option("--lease-name", default="kubestar-operator", show_default=True)
@click.option(
    "--lease-namespace",
    default="",
    help="Default: $POD_NAMESPACE, else the kubeconfig's namespace.",
)
@click.option(
    "--no-probe",
    is_flag=True,
    help="Do not talk to fleets' schedulers (KV capacity, restoring weights).",
)
@click.option("--log-level", default="info", show_default=True)
def run_command(
    config_path: str,
    kubeconfig: str,
    namespaces: tuple[str, ...],
    cluster_wide: bool,
    metrics_port: int,
    metrics_address: str,
    health_port: int,
    health_address: str,
    leader_election: bool,
    lease_name: str,
    lease_namespace: str,
    no_probe: bool,
    log_level: str,
) -> None:
    """Reconcile kubestar's custom resources until SIGTERM."""
    from kubestar.common import kube
    from kubestar.common.net import start_metrics_server
    from kubestar.operator.leader import LeaderElector
    from kubestar.operator.main import Runtime
    from kubestar.operator.settings import OperatorSettings

    logs.configure(log_level)
    # kopf logs every handled watch event at INFO; the reconcilers log what matters.
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, logging.root.level))
    settings = OperatorSettings.load(config_path or None)
    if not settings.auth.token:
        logging.getLogger("kubestar.operator").warning(
            "no auth.tokenFile in the settings: the sandboxes, schedulers and engines this "
            "operator makes serve without authentication (the chart always sets one)"
        )
    if namespaces:
        settings.namespaces = list(namespaces)
    settings.cluster_wide = settings.cluster_wide or cluster_wide
    problem = settings.scope_problem() or (
        "give --namespace or --cluster-wide, not both"
        if settings.namespaces and settings.cluster_wide
        else None
    )
    if problem:
        raise click.UsageError(problem)
    connection = kube.connect(kubeconfig or None)
    if metrics_port:
        start_metrics_server(metrics_port, metrics_address)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        elector = None
        lost = asyncio.Event()
        holding: asyncio.Task[None] | None = None
        if leader_election:
            client = kube.Kube(connection)
            elector = LeaderElector(
                client,
                lease_namespace or os.environ.get("POD_NAMESPACE") or connection.namespace,
                lease_name,
            )
            acquiring = asyncio.create_task(elector.acquire())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                acquiring.cancel()
                await client.close()
                return 0
            stopping.cancel()
            holding = asyncio.create_task(elector.hold(lost))
            lost_task = asyncio.create_task(lost.wait())
            lost_task.add_done_callback(lambda _: stop.set())
        runtime = Runtime.create(settings, connection, probe=not no_probe)
        liveness = f"http://{health_address}:{health_port}/healthz" if health_port else None
        await runtime.run(stop, liveness_endpoint=liveness)
        if elector is not None:
            if holding is not None:
                holding.cancel()
            if not lost.is_set():
                await elector.release()
            await elector.kube.close()
        return 1 if lost.is_set() else 0

    sys.exit(asyncio.run(main()))


@operator.command("crds")
@click.option("--out", default="", help="Write the CRD files into this folder.")
@click.option("--check", default="", help="Exit 1 if the CRDs in this folder are stale.")
def crds_command(out: str, check: str) -> None:
    """Print (or write, or check) the CRDs generated from kubestar.api.v1alpha1."""
    from kubestar.api import crds

    if check:
        stale = crds.stale_crds(check)
        if stale:
            click.echo(
                f"stale CRDs in {check}: {', '.join(stale)}; run "
                f"`kubestar operator crds --out {check}`",
                err=True,
            )
            sys.exit(1)
        click.echo(f"CRDs in {check} are up to date")
        return
    if out:
        for path in crds.write_crds(out):
            click.echo(f"wrote {path}")
        return
    click.echo("---\n".join(crds.render_crds().values()), nl=False)
