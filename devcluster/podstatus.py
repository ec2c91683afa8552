"""What the dev cluster's pod runner (pods.py) tells the API server about its Deployments' pods, and
the container environment a kubelet builds from Secrets.

- Pod objects: each Deployment pod the runner keeps is a Pod in the API (created when it starts,
  deleted when it goes), with the labels of its template and a status a kubelet would report:
  `phase` (Pending while init containers run, then Running), `initContainerStatuses` and
  `containerStatuses` (state running / terminated / waiting with CrashLoopBackOff, lastState,
  restartCount, ready). A terminated container's `message` is the tail of what it wrote, as with
  terminationMessagePolicy FallbackToLogsOnError. There is no `podIP`: the pods listen on 127.0.0.1
  ports of their own, which the Services' local proxies know (svcproxy.py), not the container ports.
- envFrom: the keys of a `secretRef` (or `configMapRef`) become variables, as a kubelet does.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from exitplan.api.manifest import Manifest
from exitplan.operator.kube import ApiError, KubeClient, path

if TYPE_CHECKING:
    from exitplan.devcluster.pods import LocalPod


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_exit(pod: LocalPod, message: str) -> None:
    """Note how the pod's current container ended (its termination state); `message`: its log's tail."""
    code = pod.proc.returncode if pod.proc is not None else 1
    name = str(pod.containers[pod.step].get("name"))
    pod.exits[name] = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "message": message,
        "finishedAt": _now(),
    }


def _state(pod: LocalPod, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, lastState) of the pod's container `index`."""
    name = str(pod.containers[index].get("name"))
    ended = pod.exits.get(name)
    if index < pod.step:
        return {"terminated": dict(ended or {"exitCode": 0, "reason": "Completed"})}, {}
    if index > pod.step:
        return {"waiting": {"reason": "PodInitializing"}}, {}
    if pod.alive():
        last = {"terminated": dict(ended)} if ended and ended["exitCode"] != 0 else {}
        return {"running": {}}, last
    if ended and ended["exitCode"] != 0:
        return {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting failed container {name}"}}, {
            "terminated": dict(ended)
        }
    return {"waiting": {"reason": "ContainerCreating"}}, {}


def pod_status(pod: LocalPod) -> Manifest:
    def one(index: int) -> dict[str, Any]:
        state, last = _state(pod, index)
        container = pod.containers[index]
        return {
            "name": container.get("name"),
            "image": container.get("image", ""),
            "state": state,
            "lastState": last,
            "ready": pod.ready if index == pod.main else index < pod.step,
            "restartCount": pod.restarts if index == pod.step else 0,
        }

    return {
        "phase": "Pending" if pod.step < pod.main else "Running",
        "initContainerStatuses": [one(i) for i in range(pod.main)],
        "containerStatuses": [one(pod.main)],
    }


class PodObjects:
    """Keeps one Pod object per Deployment pod of the runner, its status up to date."""

    def __init__(self) -> None:
        self.reported: dict[tuple[str, str], Manifest] = {}

    async def publish(self, client: KubeClient, pods: list[LocalPod]) -> None:
        live = {(p.namespace, p.name): p for p in pods if p.owner[0] == "Deployment"}
        for key in [k for k in self.reported if k not in live]:
            with contextlib.suppress(ApiError):
                await client.delete(path("Pod", *key))
            del self.reported[key]
        for key, pod in live.items():
            status = pod_status(pod)
            if self.reported.get(key) == status:
                continue
            with contextlib.suppress(ApiError):
                if key not in self.reported:
                    spec = {k: pod.spec[k] for k in ("containers", "initContainers") if k in pod.spec}
                    meta = {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)}
                    await client.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
                    self.reported[key] = {}
                await client.merge_patch(path("Pod", *key, "status"), {"status": status})
                self.reported[key] = status
