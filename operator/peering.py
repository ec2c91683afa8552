"""Leader election for several operator replicas, with kopf's peering.

Every replica started with the same `--peering NAME` writes its presence into the
ClusterKopfPeering `NAME` (kopf.dev/v1); the replica with the highest `--priority` serves and the
others pause until it disappears (kopf handles this; see kopf's docs on peering). The peering
object must exist: `ensure_peering` creates it when absent (the CRD comes with the Helm chart;
the dev-cluster's API server has it built in).
"""

from __future__ import annotations

from exitplan.operator.kube import ApiError, KubeClient

PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"


async def ensure_peering(name: str, kubeconfig: str | None = None) -> bool:
    """Create ClusterKopfPeering `name` unless it exists; True when it was created."""
    async with KubeClient.from_config(kubeconfig) as client:
        try:
            await client.get(f"{PEERINGS}/{name}")
            return False
        except ApiError as err:
            if err.status != 404:
                raise
        try:
            await client.request(
                "POST",
                PEERINGS,
                body={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}},
            )
        except ApiError as err:
            if err.status != 409:  # another replica created it first
                raise
            return False
        return True
