"""`run_bench` and `find_capacity`: the Python API behind `exitplan bench` (and `exitplan demo`).

A run: read the router's model metadata (labels, buckets, ramps), load the trace window
(`exitplan.planner.traces.load_trace`, lengths fitted to the largest bucket), match held-out texts
to its lengths, replay it open-loop, and summarize every outcome (see `report.py` for the
definitions).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np

from exitplan.client.capacity import TARGET, CapacityResult, CapacityStep, search_capacity
from exitplan.client.loadgen import Outcome, replay
from exitplan.client.report import BenchReport, summarize
from exitplan.client.texts import HeldoutPool, ReferenceCache, RequestInputs, build_inputs, check_labels, load_pool
from exitplan.planner.traces import LengthMode, Trace, TraceError, default_trace_path, load_trace, looped_trace

DEFAULT_TIMEOUT_S = 30.0
"""Client-side patience per request: far above any SLO the router enforces (its hard timeout is
max(5 x SLO, 2 s)), so a request still unanswered by then is lost, not slow."""


class BenchError(RuntimeError):
    """A run that cannot start (router unreachable, wrong model, bad options); the message says what to fix."""


# ---------------------------------------------------------------------------- the router


@dataclass
class ModelInfo:
    url: str
    model: str
    labels: list[str]
    buckets: list[int]
    ramps: list[str]
    slo_ms: float | None = None
    """The router's SLO (from its /metrics), when it publishes one."""


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def model_info(url: str, model: str) -> ModelInfo:
    """The router's metadata for `model` (GET /v2/models/{model}) and its SLO gauge."""
    base = url.rstrip("/")
    try:
        doc = json.loads(_get(f"{base}/v2/models/{model}"))
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode(errors="replace")
        raise BenchError(f"{base}/v2/models/{model} answered {err.code}: {detail}; check --model") from err
    except (urllib.error.URLError, OSError) as err:
        raise BenchError(f"cannot reach the router at {base}: {err}; start it (`exitplan up`) or fix --url") from err
    except ValueError as err:
        raise BenchError(f"{base}/v2/models/{model} did not return JSON: {err}") from err
    params = doc.get("parameters") or {}
    try:
        labels = [str(v) for v in params["labels"]]
        buckets = [int(b) for b in params["buckets"]]
        ramps = [str(r) for r in params.get("ramps", [])]
    except (KeyError, TypeError, ValueError) as err:
        raise BenchError(
            f"{base}/v2/models/{model}: metadata lacks parameters.labels/buckets ({err}); is this an exitplan router?"
        ) from err
    return ModelInfo(base, model, labels, buckets, ramps, _router_slo_ms(base))


def _router_slo_ms(base: str) -> float | None:
    try:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(_get(f"{base}/metrics", 5.0).decode()):
            if family.name == "exitplan_router_slo_seconds":
                for sample in family.samples:
                    return float(sample.value) * 1000.0
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return None


