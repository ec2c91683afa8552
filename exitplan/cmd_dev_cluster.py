"""`exitplan dev-cluster`: an emulated Kubernetes API on localhost plus a local pod runner."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from exitplan.cli_common import fail

if TYPE_CHECKING:
    from exitplan.devcluster.cluster import DevCluster


HELP_LISTEN = "Address the API server, the pods and the Services' proxies listen on (0.0.0.0: every interface)."
HELP_POD_PORTS = "First port of the pods: each takes the next free one from here."
HELP_SERVICE_PORTS = "First port of the Services' local proxies, each the next free one (0: any free port)."


def command(
    kubeconfig: Path = typer.Option(
        Path("exitplan-dev.kubeconfig"), help="Where to write the kubeconfig for kubectl and `exitplan operator`."
    ),
    port: int = typer.Option(0, min=0, max=65535, help="API server port (0: any free port)."),
    listen: str = typer.Option("127.0.0.1", help=HELP_LISTEN),
    pod_ports: int = typer.Option(31000, min=1, max=65535, help=HELP_POD_PORTS),
    service_ports: int = typer.Option(0, min=0, max=65535, help=HELP_SERVICE_PORTS),
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

    def ready(cluster: DevCluster) -> None:
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
        await run_dev_cluster(
            kubeconfig,
            workdir,
            port=port,
            crds=crds,
            stop=stop,
            on_ready=ready,
            host=listen,
            pod_ports=pod_ports,
            service_ports=service_ports,
        )

    try:
        asyncio.run(main())
    except OSError as err:
        fail(f"cannot serve on port {port}: {err}; pick another --port")
    console.print("dev-cluster stopped; every local pod was stopped")
