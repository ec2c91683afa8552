"""The dev-cluster's local pod runner: a kubelet, Deployment/Job controller and kube-proxy stand-in.

It talks to the API server over HTTP like a node agent would, and every `SYNC_SECONDS`:

- Deployments: keeps one local process per desired replica, running the pod's container command,
  args and env (the `exitplan` executable of this environment stands in for the image), each
  with its own port (env EXITPLAN_PORT) on `host`; a changed pod template replaces processes
  make-before-break (new ones ready first, maxUnavailable 0); a process that exits is restarted
  with backoff; readiness comes from probing the container's readinessProbe path; the counts go
  to the Deployment's status (replicas, readyReplicas, updatedReplicas, observedGeneration).
- Init containers: a Deployment pod runs its initContainers one after the other before its container;
  one that fails runs again after a back-off (the pod stays in Init, its restarts count towards a
  stalled rollout), as a kubelet does. Each Deployment pod is also a Pod object in the API, with the
  container statuses a kubelet reports (podstatus.py), and a container's envFrom Secrets are in its env (podenv.py).
- Jobs: runs initContainers then containers one after the other; success or failure (with
  backoffLimit retries) goes to the Job's status: a Failed condition with reason BackoffLimitExceeded
  and, in its message, the failed container's exit code and the tail of its log.
- Volumes and env: podenv.py (configMap and secret volumes as files under the pod's folder, rewritten
  when the ConfigMap or Secret changes, as a kubelet does; emptyDir a folder; hostPath the path itself;
  arguments and env values under a mountPath rewritten to the local folder).
- Ports: the container's first port is EXITPLAN_PORT; every other named port gets a local port of its
  own, in env EXITPLAN_<NAME>_PORT (a router's `control` port: EXITPLAN_CONTROL_PORT), each the next
  free one from `base_port` (`exitplan dev-cluster --pod-ports`). A Service's targetPort (a port name)
  picks which one its endpoints use. Pods listen on `host` (127.0.0.1 unless `--listen` says otherwise:
  env EXITPLAN_HOST, and a `--host 0.0.0.0` in their args becomes it).
- Services: see svcproxy.py (a TCP proxy per Service, published as its load-balancer ingress, so that
  processes outside the pods reach headless Services too; the resolve file, named by env
  EXITPLAN_RESOLVE_FILE, maps a headless Service's name to its pods).

There is no scheduler, no node selection, no resource accounting, no image: what matters here
is that the pods' own commands run and talk to each other as they would in a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from exitplan.api import termination
from exitplan.api.manifest import Manifest
from exitplan.devcluster import podenv, podstatus
from exitplan.devcluster.endpoints import EndpointsWriter, Member, endpoints_object
from exitplan.devcluster.podenv import ConfigMaps
from exitplan.devcluster.svcproxy import TcpProxy, service_hostnames, write_resolve_file
from exitplan.localrun.deployment import exitplan_command
from exitplan.operator.kube import ApiError, KubeClient, path

log = logging.getLogger("exitplan.devcluster")
SYNC_SECONDS = 0.5
STOP_GRACE = 5.0
CRASH_LOOP = 3
"""Restarts after which a Deployment's rollout counts as stalled (Progressing False)."""


