"""Restarting the processes of a local deployment that exit, as the kubelet restarts a pod's container.

A router or worker process that exits (a crash, an OOM kill, SIGKILL, or even exit 0: restartPolicy
Always) is started again with the same command, port and log file, after a back-off: `initial_s`
after the first exit, doubling with each exit in a row up to `max_s`, and back to `initial_s` once
the process has run `reset_after_s` (the kubelet's CrashLoopBackOff runs 10 s, 20 s, ... 5 min,
reset after 10 min: shorter here, where one machine runs every process). Each exit and restart is
said in the process's log file, to `on_event` (`exitplan up` prints it), and counted
(`Proc.restarts`, in `LocalDeployment.describe()`). While it is down, the others keep serving: the
router retries the other pods of the hop, or answers 503.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exitplan.localrun.processes import Proc


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 1.0
    """Back-off before the first restart."""
    max_s: float = 60.0
    """The longest back-off."""
    reset_after_s: float = 60.0
    """A process that ran this long before it exited restarts after `initial_s` again."""
    poll_s: float = 0.2
    """How often the processes are checked."""


class Supervisor:
    """Watches `procs` on a thread and restarts those that exit with `spawn(proc)` (see the module docstring)."""

    def __init__(
        self,
        procs: Sequence[Proc],
        spawn: Callable[[Proc], None],
        policy: RestartPolicy = RestartPolicy(),
        on_event: Callable[[str], object] | None = None,
    ) -> None:
        self.procs, self.spawn, self.policy, self.on_event = procs, spawn, policy, on_event
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop restarting (before the processes are stopped on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_s):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Note the processes that exited; restart those whose back-off has passed."""
        for proc in self.procs:
            if proc.popen is None or proc.popen.poll() is None:
                continue
            if proc.restart_at is None:
                self._exited(proc, now)
            elif now >= proc.restart_at:
                proc.restart_at = None
                proc.restarts += 1
                self.spawn(proc)
                self._say(proc, f"{proc.name} restarted (restart {proc.restarts}, pid {proc.popen.pid})")

    def _exited(self, proc: Proc, now: float) -> None:
        assert proc.popen is not None
        ran = now - proc.started_at
        if proc.backoff_s == 0.0 or ran >= self.policy.reset_after_s:
            proc.backoff_s = self.policy.initial_s
        else:
            proc.backoff_s = min(self.policy.max_s, proc.backoff_s * 2)
        proc.last_exit = proc.popen.returncode
        proc.restart_at = now + proc.backoff_s
        self._say(
            proc,
            f"{proc.name} exited with code {proc.last_exit} after {ran:.1f} s; "
            f"restart {proc.restarts + 1} in {proc.backoff_s:g} s",
        )

    def _say(self, proc: Proc, message: str) -> None:
        try:
            with proc.log_path.open("a") as log:
                log.write(f"--- {time.strftime('%H:%M:%S')} {message} ---\n")
        except OSError:
            pass
        if self.on_event is not None:
            self.on_event(message)
