"""The dev-cluster's local pod runner: a kubelet, Deployment/Job controller and kube-proxy stand-in.

It talks to the API server over HTTP like a node agent would, and every `SYNC_SECONDS`:

- Deployments: keeps one local process per desired replica, running the pod's container command,
  args and env (the `exitplan` executable of this environment stands in for the image), each
  with its own port (env EXITPLAN_PORT) on 127.0.0.1; a changed pod template replaces processes
  make-before-break (new ones ready first, maxUnavailable 0); a process that exits is restarted
  with backoff; readiness comes from probing the container's readinessProbe path; the counts go
  to the Deployment's status (replicas, readyReplicas, updatedReplicas, observedGeneration).
- Init containers: a Deployment pod runs its initContainers one after the other before its container;
  one that fails runs again after a back-off (the pod stays in Init, its restarts count towards a
  stalled rollout), as a kubelet does. Each Deployment pod is also a Pod object in the API, with the
  container statuses a kubelet reports (podstatus.py), and a container's envFrom Secrets are in its env.
- Jobs: runs initContainers then containers one after the other; success or failure (with
  backoffLimit retries) goes to the Job's status: a Failed condition with reason BackoffLimitExceeded
  and, in its message, the failed container's exit code and the tail of its log.
- Volumes: configMap and secret volumes are written to files under the pod's folder (and rewritten
  when the ConfigMap or Secret changes, as a kubelet does); emptyDir is a folder; hostPath is the path
  itself. Arguments and env values under a mountPath are rewritten to the local folder.
- Ports: the container's first port is EXITPLAN_PORT; every other named port gets a local port of its
  own, in env EXITPLAN_<NAME>_PORT (a router's `control` port: EXITPLAN_CONTROL_PORT). A Service's
  targetPort (a port name) picks which one its endpoints use.
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
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from exitplan.devcluster import podstatus
from exitplan.devcluster.svcproxy import TcpProxy, service_hostnames, write_resolve_file
from exitplan.operator.kube import ApiError, KubeClient, path

log = logging.getLogger("exitplan.devcluster")
SYNC_SECONDS = 0.5
STOP_GRACE = 5.0
CRASH_LOOP = 3
"""Restarts after which a Deployment's rollout counts as stalled (Progressing False)."""


