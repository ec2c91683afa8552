"""`exitplan dev-cluster`: an emulated Kubernetes API on localhost plus a local pod runner."""

from __future__ import annotations

from pathlib import Path

import typer


def command(
    kubeconfig: Path = typer.Option(
        Path("exitplan-dev.kubeconfig"), help="Where to write the kubeconfig for kubectl and `exitplan operator`."
    ),
    port: int = typer.Option(0, min=0, max=65535, help="API server port on 127.0.0.1 (0: any free port)."),
    workdir: Path = typer.Option(
        Path(".exitplan-dev"), help="Folder for the local pods (logs, mounted ConfigMaps) and the resolve file."
    ),
    crds: bool = typer.Option(True, help="Install exitplan's CRDs at start (else: kubectl apply -f crds/)."),
) -> None:
    """Run an emulated Kubernetes API server and a local pod runner (one process per replica).

    Then, in another shell: `export KUBECONFIG=<kubeconfig>`, `exitplan operator`, and
    `kubectl apply --validate=false -f your-service.yaml`; `kubectl get ees` shows the service.
    The router Service's local endpoint is in `kubectl get svc NAME -o jsonpath='{.status.loadBalancer.ingress}'`.
    """
    import asyncio
    import logging
    import signal

    from rich.console import Console
    from rich.table import Table

    from exitplan.devcluster.cluster import run_dev_cluster

    console = Console()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

    def ready(cluster) -> None:  # noqa: ANN001
        table = Table(title="exitplan dev-cluster")
        table.add_column("what")
        table.add_column("where")
        table.add_row("API server", cluster.url)
        table.add_row("kubeconfig", str(kubeconfig.resolve()))
        table.add_row("pods, logs, resolve file", str(workdir.resolve()))
        console.print(table)
        console.print(f"export KUBECONFIG={kubeconfig.resolve()}   # then: exitplan operator; kubectl get ees")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_dev_cluster(kubeconfig, workdir, port=port, crds=crds, stop=stop, on_ready=ready)

    try:
        asyncio.run(main())
    except OSError as err:
        from exitplan.cli import fail

        fail(f"cannot serve on port {port}: {err}; pick another --port")
    console.print("dev-cluster stopped; every local pod was stopped")
