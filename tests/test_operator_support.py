"""Harness for the operator's integration tests (no tests here): the emulated API server in a
background thread, a synchronous client for the test body, the operator under kopf's KopfRunner.

Waits poll the API until a condition holds; HANG_GUARD only stops a broken run from hanging the
suite (a failure message names what never happened), it is not a performance assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("EXITPLAN_TICK_SECONDS", "0.5")

from exitplan.devcluster.apiserver import ApiServer  # noqa: E402
from exitplan.operator import crdgen  # noqa: E402
from exitplan.operator.kube import ApiError, KubeClient, path  # noqa: E402

DATA = Path(__file__).parent / "test_operator_data"
HANG_GUARD = 90.0


class ClusterThread:
    """The emulated API server on its own event loop thread, with a blocking client."""

    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = ApiServer()
        self.kubeconfig = tmp / "kubeconfig"
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ClusterThread:
        self._thread.start()
        self.run(self.server.__aenter__())
        self.client = KubeClient(self.server.url)
        self.kubeconfig.write_text(self.server.kubeconfig())
        for kind in crdgen.KINDS:
            self.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crdgen.build_crd(kind))
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self.client.close())
        self.run(self.server.__aexit__(None, None, None))
        self.run(_cancel_others())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    @property
    def api(self):  # the DevKubeAPI (kmock handler): objects, fault injection
        return self.server.api

    def run(self, coro: Any, guard: float = 60.0) -> Any:
        """Run `coro` on the server's loop; `guard` only stops a broken call from hanging."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=guard)

    def call(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> dict:
        return self.run(self.client.request(method, url, body=body, content_type=content_type))

    def create(self, obj: dict) -> dict:
        return self.run(self.client.create(copy.deepcopy(obj)))

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self.run(self.client.get(path(kind, namespace, name)))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str | None = None, selector: str = "") -> list[dict]:
        return self.run(self.client.list(path(kind, namespace), selector))

    def patch(self, kind: str, namespace: str | None, name: str, patch: dict, subresource: str | None = None) -> dict:
        return self.run(self.client.merge_patch(path(kind, namespace, name, subresource), patch))

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self.run(self.client.delete(path(kind, namespace, name)))

    def events(self, namespace: str, name: str) -> list[dict]:
        return [e for e in self.list("Event", namespace) if e.get("involvedObject", {}).get("name") == name]


async def _cancel_others() -> None:
    """End the server's leftover tasks (watch streams) before its loop stops."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def wait_for(what: str, probe: Callable[[], Any], guard: float = HANG_GUARD) -> Any:
    """Poll `probe` until it returns something truthy; fail with `what` if it never does."""
    deadline = time.monotonic() + guard
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what} (last probe: {json.dumps(last, default=str)[:1500]})")


def events_where(cluster: ClusterThread, ns: str, name: str, match: Callable[[dict], bool], what: str) -> list[dict]:
    """The object's events that `match`, waited for: the operator posts events in the background, after the
    status write that reports the same thing, so a test that has seen the status waits for the event."""
    return wait_for(what, lambda: [e for e in cluster.events(ns, name) if match(e)])


ALLOWED_HOST_PATHS = "/models"
"""The operator's allowed bundle host paths in these tests: service() names /models/minilm."""


@contextlib.contextmanager
def operator(
    cluster: ClusterThread, extra: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[Any]:
    """The real operator (exitplan.operator.handlers) under kopf, all namespaces; standalone
    unless `extra` names a peering (leader election). `env`: operator settings (operator/guards.py)
    over the default ones (bundles under /models may be host paths)."""
    from kopf.testing import KopfRunner

    args = ["run", "--all-namespaces", "-m", "exitplan.operator.handlers", *(extra or ["--standalone"])]
    settings = {"KUBECONFIG": str(cluster.kubeconfig), "EXITPLAN_ALLOWED_HOST_PATHS": ALLOWED_HOST_PATHS, **(env or {})}
    runner = KopfRunner(args, env=settings, timeout=60)
    try:
        with runner:
            yield runner
    finally:  # shown by pytest when the test fails
        with contextlib.suppress(Exception):
            print("---- operator log (tail) ----\n" + "\n".join(runner.output.splitlines()[-150:]))
    assert runner.exception is None, runner.output


def load_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DATA / name).read_text()) if d]


def pool(name: str, capacity: int, cost: float, gpu: str = "nvidia.com/gpu") -> dict:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "GPUPool",
        "metadata": {"name": name},
        "spec": {
            "capacity": capacity,
            "costPerHour": cost,
            "gpuResource": gpu,
            "nodeSelector": {"exitplan.io/pool": name},
        },
    }


def service(name: str, namespace: str, **spec: Any) -> dict:
    body = {
        "model": {"name": "minilm", "bundle": "/models/minilm"},
        "slo": {"latencyMs": 50},
        "workload": {"rps": 200, "lengthBuckets": [32, 128]},
        "pools": [{"name": "gpu-a"}, {"name": "gpu-b"}],
    }
    for key, value in spec.items():
        body[key] = value
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def install_profiles(cluster: ClusterThread, namespace: str, pools: tuple[str, ...] = ("gpu-a", "gpu-b")) -> None:
    for doc in load_docs("profiles.yaml"):
        if doc["spec"]["pool"] in pools:
            cluster.create({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})


def status(cluster: ClusterThread, namespace: str, name: str) -> dict:
    obj = cluster.get("EarlyExitService", namespace, name) or {}
    return obj.get("status") or {}


def condition(st: dict, kind: str) -> dict:
    return next((c for c in st.get("conditions", []) if c["type"] == kind), {})


def workers(cluster: ClusterThread, namespace: str, name: str) -> dict[str, dict]:
    deps = cluster.list("Deployment", namespace, f"exitplan.io/service={name},app.kubernetes.io/component=worker")
    return {d["metadata"]["name"]: d for d in deps}


def mark_ready(cluster: ClusterThread, namespace: str, name: str) -> None:
    """Stand in for the Deployment controller: report every replica ready."""
    for dep in cluster.list("Deployment", namespace, f"exitplan.io/service={name}"):
        n = dep["spec"]["replicas"]
        cluster.patch(
            "Deployment",
            namespace,
            dep["metadata"]["name"],
            {
                "status": {
                    "replicas": n,
                    "readyReplicas": n,
                    "availableReplicas": n,
                    "observedGeneration": dep["metadata"]["generation"],
                }
            },
            "status",
        )