def exitplan_argv() -> list[str]:
    from exitplan.localrun.deployment import exitplan_command

    return exitplan_command()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _log_tail(log: Path, limit: int = 600) -> str:
    """What the last container run of a pod wrote (its lines joined; at most `limit` characters from
    the end; '-' when nothing): a kubelet's termination message with FallbackToLogsOnError."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(lines) if line.startswith("--- ")]  # _launch's header per run
    text = " ".join(line.strip() for line in lines[starts[-1] + 1 if starts else 0 :] if line.strip())
    return text[-limit:] if text else "-"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]


@dataclass
class LocalPod:
    name: str
    namespace: str
    owner: tuple[str, str]
    """(kind, name) of the Deployment or Job."""
    labels: dict[str, str]
    spec: dict[str, Any]
    hash: str
    port: int
    folder: Path
    containers: list[dict[str, Any]] = field(default_factory=list)
    """Deployments: the one container that serves; Jobs: init containers then containers, in order."""
    step: int = 0
    proc: subprocess.Popen | None = None
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


class PodRunner:
    def __init__(self, client: KubeClient, workdir: Path, kubeconfig: Path, base_port: int = 31000) -> None:
        self.client = client
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.resolve_file = workdir / "resolve.json"
        self.pods: dict[str, LocalPod] = {}
        self.proxies: dict[tuple[str, str], TcpProxy] = {}
        self.jobs_done: dict[str, dict[str, Any]] = {}
        self._next_port = base_port
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self._resolve: dict[str, list[str]] = {}
        self._reported: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._http: aiohttp.ClientSession | None = None
        self._pod_objects = podstatus.PodObjects()
        workdir.mkdir(parents=True, exist_ok=True)
        write_resolve_file(self.resolve_file, {})

    # ------------------------------------------------------------ main loop

    async def run(self, stop: asyncio.Event) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
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
            await self._http.close()

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
            if pod.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.proc.pid, signal.SIGKILL)
        self.pods.clear()
        for proxy in self.proxies.values():
            await proxy.stop()
        self.proxies.clear()

    # ------------------------------------------------------------ Deployments

    def _sync_deployments(self, deployments: list[dict[str, Any]], configmaps: dict) -> None:
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
                podstatus.record_exit(pod, _log_tail(pod.log_path))
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

    def _sync_jobs(self, jobs: list[dict[str, Any]], configmaps: dict) -> None:
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

    async def _report_jobs(self, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            done = self.jobs_done.get(job["metadata"]["uid"])
            running = any(p.owner == ("Job", job["metadata"]["name"]) and p.alive() for p in self.pods.values())
            status: dict[str, Any] = {"active": int(running)}
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
        self, ns: str, owner: tuple[str, str], template: dict, tmpl_hash: str, configmaps: dict, job: bool = False
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
        log.info("started %s/%s on 127.0.0.1:%d", ns, name, pod.port)
        return pod

    def _port(self) -> int:
        import socket

        while True:
            port, self._next_port = self._next_port, self._next_port + 1
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    continue

    def _mount(self, pod: LocalPod, configmaps: dict) -> None:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for container in pod.containers:
            for mount in container.get("volumeMounts", []):
                vol = volumes.get(mount["name"], {})
                if "hostPath" in vol:
                    pod.mounts[mount["mountPath"]] = Path(vol["hostPath"]["path"])
                    continue
                local = pod.folder / "volumes" / mount["name"]
                local.mkdir(parents=True, exist_ok=True)
                pod.mounts[mount["mountPath"]] = local
        self._write_config(pod, configmaps)

    def _write_secret(self, pod: LocalPod, vol: dict) -> None:
        import base64

        secret = self.secrets.get((pod.namespace, vol["secret"]["secretName"])) or {}
        for key, value in (secret.get("data") or {}).items():
            target = pod.folder / "volumes" / vol["name"] / key
            text = base64.b64decode(value).decode()
            if pod.config.get(str(target)) != text:
                tmp = target.with_suffix(".tmp")
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                    fh.write(text)
                os.replace(tmp, target)
                pod.config[str(target)] = text

    def _write_config(self, pod: LocalPod, configmaps: dict) -> None:
        for vol in pod.spec.get("volumes", []):
            if "secret" in vol:
                self._write_secret(pod, vol)
            if "configMap" not in vol:
                continue
            cm = configmaps.get((pod.namespace, vol["configMap"]["name"]))
            local = pod.folder / "volumes" / vol["name"]
            for key, value in ((cm or {}).get("data") or {}).items():
                target = local / key
                if pod.config.get(str(target)) != value:
                    tmp = target.with_suffix(".tmp")
                    tmp.write_text(value)
                    os.replace(tmp, target)
                    pod.config[str(target)] = value

    def _refresh_config(self, configmaps: dict) -> None:
        for pod in self.pods.values():
            if not pod.stopping:
                self._write_config(pod, configmaps)

    def _local(self, pod: LocalPod, value: str) -> str:
        for mount_path in sorted(pod.mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(pod.mounts[mount_path]) + value[len(mount_path.rstrip("/")) :]
        return value

    def _env(self, pod: LocalPod, container: dict) -> dict[str, str]:
        env = dict(os.environ)
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "status.podIP": "127.0.0.1",
            "spec.nodeName": "localhost",
        }
        env.update(podstatus.env_from(container, pod.namespace, self.secrets))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = self._local(pod, str(item["value"]))
            elif "fieldRef" in item.get("valueFrom", {}):
                env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        env.update(
            EXITPLAN_PORT=str(pod.port),
            **{f"EXITPLAN_{n.upper().replace('-', '_')}_PORT": str(p) for n, p in pod.ports.items() if p != pod.port},
            EXITPLAN_RESOLVE_FILE=str(self.resolve_file),
            KUBECONFIG=str(self.kubeconfig),
            POD_IP="127.0.0.1",
            TMPDIR=str(pod.folder / "volumes" / "tmp")
            if (pod.folder / "volumes" / "tmp").exists()
            else env.get("TMPDIR", "/tmp"),
        )
        return env

    def _launch(self, pod: LocalPod, container: dict) -> None:
        command = list(container.get("command") or [])
        if command[:1] == ["exitplan"]:
            command = exitplan_argv() + command[1:]
        argv = command + [self._local(pod, str(a)) for a in container.get("args", [])]
        with open(pod.log_path, "ab") as out:
            out.write(f"\n--- {time.strftime('%H:%M:%S')} {container.get('name')}: {' '.join(argv)}\n".encode())
            pod.proc = subprocess.Popen(
                argv,
                env=self._env(pod, container),
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
        if pod.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, signal.SIGTERM)
        pod.restart_at = time.monotonic() + STOP_GRACE
        log.info("stopping %s/%s", pod.namespace, pod.name)

    def _reap(self) -> None:
        for key, pod in list(self.pods.items()):
            if not pod.stopping:
                continue
            if pod.alive() and time.monotonic() > pod.restart_at:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.proc.pid, signal.SIGKILL)
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
                async with self._http.get(f"http://127.0.0.1:{pod.port}{probe.get('path', '/')}") as rsp:
                    pod.ready = rsp.status < 400
            except (TimeoutError, aiohttp.ClientError):
                pod.ready = False

        await asyncio.gather(*(one(p) for p in self.pods.values()))

    async def _report_deployments(self, deployments: list[dict[str, Any]]) -> None:
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
        the message ends with the pod's last log line)."""
        crashing = [p for p in pods if p.restarts >= CRASH_LOOP and not p.stopping]
        if not crashing:
            return {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable", "message": ""}
        pod = crashing[0]
        lines = (
            [line for line in pod.log_path.read_text(errors="replace").splitlines() if line.strip()]
            if pod.log_path.exists()
            else []
        )
        return {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": f"pod {pod.name} exited {pod.restarts} times; last log line: {lines[-1][:300] if lines else '-'}",
        }

    async def _report(self, kind: str, obj: dict[str, Any], status: dict[str, Any]) -> None:
        key = (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        if self._reported.get(key) == status and (obj.get("status") or {}).items() >= status.items():
            return
        with contextlib.suppress(ApiError):
            await self.client.merge_patch(path(kind, key[1], key[2], "status"), {"status": status})
            self._reported[key] = status

    # ------------------------------------------------------------ Services

    async def _sync_services(self, services: list[dict[str, Any]]) -> None:
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
            endpoints = sorted(
                ("127.0.0.1", p.ports.get(target, p.port) if isinstance(target, str) else p.port)
                for p in self.pods.values()
                if p.namespace == ns
                and (p.ready or (headless and svc["spec"].get("publishNotReadyAddresses") and p.alive()))
                and selector.items() <= p.labels.items()
            )
            proxy = self.proxies.get((ns, name))
            if proxy is None:
                proxy = self.proxies[(ns, name)] = TcpProxy(f"{ns}/{name}")
                await proxy.start()
                log.info("Service %s/%s: local endpoint 127.0.0.1:%d", ns, name, proxy.port)
            proxy.endpoints = endpoints
            addresses = [f"{h}:{port}" for h, port in endpoints] if headless else [f"127.0.0.1:{proxy.port}"]
            ingress = {
                "loadBalancer": {"ingress": [{"ip": "127.0.0.1", "ports": [{"port": proxy.port, "protocol": "TCP"}]}]}
            }
            if (svc.get("status") or {}) != ingress:
                with contextlib.suppress(ApiError):
                    await self.client.merge_patch(path("Service", ns, name, "status"), {"status": ingress})
            for host in service_hostnames(name, ns):
                mapping[host] = addresses
        for key in list(self.proxies):
            if key not in live:
                await self.proxies.pop(key).stop()
        if mapping != self._resolve:
            write_resolve_file(self.resolve_file, mapping)
            self._resolve = mapping

    def endpoint(self, namespace: str, service: str) -> str | None:
        """The local URL of a Service (None until its proxy runs)."""
        proxy = self.proxies.get((namespace, service))
        return f"http://127.0.0.1:{proxy.port}" if proxy else None
