"""`exitplan dev-cluster` and `exitplan operator` as processes, for tests that run a service end to end
on the dev cluster: started in order, stopped (SIGTERM, then SIGKILL) and their logs' tails printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from test_operator_support import wait_for

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]


@contextmanager
def dev_cluster_and_operator(tmp: Path, operator_args: list[str]) -> Iterator[Path]:
    """The kubeconfig of a dev cluster under `tmp` with an operator running on it (`operator_args`:
    more arguments to `exitplan operator`)."""
    kubeconfig = tmp / "kubeconfig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: (tmp / f"{name}.log").open("wb") for name in ("dev-cluster", "operator")}
    commands = {
        "dev-cluster": ["dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")],
        "operator": ["operator", "--kubeconfig", str(kubeconfig), "--tick", "1", "--metrics-port", "0", *operator_args],
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, args in commands.items():
            procs.append(
                subprocess.Popen(
                    [*EXITPLAN, *args], stdout=logs[name], stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            wait_for("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
        yield kubeconfig
    finally:
        stop_and_print(procs, logs, tmp)


def stop_and_print(procs: list[subprocess.Popen[bytes]], logs: dict[str, IO[bytes]], tmp: Path) -> None:
    """Stop `procs` in reverse order (SIGTERM, then SIGKILL of the process group after 30 s), close their
    `logs` (`tmp/NAME.log`) and print each log's last 40 lines."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for name, log in logs.items():
        log.close()
        text = (tmp / f"{name}.log").read_text(errors="replace").splitlines()[-40:]
        print(f"---- {name} ----\n" + "\n".join(text))
