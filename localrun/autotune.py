"""`exitplan up`'s threshold tuning loop: I/O around the pure policy of exitplan.planner.tuning.autotune.

Every `config.period_s` seconds, in a daemon thread with its own asyncio event loop, the loop reads
every router's newest shadow-sampled feedback, merged into one window, and the newest versioned
thresholds among them (exitplan.worker_image.router_fleet), hands them to
:func:`~exitplan.planner.tuning.autotune.advance` with the state it carries (:class:`TunerState`:
fresh samples since the last breach or drift, the unconfirmed drift alarm, the drift test's
reference thresholds), and pushes the thresholds the decision names to every router as the next
version (each router forwards them to its pods; a router that missed the push takes them from the
others within its sync period). The state advances only once
a step completes: a rejected window or a failed push leaves it as it was, and the next step counts
the samples that arrived since the last completed one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from exitplan.planner.tuning.autotune import LIVE, Decision, TuneConfig, TunerState, advance
from exitplan.planner.tuning.feedback import FeedbackWindow, WindowError
from exitplan.worker_image.control_client import ControlClient, ControlError
from exitplan.worker_image.router_fleet import fleet_feedback, fleet_thresholds, push_fleet

log = logging.getLogger(__name__)


class AutoTuner:
    """Runs :func:`advance` every ``config.period_s`` seconds against the routers, in a daemon thread.

    ``step()`` takes one step now (from any thread without a running event loop; while the loop
    thread runs, the step runs on its event loop, one step at a time). ``router_url``: one router's
    control URL or a list of every router's. ``history`` holds the
    decisions taken on a window, ``state`` the :class:`TunerState` carried between steps (its
    ``alarm_log`` tells the drift alarms' story). ``on_change(decision)`` is called, in the loop's
    thread, after new thresholds were pushed. ``clients`` are the routers' control clients (replace
    them before the first step to talk to something else); ``token`` the service's control token.
    ``version`` is the version of the thresholds last pushed (0 before the first)."""

    def __init__(
        self,
        router_url: str | list[str],
        ramps: list[str],
        budget: float,
        *,
        config: TuneConfig = LIVE,
        on_change: Callable[[Decision], object] | None = None,
        token: str | None = None,
    ) -> None:
        urls = [router_url] if isinstance(router_url, str) else list(router_url)
        self.router_url, self.ramps, self.budget, self.config = urls[0], ramps, budget, config
        self.on_change = on_change
        self.clients = [ControlClient(url, timeout_s=10.0, token=token) for url in urls]
        self.version = 0
        self.history: list[Decision] = []
        self.state = TunerState()
        self._loop = asyncio.new_event_loop()
        self._busy = asyncio.Lock()  # one step at a time on the loop (the periodic one or a step() call)
        self._wake = asyncio.Event()  # set (on the loop) by stop()
        self._calls = threading.Lock()  # step() and stop() from other threads, one at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune", daemon=True)

    async def astep(self) -> Decision:
        """One step on the running event loop (the tuner's own)."""
        async with self._busy:
            try:
                arrays, missed = await fleet_feedback(self.clients, self.config.window)
                for note in missed:
                    log.warning("a router's feedback is left out of this step: %s", note)
                if arrays is None:
                    return Decision(None, "short-of-samples", 0)
                window = FeedbackWindow(arrays.conf, arrays.pred, arrays.final, arrays.saving_ms, arrays.cost_ms)
                current = await fleet_thresholds(self.clients)
                decision, state = advance(self.state, window, current.values, self.ramps, self.budget, self.config)
            except WindowError as err:
                log.warning("feedback window rejected, keeping the last good thresholds: %s", err)
                return Decision(None, f"rejected: {err}", 0)
            if decision.thresholds is not None:
                pushed = await push_fleet(self.clients, current, decision.thresholds, f"tune-{decision.reason}")
                self.version = pushed.version
                log.info(
                    "thresholds re-tuned (%s%s): agreement %.4f -> %.4f, saving %.2f -> %.2f ms on %d samples",
                    decision.reason,
                    f", {decision.detail}" if decision.detail else "",
                    decision.agreement_before,
                    decision.agreement_after,
                    decision.saving_before_ms,
                    decision.saving_after_ms,
                    decision.samples,
                )
            for words in state.alarm_log[len(self.state.alarm_log) :]:
                log.info("drift alarm: %s", words)
            self.state = state
            if decision.thresholds is not None and self.on_change:
                self.on_change(decision)
            self.history.append(decision)
            return decision

    def step(self) -> Decision:
        """One step now, synchronously (not from a thread whose event loop is running)."""
        with self._calls:
            if self._stop.is_set():
                raise RuntimeError("the tuner is stopped")
            if self._thread.is_alive():
                return asyncio.run_coroutine_threadsafe(self.astep(), self._loop).result()
            return self._loop.run_until_complete(self.astep())

    async def _periodic(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.period_s)
            except TimeoutError:
                pass
            if self._stop.is_set():
                break
            try:
                await self.astep()
            except (ControlError, OSError, ValueError) as err:
                log.warning("autotune step failed: %s", err)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._periodic())

    def start(self) -> AutoTuner:
        with self._calls:
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (after the step in progress, waiting up to `timeout` s) and close the client."""
        with self._calls:
            self._stop.set()
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._wake.set)
                self._thread.join(timeout=timeout)
            if self._thread.is_alive() or self._loop.is_closed():
                return  # a step still in flight: the daemon thread is left to end with the process
            for client in self.clients:
                self._loop.run_until_complete(client.close())
            self._loop.close()
