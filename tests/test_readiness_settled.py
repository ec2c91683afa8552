"""Readiness on a steady service (operator/readiness.py): once a refresh found nothing to write and needed no
pods, the next ones skip the work while the service and its Deployments keep their resourceVersions -- and a
Deployment that changes (a new resourceVersion) is refreshed and reported at the next tick. Against the
emulated API server (tier 2 of DESIGN.md), with the API requests counted."""

from __future__ import annotations

from typing import Any

from test_colocate_manifests import APART, children, spec

from exitplan.devcluster.apiserver import ApiServer
from exitplan.operator import apply as applying
from exitplan.operator import crdgen, names
from exitplan.operator.kube import KubeClient, path
from exitplan.operator.readiness import SETTLED_KEY, refresh_readiness
from exitplan.operator.service_state import Service
from exitplan.operator.status import summarize

NS, NAME = "default", "minilm"


def ees() -> dict[str, Any]:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": spec().model_dump(by_alias=True, mode="json", exclude_none=True),
    }


async def _set_ready(client: KubeClient, dep: dict[str, Any], ready: int) -> None:
    await client.merge_patch(
        path("Deployment", NS, dep["metadata"]["name"], "status"),
        {"status": {"replicas": dep["spec"]["replicas"], "readyReplicas": ready}},
    )


async def test_a_steady_service_skips_the_refresh_until_a_deployment_changes():
    async with ApiServer() as server:
        async with KubeClient(server.url) as client:
            for kind in crdgen.KINDS:
                await client.request(
                    "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crdgen.build_crd(kind)
                )
            body = await client.create(ees())
            plan = summarize(APART).model_dump(by_alias=True, mode="json")
            body = await client.merge_patch(
                path("EarlyExitService", NS, NAME, "status"), {"status": {"phase": "Deploying", "plan": plan}}
            )
            assert body["status"]["phase"] == "Deploying"
            await applying.apply_children(client, children(APART), NAME, NS)
            deps = await client.list(path("Deployment", NS), f"{names.L_SERVICE}={NAME}")
            for dep in deps:
                await _set_ready(client, dep, dep["spec"]["replicas"])
            writes: list[str] = []

            def service_writes(method: str, url: str, answer: Any) -> None:
                if "earlyexitservices" in url:
                    writes.append(f"{method} {url}")

            client.observers.append(service_writes)
            memo: dict[str, Any] = {}

            async def tick() -> Any:
                fresh = await client.get(path("EarlyExitService", NS, NAME))
                return await refresh_readiness(Service(fresh, client, memo))

            first = await tick()  # Deploying -> Ready: written
            assert first is not None and first.phase.value == "Ready" and len(writes) == 1, writes
            second = await tick()  # nothing changed, nothing written: remembered as settled
            assert second is not None and second.phase.value == "Ready" and len(writes) == 1, writes
            assert SETTLED_KEY in memo
            assert await tick() is None and await tick() is None  # skipped: same service, same Deployments
            assert len(writes) == 1, writes

            # the drift loop's writes (its figures; the plan's thresholds) bump the service's resourceVersion and
            # change nothing a refresh reads: still skipped
            drift = {"status": {"drift": {"lengthScore": 0.1}, "plan": {"hash": "thresholds-written"}}}
            await client.merge_patch(path("EarlyExitService", NS, NAME, "status"), drift)
            assert await tick() is None and len(writes) == 2, writes  # (the write above, observed)
            # someone else sets a phase the refresh owns: it runs and sets it back
            await client.merge_patch(path("EarlyExitService", NS, NAME, "status"), {"status": {"phase": "Deploying"}})
            back = await tick()
            assert back is not None and back.phase.value == "Ready" and len(writes) == 4, writes
            assert await tick() is not None and await tick() is None  # settled again after a refresh that wrote nothing
            before_change = len(writes)

            worker = next(d for d in deps if d["metadata"]["labels"].get(names.L_COMPONENT) == "worker")
            await _set_ready(client, worker, 0)  # a worker's pod went: a new resourceVersion
            after = await tick()
            assert after is not None, "a Deployment changed: the refresh runs"
            ready = next(c for c in after.conditions if c.type == "Ready")
            assert ready.status == "False" and ready.reason == "Waiting" and len(writes) == before_change + 1, (
                ready,
                writes,
            )
            assert sum(c.ready_replicas for c in after.plan.cells) < sum(c.replicas for c in after.plan.cells)