def router_observations(url: str, token: str | None = None) -> dict[str, Any] | None:
    """The router's observation window in progress, from its control endpoints at `url` with the
    service's control `token` (best effort: None when it cannot be read)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/observations?window=current", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5.0) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------- the trace


@dataclass
class Schedule:
    trace: Trace
    """The window to replay: arrival times (s from the run's start) and fitted lengths."""
    speed: float
    """The speed-up applied to the trace's clock."""
    window_s: float
    """The window's length: `duration` when given, else the last arrival (the rate is requests / window)."""

    @property
    def rate(self) -> float:
        return len(self.trace) / self.window_s if self.window_s > 0 else float(len(self.trace))


def schedule(
    trace: str | Path | None,
    *,
    max_length: int,
    length_mode: LengthMode = "scale",
    reference_max: int | None = None,
    rps: float | None = None,
    speed: float = 1.0,
    start: float = 0.0,
    duration: float | None = None,
    limit: int | None = None,
) -> Schedule:
    """The trace window to replay, sped up by `speed` or rescaled so that its rate is `rps`.

    With `rps` (and `start` = 0) the speed-up is exact: with a `duration`, the window holds
    round(rps x duration) requests; with only a `limit`, its requests span limit / rps seconds. A window
    that needs more requests than the whole trace holds loops the trace's pattern (scaled to `rps`, back
    to back, each arrival with its own length) until `duration` is covered, so a fast service is not held
    to the trace's size.
    Otherwise (a `start` offset moves the window as the speed changes) it is refined a few times
    and the closest is kept. The rate achieved is reported either way.
    """
    path = Path(trace) if trace is not None else default_trace_path()
    _check_window(rps, speed, start, duration, limit)

    def window(s: float) -> Schedule:
        cut = load_trace(
            path,
            max_length=max_length,
            length_mode=length_mode,
            reference_max=reference_max,
            speed=s,
            start=start,
            duration=duration,
            limit=limit,
        )
        return Schedule(cut, s, duration if duration is not None else cut.duration)

    try:
        if rps is None:
            return window(speed)
        full = load_trace(path, max_length=max_length, length_mode=length_mode, reference_max=reference_max)
        times = full.timestamps
        factor = rps / full.mean_rate
        if duration is not None:
            want = max(1, round(rps * duration))
            if limit is not None:
                want = min(want, limit)
            if start == 0 and want >= len(times):  # the whole trace and more: its pattern looped
                return _looped(full, rps, duration, limit)
            if start == 0 and want < len(times) and times[want] > times[want - 1]:
                factor = float(times[want]) / duration  # the (want+1)-th arrival lands exactly at the window's end
            elif start > 0:  # the window moves with the speed: scan speeds for the count closest to `want`
                grid = factor * np.geomspace(1 / 8, 8, 4001)
                counts = np.searchsorted(times, (start + duration) * grid) - np.searchsorted(times, start * grid)
                miss = np.abs(np.minimum(counts, want if limit is None else limit) - want)
                closest = np.flatnonzero(miss == miss.min())
                factor = float(grid[closest[np.argmin(np.abs(np.log(grid[closest] / factor)))]])
        elif start == 0 and limit is not None and limit >= 2:
            last = float(times[min(limit, len(times)) - 1])
            if last > 0:
                factor = rps * last / min(limit, len(times))
        best = current = window(factor)
        for _ in range(8):
            if abs(best.rate / rps - 1.0) < 0.005 or current.rate <= 0:
                break
            current = window(current.speed * rps / current.rate)
            if abs(current.rate / rps - 1.0) < abs(best.rate / rps - 1.0):
                best = current
        return best
    except TraceError as err:
        raise BenchError(str(err)) from err


def _check_window(rps: float | None, speed: float, start: float, duration: float | None, limit: int | None) -> None:
    if rps is not None and rps <= 0:
        raise BenchError(f"--rps must be > 0, got {rps}")
    if speed <= 0:
        raise BenchError(f"--speed must be > 0, got {speed}")
    if duration is not None and duration <= 0:
        raise BenchError(f"--duration must be > 0 seconds, got {duration}")
    if limit is not None and limit < 1:
        raise BenchError(f"--limit must be >= 1, got {limit}")
    if start < 0:
        raise BenchError(f"--start must be >= 0 seconds, got {start}")


def _looped(full: Trace, rps: float, duration: float, limit: int | None) -> Schedule:
    """`schedule`'s window past the trace's size: its pattern looped at `rps` over `duration` seconds."""
    times, lengths = looped_trace(full.timestamps, full.lengths, rps, duration)
    want = round(rps * duration)
    if 0 < len(times) != want:  # the pattern's bursts put a few more or fewer in: once more at the corrected rate
        times, lengths = looped_trace(full.timestamps, full.lengths, rps * want / len(times), duration)
    if limit is not None:
        times, lengths = times[:limit], lengths[:limit]
    return Schedule(Trace(times, lengths, full.source), rps / full.mean_rate, duration)


# ---------------------------------------------------------------------------- one run


@dataclass
class BenchSetup:
    """What several runs against one router share: its metadata, the held-out pool, cached references."""

    info: ModelInfo
    pool: HeldoutPool
    references: ReferenceCache = field(init=False)
    control_url: str | None = None
    """The router's control endpoints (for its own observations in the report; default: `info.url`)."""
    control_token: str | None = None

    def __post_init__(self) -> None:
        check_labels(self.pool, self.info.labels)
        self.references = ReferenceCache(self.pool)

    @classmethod
    def connect(cls, url: str, model: str, bundle: str | Path) -> BenchSetup:
        return cls(model_info(url, model), load_pool(bundle))

    def retarget(self, url: str, model: str) -> BenchSetup:
        """The same texts and cached references against the router at `url` (its metadata read afresh:
        another deployment may serve other buckets)."""
        fresh = BenchSetup(model_info(url, model), self.pool)
        fresh.references = self.references
        if fresh.info.url == self.info.url:  # the same router: the same control endpoints
            fresh.control_url, fresh.control_token = self.control_url, self.control_token
        return fresh


def _checked_slo(info: ModelInfo, slo_ms: float | None, timeout_s: float) -> float:
    """The SLO to judge the run by (`slo_ms`, else the router's); BenchError when it or the client
    timeout is unusable."""
    slo = slo_ms if slo_ms is not None else info.slo_ms
    if slo is None:
        raise BenchError("the router publishes no SLO; pass --slo-ms")
    if slo <= 0:
        raise BenchError(f"--slo-ms must be > 0, got {slo}")
    if timeout_s <= 0:
        raise BenchError(f"the client timeout must be > 0 seconds, got {timeout_s}")
    return slo


def _inputs_summary(window: Trace, inputs: RequestInputs, pool: HeldoutPool) -> dict[str, Any]:
    """How well the sent inputs match the trace window's lengths (the report's `run.inputs`)."""
    return {
        "target_length_mean": float(window.lengths.mean()),
        "sent_length_mean": float(inputs.lengths.mean()),
        "length_abs_error_mean": float(abs(inputs.lengths - window.lengths).mean()),
        "concatenated": inputs.concatenated,
        "distinct_inputs": len(set(inputs.parts)),
        "heldout_size": len(pool),
    }


class ReplayOptions(TypedDict, total=False):
    """How a run sends and judges its requests: the keyword arguments that `run_bench`, `run_bench_async`
    and `find_capacity` take (each one's default and meaning: `RunOptions`)."""

    slo_ms: float | None
    seed: int
    length_mode: LengthMode
    reference_max: int | None
    timeout_s: float
    progress: bool
    binary: bool


class WindowOptions(ReplayOptions, total=False):
    """`ReplayOptions` and the window of the trace a run replays: `run_bench`'s keyword arguments."""

    rps: float | None
    speed: float
    start: float
    duration: float | None
    limit: int | None


@dataclass(frozen=True)
class RunOptions:
    """One run's options with their defaults (`WindowOptions` given, the rest as here)."""

    rps: float | None = None
    """Rescale the trace window to this mean rate (else `speed` speeds its clock up)."""
    speed: float = 1.0
    start: float = 0.0
    """Seconds into the trace (after the speed-up) where the window starts."""
    duration: float | None = None
    """The window's length in seconds (after the speed-up)."""
    limit: int | None = None
    """At most this many requests."""
    slo_ms: float | None = None
    """The SLO the run is judged by (default: the router's own)."""
    seed: int = 0
    length_mode: LengthMode = "scale"
    """How trace lengths fit the router's largest bucket: "scale" (the trace's longest input, or
    `reference_max` tokens, maps onto it) or "clip" (lengths are capped)."""
    reference_max: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress: bool = False
    binary: bool = False
    """Send the inputs as binary tensors (the Open Inference Protocol's binary tensor extension)."""

    def run_record(self, window: Trace, plan: Schedule, info: ModelInfo) -> dict[str, Any]:
        """How the run was set up (the report's `run`), without its inputs."""
        return {
            "trace": window.source,
            "trace_name": Path(window.source).name,
            "length_mode": self.length_mode,
            "reference_max": self.reference_max,
            "speed": plan.speed,
            "target_rps": self.rps,
            "start_s": self.start,
            "duration_s": self.duration,
            "limit": self.limit,
            "window_s": plan.window_s,
            "seed": self.seed,
            "timeout_s": self.timeout_s,
            "binary": self.binary,
            "buckets": info.buckets,
        }


async def run_bench_async(
    setup: BenchSetup, trace: str | Path | None = None, **options: Unpack[WindowOptions]
) -> BenchReport:
    """One open-loop run with `setup`'s router and held-out texts; see `run_bench`."""
    opts = RunOptions(**options)
    info = setup.info
    slo = _checked_slo(info, opts.slo_ms, opts.timeout_s)
    plan = await asyncio.to_thread(
        schedule,
        trace,
        max_length=max(info.buckets),
        length_mode=opts.length_mode,
        reference_max=opts.reference_max,
        rps=opts.rps,
        speed=opts.speed,
        start=opts.start,
        duration=opts.duration,
        limit=opts.limit,
    )
    window = plan.trace
    inputs = await asyncio.to_thread(  # may run the full model on concatenations: off the event loop
        build_inputs,
        setup.pool,
        window.lengths,
        max_length=max(info.buckets),
        seed=opts.seed,
        references=setup.references,
        progress=opts.progress,
        binary=opts.binary,
    )
    outcomes = await _replay_with_progress(
        info, inputs.bodies, window.timestamps, opts.timeout_s, opts.progress, inputs.headers or None
    )
    run = {**opts.run_record(window, plan, info), "inputs": _inputs_summary(window, inputs, setup.pool)}
    report = summarize(
        outcomes,
        inputs.reference,
        inputs.truth,
        slo_ms=slo,
        url=info.url,
        model=info.model,
        ramp_order=info.ramps,
        window_s=plan.window_s,
        run=run,
    )
    report.router = await asyncio.to_thread(router_observations, setup.control_url or info.url, setup.control_token)
    return report


async def _replay_with_progress(
    info: ModelInfo,
    bodies: Sequence[bytes],
    arrivals: np.ndarray,
    timeout_s: float,
    progress: bool,
    headers: Sequence[Mapping[str, str]] | None = None,
) -> list[Outcome]:
    if not progress:
        return await replay(info.url, info.model, bodies, arrivals, timeout_s=timeout_s, headers=headers)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    counts = {"ok": 0, "err": 0, "lost": 0}
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ok {task.fields[ok]}  errors {task.fields[err]}  lost {task.fields[lost]}"),
    ]
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(f"replaying {len(bodies)} requests", total=len(bodies), ok=0, err=0, lost=0)

        def done(outcome: Outcome) -> None:
            key = "ok" if outcome.kind == "ok" else "lost" if outcome.kind == "lost" else "err"
            counts[key] += 1
            bar.update(task, advance=1, ok=counts["ok"], err=counts["err"], lost=counts["lost"])

        return await replay(info.url, info.model, bodies, arrivals, timeout_s=timeout_s, on_done=done, headers=headers)


