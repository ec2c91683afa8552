"""Running a plan on this machine: one process per worker replica plus the router.

The processes run exactly the commands the pods run (`exitplan worker ...`, `exitplan router ...`);
only the addresses differ (127.0.0.1 and one port per process instead of pod IPs and headless
Services). `LocalDeployment` is what `exitplan up` and `exitplan demo` use.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec


class StartError(RuntimeError):
    """A process of the deployment did not come up; the message names it and shows its log tail."""


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


def exitplan_command() -> list[str]:
    """How to run the CLI from here: the installed script beside this interpreter, else `python -m`."""
    script = Path(sys.executable).with_name("exitplan")
    if script.exists():
        return [str(script)]
    found = shutil.which("exitplan")
    return [found] if found else [sys.executable, "-m", "exitplan"]


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class LocalDeployment:
    bundle: Path
    plan: Plan
    spec: EarlyExitServiceSpec
    workdir: Path
    port: int = 8080
    base_port: int = 9100
    threads: int = 1
    max_wait_ms: float = 2.0
    """Local processes share CPU cores, where batch latency grows with the batch: launch partial batches early."""
    window_seconds: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    @property
    def plan_path(self) -> Path:
        return self.workdir / "plan.json"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _commands(self) -> list[Proc]:
        from exitplan.localrun.generation import is_generation_bundle, stage_commands

        if is_generation_bundle(self.bundle):  # a decoder: generation stages + their router
            return stage_commands(self)
        cli = exitplan_command()
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        port = self.base_port
        by_split: dict[int, list[Proc]] = {}
        cells = sorted(self.plan.cells, key=lambda c: -c.split)  # last split first: its addresses feed --next
        for cell in cells:
            for r in range(cell.replicas):
                name = f"worker-s{cell.split}-b{cell.bucket}-{cell.pool}-{r}"
                args = [
                    *cli,
                    "worker",
                    "--bundle",
                    str(self.bundle),
                    "--plan",
                    str(self.plan_path),
                    "--split",
                    str(cell.split),
                    "--bucket",
                    str(cell.bucket),
                    "--pool",
                    cell.pool,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
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
        router_args = self._router_args(cli, by_split.get(0, []))
        return [*workers, Proc("router", router_args, self.port, logs / "router.log")]

    def _router_args(self, cli: list[str], first_split: list[Proc]) -> list[str]:
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
            str(self.port),
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
        return args

    def write_plan(self, plan: Plan | None = None) -> None:
        """Write the plan atomically (workers and the router re-read it when it changes)."""
        if plan is not None:
            self.plan = plan
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.plan_path.with_suffix(".tmp")
        tmp.write_text(self.plan.to_json())
        os.replace(tmp, self.plan_path)

    def start(self, timeout: float = 180.0) -> None:
        self.write_plan()
        self.procs = self._commands()
        busy = [p.port for p in self.procs if not port_free(p.port)]
        if busy:
            raise StartError(
                f"ports {busy} on 127.0.0.1 are in use (another exitplan up or demo still running?); "
                f"stop it or choose other ports (--port, --base-port)"
            )
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("EXITPLAN_PORT", None)
        for proc in self.procs:
            with proc.log_path.open("wb") as log:
                proc.popen = subprocess.Popen(
                    proc.args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

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
        for proc in self.procs:
            if proc.popen and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
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

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> list[dict]:
        return [{"name": p.name, "address": p.address, "log": str(p.log_path)} for p in self.procs]


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200 and bool(json.loads(resp.read() or b"{}").get("ready", True))
    except (urllib.error.URLError, OSError, ValueError):
        return False
