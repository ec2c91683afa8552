"""`exitplan dev-cluster`: the emulated API server + the local pod runner, in one process.

It serves the Kubernetes API on localhost (devapi.py), installs exitplan's CRDs and a
ClusterKopfPeering for leader election, writes a kubeconfig for kubectl and `exitplan operator`,
and runs the pod runner (localrun.py) against that API over HTTP until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from exitplan.devcluster.apiserver import ApiServer
from exitplan.devcluster.pods import PodRunner
from exitplan.operator import crdgen
from exitplan.operator.kube import ApiError, KubeClient

PEERING = "exitplan"


@dataclass
class DevCluster:
    server: ApiServer
    runner: PodRunner
    kubeconfig: Path

    @property
    def url(self) -> str:
        return self.server.url


async def install(client: KubeClient) -> None:
    """exitplan's CRDs and the operator's peering object (idempotent)."""
    for kind in crdgen.KINDS:
        with contextlib.suppress(ApiError):
            await client.request(
                "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crdgen.build_crd(kind)
            )
    with contextlib.suppress(ApiError):
        await client.request(
            "POST",
            "/apis/kopf.dev/v1/clusterkopfpeerings",
            body={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}},
        )


async def run_dev_cluster(
    kubeconfig: Path,
    workdir: Path,
    port: int = 0,
    crds: bool = True,
    *,
    host: str = "127.0.0.1",
    pod_ports: int = 31000,
    service_ports: int = 0,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[DevCluster], Awaitable[None] | None] | None = None,
) -> None:
    """Serve until `stop` is set (or the task is cancelled), then stop every local process. Everything
    listens on `host`: the API server on `port`, the pods from `pod_ports` on, the Services' proxies
    from `service_ports` on (0: any free port)."""
    stop = stop or asyncio.Event()
    # Absolute: the pods run in folders of their own and read both (KUBECONFIG, mounted volumes).
    kubeconfig, workdir = kubeconfig.absolute(), workdir.absolute()
    async with ApiServer(host=host, port=port) as server:
        async with KubeClient(server.url) as client:
            if crds:
                await install(client)
            # Written once the CRDs are served, and atomically: clients wait for this file to appear and
            # then create custom resources at once.
            kubeconfig.parent.mkdir(parents=True, exist_ok=True)
            partial = kubeconfig.with_name(kubeconfig.name + ".partial")
            partial.write_text(server.kubeconfig())
            partial.replace(kubeconfig)
            runner = PodRunner(client, workdir, kubeconfig, pod_ports, service_ports, host)
            task = asyncio.create_task(runner.run(stop))
            cluster = DevCluster(server, runner, kubeconfig)
            if on_ready is not None:
                result = on_ready(cluster)
                if asyncio.iscoroutine(result):
                    await result
            try:
                await stop.wait()
            finally:
                stop.set()
                await task