def run_bench(
    url: str,
    model: str,
    bundle: str | Path,
    trace: str | Path | None = None,
    *,
    setup: BenchSetup | None = None,
    **options: Unpack[WindowOptions],
) -> BenchReport:
    """One open-loop run of `trace` (default: the shared Azure trace) against the router at `url`.

    `rps` rescales the trace window to that mean rate, else `speed` speeds it up; `start`/`duration`
    (seconds, after the speed-up) and `limit` (requests) bound the run. Trace lengths are fitted to
    the router's largest bucket by `length_mode` ("scale": the trace's longest input, or
    `reference_max` tokens, maps onto it; "clip": lengths are capped). `slo_ms` defaults to the
    router's own SLO. `setup` (from `BenchSetup.connect`) reuses the tokenized held-out texts and the
    full model's answers for concatenations across runs (the router's metadata is read again each run).
    `binary` sends the inputs as binary tensors (the Open Inference Protocol's binary tensor extension).
    The options and their defaults: `RunOptions`.
    """
    setup = setup.retarget(url, model) if setup is not None else BenchSetup.connect(url, model, bundle)
    return asyncio.run(run_bench_async(setup, trace, **options))


# ---------------------------------------------------------------------------- capacity


def find_capacity(
    url: str,
    model: str,
    bundle: str | Path,
    trace: str | Path | None = None,
    *,
    setup: BenchSetup | None = None,
    start_rps: float = 5.0,
    max_rps: float = 1000.0,
    min_rps: float = 0.25,
    resolution: float = 0.05,
    step_duration: float = 10.0,
    max_steps: int = 10,
    target: float = TARGET,
    on_step: Callable[[CapacityStep], None] | None = None,
    settle_s: float = 0.0,
    **options: Unpack[ReplayOptions],
) -> CapacityResult:
    """The capacity within the SLO: the highest offered rate at which at least `target` (99 %) of the
    requests finish within it, over a step and over its last third (errors and lost requests are misses).

    Each step replays the first `step_duration` seconds of the trace window rescaled to its rate (the
    same arrivals, closer together, at every rate); the search doubles from `start_rps` until a step
    misses (halves while they miss), then bisects until the rate that passed and the rate that missed
    are within `resolution` of each other, or after `max_steps` steps, or at `max_rps` / `min_rps`
    (see `exitplan.client.capacity`). With `settle_s`, the first step and every step after a miss
    follow `settle_s` seconds of the trace at a rate that passed (half the first step's before any did),
    not counted: the service recovers from the miss before the next rate is judged.
    """
    connected = setup.retarget(url, model) if setup is not None else BenchSetup.connect(url, model, bundle)
    if start_rps <= 0 or step_duration <= 0 or max_steps < 1 or settle_s < 0:
        raise BenchError("start_rps and step_duration must be > 0, max_steps >= 1 and settle_s >= 0")
    if not 0 < min_rps <= max_rps or resolution <= 0 or not 0 < target <= 1:
        raise BenchError("need 0 < min_rps <= max_rps, resolution > 0 and a target share within (0, 1]")

    def probe(rps: float, duration: float = step_duration) -> BenchReport:
        return asyncio.run(run_bench_async(connected, trace, rps=rps, duration=duration, **options))

    return search_capacity(
        probe,
        start_rps=start_rps,
        max_rps=max_rps,
        min_rps=min_rps,
        resolution=resolution,
        max_steps=max_steps,
        target=target,
        on_step=on_step,
        settle=(lambda rps: probe(rps, settle_s)) if settle_s > 0 else None,
    )