def exitplan_argv() -> list[str]:
    """How this environment starts the `exitplan` executable that stands in for the pods' image."""
    return exitplan_command()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _log_tail(log: Path, limit: int = 600) -> str:
    """What the last container run of a pod wrote (its lines joined; at most `limit` characters from
    the end; '-' when nothing): a kubelet's termination message with FallbackToLogsOnError."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(lines) if line.startswith("--- ")]  # _launch's header per run
    text = " ".join(line.strip() for line in lines[starts[-1] + 1 if starts else 0 :] if line.strip())
    return text[-limit:] if text else "-"


def template_hash(template: Manifest) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]


@dataclass
class LocalPod:
    name: str
    namespace: str
    owner: tuple[str, str]
    """(kind, name) of the Deployment or Job."""
    labels: dict[str, str]
    spec: Manifest
    hash: str
    port: int
    folder: Path
    containers: list[Manifest] = field(default_factory=list)
    """Deployments: the one container that serves; Jobs: init containers then containers, in order."""
    step: int = 0
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: int = 0
    restart_at: float = 0.0
    phase: str = "Pending"
    stopping: bool = False
    mounts: dict[str, Path] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)
    """Materialized configMap and secret files: local path -> content."""
    ports: dict[str, int] = field(default_factory=dict)
    """Named container ports -> local port (the first one is `port`)."""
    main: int = 0
    """Deployments: the index of the serving container in `containers` (its init containers come first)."""
    exits: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Container name -> how it last ended (podstatus.py)."""

    @property
    def log_path(self) -> Path:
        return self.folder / "log.txt"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: signal.Signals) -> None:
        """Send `sig` to the process group of the pod's running container (nothing when none runs)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


class PodRunner:
    def __init__(
        self,
        client: KubeClient,
        workdir: Path,
        kubeconfig: Path,
        base_port: int = 31000,
        service_port: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        """`base_port`: the first port the pods take (each the next free one); `service_port`: the first
        the Services' proxies take (0: any free port); `host`: where pods and proxies listen (EXITPLAN_HOST
        for the pods; a pod's `--host 0.0.0.0` becomes it)."""
        self.client = client
        self.host = host
        self.reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        """The address this machine reaches the pods and proxies at."""
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.resolve_file = workdir / "resolve.json"
        self.pods: dict[str, LocalPod] = {}
        self.proxies: dict[tuple[str, str], TcpProxy] = {}
        self.jobs_done: dict[str, dict[str, Any]] = {}
        """Job uid -> how it ended (succeeded / failed counts, the condition's type, time, reason, message)."""
        self._next_port = base_port
        self._next_service_port = service_port
        self.secrets: ConfigMaps = {}
        self._resolve: dict[str, list[str]] = {}
        self.endpoints = EndpointsWriter(client)
        self._reported: dict[tuple[str, str, str], Manifest] = {}
        self._http: aiohttp.ClientSession | None = None
        self._pod_objects = podstatus.PodObjects()
        workdir.mkdir(parents=True, exist_ok=True)
        write_resolve_file(self.resolve_file, {})

    # ------------------------------------------------------------ main loop

    def _session(self) -> aiohttp.ClientSession:
        """The readiness probes' HTTP session (opened by `run`, or on the first probe)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        return self._http

    async def run(self, stop: asyncio.Event) -> None:
        http = self._session()
        try:
            while not stop.is_set():
                try:
                    await self.sync()
                except ApiError as err:
                    log.warning("sync failed (%s); retrying", err)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), SYNC_SECONDS)
        finally:
            await self.shutdown()
            await http.close()

    async def sync(self) -> None:
        deployments = await self.client.list(path("Deployment"))
        jobs = await self.client.list(path("Job"))
        configmaps = {
            (c["metadata"]["namespace"], c["metadata"]["name"]): c for c in await self.client.list(path("ConfigMap"))
        }
        services = await self.client.list(path("Service"))
        self.secrets = {
            (c["metadata"]["namespace"], c["metadata"]["name"]): c for c in await self.client.list(path("Secret"))
        }
        self._sync_deployments(deployments, configmaps)
        self._sync_jobs(jobs, configmaps)
        self._refresh_config(configmaps)
        await self._probe()
        await self._report_deployments(deployments)
        await self._report_jobs(jobs)
        await self._pod_objects.publish(self.client, list(self.pods.values()))
        await self._sync_services(services)

    async def shutdown(self) -> None:
        for pod in list(self.pods.values()):
            self._stop(pod)
        deadline = time.monotonic() + STOP_GRACE
        while any(p.alive() for p in self.pods.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for pod in self.pods.values():
            pod.kill(signal.SIGKILL)
        self.pods.clear()
        for proxy in self.proxies.values():
            await proxy.stop()
        self.proxies.clear()

    # ------------------------------------------------------------ Deployments

    def _sync_deployments(self, deployments: list[Manifest], configmaps: ConfigMaps) -> None:
        seen = set()
        for dep in deployments:
            ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
            seen.add(("Deployment", ns, name))
            template = dep["spec"]["template"]
            want = int(dep["spec"].get("replicas", 1))
            current_hash = template_hash(template)
            mine = [
                p
                for p in self.pods.values()
                if p.owner == ("Deployment", name) and p.namespace == ns and not p.stopping
            ]
            fresh = [p for p in mine if p.hash == current_hash]
            stale = [p for p in mine if p.hash != current_hash]
            for _ in range(want - len(fresh)):
                self._start_pod(ns, ("Deployment", name), template, current_hash, configmaps)
            extra = sorted(fresh, key=lambda p: (p.ready, -int(p.name.rsplit("-", 1)[1])))[: max(0, len(fresh) - want)]
            for pod in extra:
                self._stop(pod)
            if sum(p.ready for p in fresh) >= want:  # make before break: old pods go once new ones serve
                for pod in stale:
                    self._stop(pod)
            for pod in fresh:
                self._keep_running(pod)
        for pod in list(self.pods.values()):
            if pod.owner[0] == "Deployment" and (pod.owner[0], pod.namespace, pod.owner[1]) not in seen:
                self._stop(pod)
        self._reap()

    def _keep_running(self, pod: LocalPod) -> None:
        if pod.alive() or pod.stopping:
            return
        if pod.proc is not None:  # exited: restart with backoff (restartPolicy Always)
            if pod.restart_at == 0.0:
                podstatus.record_exit(pod, termination.log_tail(_read(pod.log_path)))
                if pod.proc.returncode == 0 and pod.step < pod.main:  # an init container is done: the next
                    pod.step += 1
                    self._launch(pod, pod.containers[pod.step])
                    return
                pod.restarts += 1
                pod.ready = False
                pod.restart_at = time.monotonic() + min(10.0, 0.5 * 2**pod.restarts)
                log.warning(
                    "%s/%s exited with %s; restarting (log: %s)",
                    pod.namespace,
                    pod.name,
                    pod.proc.returncode,
                    pod.log_path,
                )
                return
            if time.monotonic() < pod.restart_at:
                return
            pod.restart_at = 0.0
        self._launch(pod, pod.containers[pod.step])  # a failed init container again, or the main one

    # ------------------------------------------------------------ Jobs

    def _sync_jobs(self, jobs: list[Manifest], configmaps: ConfigMaps) -> None:
        live = set()
        for job in jobs:
            uid, ns, name = job["metadata"]["uid"], job["metadata"]["namespace"], job["metadata"]["name"]
            live.add(("Job", ns, name))
            if uid in self.jobs_done:
                continue
            running = [
                p for p in self.pods.values() if p.owner == ("Job", name) and p.namespace == ns and not p.stopping
            ]
            if not running:
                pod = self._start_pod(ns, ("Job", name), job["spec"]["template"], uid[:8], configmaps, job=True)
                pod.labels["job-uid"] = uid
                continue
            pod = running[0]
            if pod.alive():
                continue
            code = pod.proc.returncode if pod.proc else 1
            if code == 0 and pod.step + 1 < len(pod.containers):
                pod.step += 1
                self._launch(pod, pod.containers[pod.step])
            elif code == 0:
                self.jobs_done[uid] = {"succeeded": 1, "failed": pod.restarts, "type": "Complete", "at": _now()}
                pod.phase = "Succeeded"
                self._stop(pod)
            elif pod.restarts < int(job["spec"].get("backoffLimit", 6)):
                pod.restarts += 1
                log.warning(
                    "Job %s/%s: %s failed (%s); retry %d (log: %s)",
                    ns,
                    name,
                    pod.containers[pod.step]["name"],
                    code,
                    pod.restarts,
                    pod.log_path,
                )
                pod.step = 0
                self._launch(pod, pod.containers[0])
            else:
                self.jobs_done[uid] = {
                    "succeeded": 0,
                    "failed": pod.restarts + 1,
                    "type": "Failed",
                    "at": _now(),
                    "reason": "BackoffLimitExceeded",
                    # the Job controller's message, and what a kubelet puts in the failed container's
                    # termination message with FallbackToLogsOnError: the tail of its log
                    "message": f"Job has reached the specified backoff limit; container "
                    f"{pod.containers[pod.step].get('name')} exited {code}: {_log_tail(pod.log_path)}",
                }
                pod.phase = "Failed"
                self._stop(pod)
        for pod in list(self.pods.values()):
            if pod.owner[0] == "Job" and (pod.owner[0], pod.namespace, pod.owner[1]) not in live:
                self._stop(pod)

    async def _report_jobs(self, jobs: list[Manifest]) -> None:
        for job in jobs:
            done = self.jobs_done.get(job["metadata"]["uid"])
            running = any(p.owner == ("Job", job["metadata"]["name"]) and p.alive() for p in self.pods.values())
            status: Manifest = {"active": int(running)}
            if done:
                cond = {"type": done["type"], "status": "True", "lastTransitionTime": done["at"]}
                cond.update({k: done[k] for k in ("reason", "message") if k in done})
                status = {
                    "active": 0,
                    "succeeded": done["succeeded"],
                    "failed": done["failed"],
                    "conditions": [cond],
                }
            await self._report("Job", job, status)

    # ------------------------------------------------------------ processes

    def _start_pod(
        self,
        ns: str,
        owner: tuple[str, str],
        template: Manifest,
        tmpl_hash: str,
        configmaps: ConfigMaps,
        job: bool = False,
    ) -> LocalPod:
        used = {int(p.name.rsplit("-", 1)[1]) for p in self.pods.values() if p.owner == owner and p.namespace == ns}
        index = next(i for i in range(len(used) + 1) if i not in used)
        name = f"{owner[1]}-{tmpl_hash[:5]}-{index}"
        spec = template.get("spec", {})
        inits = spec.get("initContainers", [])  # Jobs: run in order with the containers; Deployments: before
        containers = inits + (spec.get("containers", []) if job else spec.get("containers", [])[:1])
        pod = LocalPod(
            name=name,
            namespace=ns,
            owner=owner,
            labels=dict(template.get("metadata", {}).get("labels", {})),
            spec=spec,
            hash=tmpl_hash,
            port=self._port(),
            folder=self.workdir / "pods" / ns / name,
            containers=containers,
            main=0 if job else len(inits),
        )
        named = [p["name"] for p in containers[pod.main].get("ports") or [] if p.get("name")]
        pod.ports = {port_name: pod.port if i == 0 else self._port() for i, port_name in enumerate(named)}
        pod.folder.mkdir(parents=True, exist_ok=True)
        self._mount(pod, configmaps)
        self.pods[f"{ns}/{name}"] = pod
        self._launch(pod, containers[0])
        log.info("started %s/%s on %s:%d", ns, name, self.reach, pod.port)
        return pod

    def _port(self) -> int:
        self._next_port = self._free_from(self._next_port) + 1
        return self._next_port - 1

    def _service_port(self) -> int:
        """The next Service proxy's port (0: the system picks one)."""
        if not self._next_service_port:
            return 0
        self._next_service_port = self._free_from(self._next_service_port) + 1
        return self._next_service_port - 1

    def _free_from(self, port: int) -> int:
        """The first port from `port` on that nothing listens on (at `host`)."""
        while True:
            with socket.socket() as sock:
                try:
                    sock.bind((self.host, port))
                    return port
                except OSError:
                    port += 1

    def _mount(self, pod: LocalPod, configmaps: ConfigMaps) -> None:
        podenv.mount(pod)
        podenv.write_config(pod, configmaps, self.secrets)

    def _refresh_config(self, configmaps: ConfigMaps) -> None:
        for pod in self.pods.values():
            if not pod.stopping:
                podenv.write_config(pod, configmaps, self.secrets)

    def _launch(self, pod: LocalPod, container: Manifest) -> None:
        command = list(container.get("command") or [])
        if command[:1] == ["exitplan"]:
            command = exitplan_argv() + command[1:]
        argv = command + [podenv.local_path(pod, str(a)) for a in container.get("args", [])]
        argv = [self.host if i and a == "0.0.0.0" and argv[i - 1] == "--host" else a for i, a in enumerate(argv)]
        env = podenv.container_env(pod, container, self.secrets, self.resolve_file, self.kubeconfig)
        env["EXITPLAN_HOST"] = self.host  # where `exitplan router/worker` listen without --host
        with open(pod.log_path, "ab") as out:
            out.write(f"\n--- {time.strftime('%H:%M:%S')} {container.get('name')}: {' '.join(argv)}\n".encode())
            pod.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=pod.folder,
                start_new_session=True,
            )
        pod.phase, pod.ready = "Running", False

    def _stop(self, pod: LocalPod) -> None:
        if pod.stopping:
            return
        pod.stopping, pod.ready = True, False
        pod.kill(signal.SIGTERM)
        pod.restart_at = time.monotonic() + STOP_GRACE
        log.info("stopping %s/%s", pod.namespace, pod.name)

    def _reap(self) -> None:
        for key, pod in list(self.pods.items()):
            if not pod.stopping:
                continue
            if time.monotonic() > pod.restart_at:
                pod.kill(signal.SIGKILL)
            if not pod.alive():
                del self.pods[key]

    async def _probe(self) -> None:
        async def one(pod: LocalPod) -> None:
            if pod.owner[0] != "Deployment" or pod.stopping or not pod.alive() or pod.step < pod.main:
                pod.ready = False
                return
            probe = (pod.containers[pod.main].get("readinessProbe") or {}).get("httpGet")
            if not probe:
                pod.ready = True
                return
            try:
                async with self._session().get(f"http://{self.reach}:{pod.port}{probe.get('path', '/')}") as rsp:
                    pod.ready = rsp.status < 400
            except (TimeoutError, aiohttp.ClientError):
                pod.ready = False

        await asyncio.gather(*(one(p) for p in self.pods.values()))

    async def _report_deployments(self, deployments: list[Manifest]) -> None:
        for dep in deployments:
            ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
            h = template_hash(dep["spec"]["template"])
            mine = [p for p in self.pods.values() if p.owner == ("Deployment", name) and p.namespace == ns]
            ready = sum(p.ready for p in mine)
            status = {
                "observedGeneration": dep["metadata"].get("generation", 1),
                "replicas": len(mine),
                "updatedReplicas": sum(p.hash == h for p in mine),
                "readyReplicas": ready,
                "availableReplicas": ready,
                "conditions": [self._progressing(mine)],
            }
            await self._report("Deployment", dep, status)

    def _progressing(self, pods: list[LocalPod]) -> dict[str, str]:
        """The Deployment controller's Progressing condition, as far as a local runner can tell: a pod
        that keeps exiting (CRASH_LOOP restarts) stalls the rollout (reason ProgressDeadlineExceeded,
        the message ends with the first line of its last run's error: the same at every restart)."""
        crashing = [p for p in pods if p.restarts >= CRASH_LOOP and not p.stopping]
        if not crashing:
            return {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable", "message": ""}
        pod = crashing[0]
        ended = [e for e in pod.exits.values() if e.get("exitCode")]
        error = termination.error_line(str(ended[-1].get("message", ""))) if ended else ""
        return {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": f"pod {pod.name} keeps exiting (CrashLoopBackOff); its error: {error or '-'}",
        }

    async def _report(self, kind: str, obj: Manifest, status: Manifest) -> None:
        key = (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        if self._reported.get(key) == status and (obj.get("status") or {}).items() >= status.items():
            return
        with contextlib.suppress(ApiError):
            await self.client.merge_patch(path(kind, key[1], key[2], "status"), {"status": status})
            self._reported[key] = status

    # ------------------------------------------------------------ Services

    async def _sync_services(self, services: list[Manifest]) -> None:
        mapping: dict[str, list[str]] = {}
        live = set()
        for svc in services:
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            selector = svc.get("spec", {}).get("selector") or {}
            if not selector:
                continue
            live.add((ns, name))
            target = ((svc["spec"].get("ports") or [{}])[0]).get("targetPort")
            headless = svc["spec"].get("clusterIP") == "None"
            members = [
                Member(p.name, p.ports.get(target, p.port) if isinstance(target, str) else p.port, p.ready)
                for p in self.pods.values()
                if p.namespace == ns and (p.ready or p.alive()) and selector.items() <= p.labels.items()
            ]
            publish = headless and svc["spec"].get("publishNotReadyAddresses")
            endpoints = sorted((self.reach, m.port) for m in members if m.ready or publish)
            proxy = self.proxies.get((ns, name))
            if proxy is None:
                proxy = self.proxies[(ns, name)] = TcpProxy(f"{ns}/{name}")
                await proxy.start(self.host, self._service_port())
                log.info("Service %s/%s: local endpoint %s:%d", ns, name, self.reach, proxy.port)
            proxy.endpoints = endpoints  # first: whoever sees the Endpoints object below can reach what it lists
            await self.endpoints.write(endpoints_object(svc, self.reach, members))
            addresses = [f"{h}:{port}" for h, port in endpoints] if headless else [f"{self.reach}:{proxy.port}"]
            ports = [{"port": proxy.port, "protocol": "TCP"}]
            ingress = {"loadBalancer": {"ingress": [{"ip": self.reach, "ports": ports}]}}
            if (svc.get("status") or {}) != ingress:
                with contextlib.suppress(ApiError):
                    await self.client.merge_patch(path("Service", ns, name, "status"), {"status": ingress})
            for host in service_hostnames(name, ns):
                mapping[host] = addresses
        for key in list(self.proxies):
            if key not in live:
                await self.proxies.pop(key).stop()
        await self.endpoints.prune(live)
        if mapping != self._resolve:
            write_resolve_file(self.resolve_file, mapping)
            self._resolve = mapping

    def endpoint(self, namespace: str, service: str) -> str | None:
        """The local URL of a Service (None until its proxy runs)."""
        proxy = self.proxies.get((namespace, service))
        return f"http://{self.reach}:{proxy.port}" if proxy else None
