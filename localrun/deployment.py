"""Running a plan on this machine: one process per worker replica plus the router.

The processes run exactly the commands the pods run (`exitplan worker ...`, `exitplan router ...`);
only the addresses differ (127.0.0.1 and one port per process instead of pod IPs and headless
Services). `LocalDeployment` is what `exitplan up` and `exitplan demo` use.

Each run has its own control token (random, in `<workdir>/control-token`, readable only by this user,
named to every process by EXITPLAN_CONTROL_TOKEN_FILE), and the router serves its control endpoints
on a port of their own (`control_url`); the plan names that address as the service's router, the only
one workers post feedback to.

With `routers` > 1 (`exitplan up --routers N`) the routers listen on ports after the workers', each
with a control port of its own (the plan names them all), behind a front on `port` (front.py) that
balances connections over the ready ones, as the router Service does in a cluster.

A process that exits is started again after a back-off, as the kubelet restarts a container
(supervisor.py); `stop()` stops restarting first, then stops every process with SIGINT (a drain
without the SIGTERM delay: nothing is left to move to, worker_image/serve.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exitplan.api.commands import CPU_MAX_WAIT_MS, device_args, worker_args
from exitplan.api.plan import Plan, colocated_routers
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.localrun.front import Front
from exitplan.localrun.ports import free_port
from exitplan.localrun.processes import Proc, StartError, exitplan_command
from exitplan.localrun.supervisor import RestartPolicy, Supervisor
from exitplan.worker_image.auth import TOKEN_FILE_ENV, new_token

__all__ = ["LocalDeployment", "Proc", "StartError", "exitplan_command", "port_free"]


def _die_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the parent dies (Linux), so no orphan keeps a port."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalDeployment:
    bundle: Path
    plan: Plan
    spec: EarlyExitServiceSpec
    workdir: Path
    port: int = 8080
    base_port: int = 9100
    threads: int = 1
    max_wait_ms: float = CPU_MAX_WAIT_MS
    """Local processes share CPU cores, where batch latency grows with the batch: launch partial batches early."""
    window_seconds: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    control_port: int = 0
    """The router's control port (0: a free port, chosen at start)."""
    control_token: str = field(default_factory=new_token)
    """This run's control token (ControlClient(deployment.control_url, token=deployment.control_token))."""
    routers: int = 1
    """Router processes; more than one run behind a front on `port` (front.py)."""
    router_args: list[str] = field(default_factory=list)
    """More command-line options for every router (e.g. its server limits, `exitplan router --help`)."""
    restart: RestartPolicy | None = field(default_factory=RestartPolicy)
    """How processes that exit are restarted (None: they are not)."""
    on_event: Callable[[str], object] | None = None
    """Called (on the supervisor's thread) with each exit and restart of a process."""
    control_ports: list[int] = field(default_factory=list)
    """The control port of each router (the first is `control_port`), chosen at start."""
    colocate: bool | None = None
    """Split 0 runs inside the routers (`exitplan router --colocate`): no split-0 worker processes, and
    as many routers as the plan has split-0 replicas in a bucket (at least `routers`). None: as the plan
    says (`Plan.colocate`)."""
    pools: dict[str, GPUPoolSpec] = field(default_factory=dict)
    """The plan's pools: a process on a pool that asks for accelerators (a gpuResource) runs with `--device
    gpu` and refuses the CPU in their stead (as the operator's pods do); unknown pools: ONNX Runtime's choice."""
    front: Front | None = field(default=None, init=False, repr=False)
    _supervisor: Supervisor | None = field(default=None, init=False, repr=False)
    _env: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    @property
    def plan_path(self) -> Path:
        return self.workdir / "plan.json"

    @property
    def token_path(self) -> Path:
        return self.workdir / "control-token"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        """The router's control endpoints (/v1/thresholds, /v1/observations, ...)."""
        return f"http://127.0.0.1:{self.control_port}"

    def _commands(self) -> list[Proc]:
        from exitplan.localrun.generation import is_generation_bundle, stage_commands

        if is_generation_bundle(self.bundle):  # a decoder: generation stages + their router
            if self.routers > 1:
                raise StartError("a generation service runs one router on this machine (--routers 1)")
            return stage_commands(self)
        cli = exitplan_command()
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        port = self.base_port
        by_split: dict[int, list[Proc]] = {}
        cells = sorted(self.plan.cells, key=lambda c: -c.split)  # last split first: its addresses feed --next
        if self.colocated:
            cells = [c for c in cells if c.split > 0]
        for cell in cells:
            for r in range(cell.replicas):
                name = f"worker-s{cell.split}-b{cell.bucket}-{cell.pool}-{r}"
                args = [
                    *cli,
                    "worker",
                    *worker_args(str(self.bundle), str(self.plan_path), cell, port, host="127.0.0.1"),
                    *device_args(self.pools.get(cell.pool)),
                    "--max-wait-ms",
                    str(self.max_wait_ms),
                    "--threads",
                    str(self.threads),
                ]
                nxt = by_split.get(cell.split + 1)
                if cell.split + 1 < len(self.plan.splits):
                    if not nxt:
                        raise StartError(
                            f"plan has no worker for split {cell.split + 1}, which split {cell.split} needs"
                        )
                    args += ["--next", ",".join(p.address for p in nxt)]
                by_split.setdefault(cell.split, []).append(Proc(name, args, port, logs / f"{name}.log"))
                port += 1
        workers = [p for s in sorted(by_split) for p in by_split[s]]
        first = by_split.get(1 if self.colocated else 0, [])
        if self.colocated and len(self.plan.splits) > 1 and not first:
            raise StartError("plan has no worker for split 1, which split 0 (in the router) needs")
        if self.routers == 1:
            return [
                *workers,
                Proc("router", self._router_args(cli, first, self.port, 0), self.port, logs / "router.log"),
            ]
        routers = [
            Proc(f"router-{i}", self._router_args(cli, first, port + i, i), port + i, logs / f"router-{i}.log")
            for i in range(self.routers)
        ]
        return [*workers, *routers]

    def router_procs(self) -> list[Proc]:
        return [p for p in self.procs if p.name == "router" or p.name.startswith("router-")]

    def _router_args(self, cli: list[str], first_split: list[Proc], port: int, index: int) -> list[str]:
        """The router's command line: the service's SLO, accuracy and router settings, and the
        workers of split 0 as its peers."""
        args = [
            *cli,
            "router",
            "--bundle",
            str(self.bundle),
            "--plan",
            str(self.plan_path),
            "--peers",
            ",".join(p.address for p in first_split),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--control-port",
            str(self.control_ports[index] if self.control_ports else self.control_port),
            "--slo-ms",
            str(self.spec.slo.latency_ms),
            "--accuracy-budget",
            str(self.spec.accuracy.max_drop),
            "--shadow-fraction",
            str(self.spec.accuracy.shadow_fraction),
            "--queue-lambda",
            str(self.spec.router.queue_lambda),
            "--queue-alpha",
            str(self.spec.router.queue_alpha),
            "--peek-depth",
            str(self.spec.router.peek_depth),
            "--max-body-bytes",
            str(self.spec.router.max_body_bytes),
            "--max-inflight",
            str(self.spec.router.max_queue),
            "--window-seconds",
            str(self.window_seconds),
        ]
        if self.spec.router.truncate:
            args.append("--truncate")
        if self.colocated:
            pools = sorted({c.pool for c in self.plan.cells if c.split == 0})
            args += ["--colocate", "--pool", pools[0] if len(pools) == 1 else ""]
            args += device_args(self.pools.get(pools[0])) if len(pools) == 1 else []
            args += ["--threads", str(self.threads), "--max-wait-ms", str(self.max_wait_ms)]
        return args + list(self.router_args)

    def write_plan(self, plan: Plan | None = None) -> None:
        """Write the plan atomically (workers and the router re-read it when it changes)."""
        if plan is not None:
            self.plan = plan
        routers = [f"127.0.0.1:{p}" for p in (self.control_ports or [self.control_port]) if p]
        if routers and self.plan.routers != routers:
            self.plan = self.plan.model_copy(update={"routers": routers})
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.plan_path.with_suffix(".tmp")
        tmp.write_text(self.plan.to_json())
        os.replace(tmp, self.plan_path)

    @property
    def colocated(self) -> bool:
        return self.plan.colocate if self.colocate is None else self.colocate

    def start(self, timeout: float = 180.0) -> None:
        if self.colocated:  # each router holds one split-0 runtime per bucket: the plan's replicas are routers
            self.routers = colocated_routers(self.plan.cells, self.routers)
        if not self.control_port:
            workers = sum(c.replicas for c in self.plan.cells) + len(self.plan.splits)
            taken = {self.port, *range(self.base_port, self.base_port + workers + 1)}
            while not self.control_port or self.control_port in taken:
                self.control_port = free_port()
        self._choose_control_ports()
        self.write_plan()
        self._write_token()
        self.procs = self._commands()
        busy = [p.port for p in self.procs if not port_free(p.port)]
        busy += [p for p in self.control_ports if not port_free(p)]
        if self.routers > 1 and not port_free(self.port):
            busy.append(self.port)
        if busy:
            raise StartError(
                f"ports {busy} on 127.0.0.1 are in use (another exitplan up or demo still running?); "
                f"stop it or choose other ports (--port, --base-port)"
            )
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", TOKEN_FILE_ENV: str(self.token_path)}
        env.pop("EXITPLAN_PORT", None)
        env.pop("EXITPLAN_CONTROL_PORT", None)
        self._env = env
        for proc in self.procs:
            self._spawn(proc, fresh=True)
        try:
            self.wait_ready(timeout)
            if self.routers > 1:
                self.front = Front(self.port, [("127.0.0.1", p.port) for p in self.router_procs()])
                self.front.start()
        except BaseException:
            self.stop()
            raise
        if self.restart is not None:
            self._supervisor = Supervisor(self.procs, self._spawn, self.restart, self.on_event)
            self._supervisor.start()

    def _spawn(self, proc: Proc, fresh: bool = False) -> None:
        """Start `proc`'s process: a new log at start, appended to when the supervisor restarts it.
        (Its parent-death signal follows the thread that starts it: the supervisor's thread lives
        until `stop()`, which stops every process anyway.)"""
        with proc.log_path.open("wb" if fresh else "ab") as log:
            proc.popen = subprocess.Popen(
                proc.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        proc.started_at = time.monotonic()

    def _choose_control_ports(self) -> None:
        """The control port of each router (none among the workers' and routers' ports): a given
        `control_port` and the ports after it (`--routers 2 --control-port 9100`: 9100, 9101), else
        free ports."""
        listening = sum(c.replicas for c in self.plan.cells) + len(self.plan.splits) + self.routers + 1
        taken = {self.port, *range(self.base_port, self.base_port + listening)}
        given = self.control_port
        ports: list[int] = []

        def pick(start: int) -> int:
            candidate = start if given else free_port()
            while not candidate or candidate in taken or candidate in ports:
                candidate = candidate + 1 if given else free_port()
            return candidate

        while len(ports) < self.routers:
            ports.append(pick(ports[-1] + 1 if ports else given))
        self.control_port = ports[0]
        self.control_ports = ports

    def _write_token(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.token_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.control_token)
        os.replace(tmp, self.token_path)

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        pending = list(self.procs)
        while pending:
            for proc in list(pending):
                assert proc.popen is not None
                if proc.popen.poll() is not None:
                    raise StartError(f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.log_tail()}")
                if _get_ok(f"http://{proc.address}/v2/health/ready"):
                    pending.remove(proc)
            if pending and time.monotonic() > end:
                names = ", ".join(p.name for p in pending)
                raise StartError(f"not ready after {timeout:.0f} s: {names}\n{pending[0].log_tail()}")
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self.front is not None:
            self.front.stop()
            self.front = None
        for proc in self.procs:
            if proc.popen and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGINT)
        end = time.monotonic() + grace
        for proc in self.procs:
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": p.name,
                "address": p.address,
                "log": str(p.log_path),
                "restarts": p.restarts,
                "lastExit": p.last_exit,
            }
            for p in self.procs
        ]


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200 and bool(json.loads(resp.read() or b"{}").get("ready", True))
    except (urllib.error.URLError, OSError, ValueError):
        return False
