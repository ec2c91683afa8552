"""What the planner predicts a plan served on this machine sustains, beside what a search measures.

`served_capacity` is the planner's capacity as served (planner/predict.py `serving_capacity`) replaying the
very steps `exitplan bench --find-capacity` replays (`exitplan.client.bench.schedule`: the trace's first
seconds rescaled to each rate, with their lengths), with the plan's serving path on this machine and the
load generator, when given its CPU per request, as the process that sends every request on the same cores.

`measured_search` runs a capacity search against a local deployment and reads what the load generator
(this process) spent per request over it, and `background_cores` what other processes keep busy on this
machine while nothing of the service runs: the two figures of the prediction that are not the service's.
"""

from __future__ import annotations

import dataclasses
import resource
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from exitplan.api.plan import Plan
from exitplan.client.bench import schedule
from exitplan.localrun.deployment import LocalDeployment
from exitplan.planner.predict import Served, serving_capacity, serving_path
from exitplan.planner.service import PlanResult

T = TypeVar("T")


def served_capacity(
    result: PlanResult,
    plan: Plan,
    slo_ms: float,
    *,
    trace: Path | None,
    reference: int | None,
    step_s: float,
    sender_ms: float = 0.0,
    background: float = 0.0,
    routers: int = 1,
) -> Served:
    """The planner's capacity for `plan` (as served; `result` planned it or its configuration) on the
    measurement's steps of `step_s` seconds (past the trace's size, its pattern looped, as they are)."""
    result = dataclasses.replace(result, plan=plan)
    path = serving_path(result, routers=routers, sender_ms=sender_ms, background=background)
    top = max(plan.buckets)

    def window(rps: float) -> tuple[np.ndarray, np.ndarray]:
        steps = schedule(trace, max_length=top, reference_max=reference, rps=rps, duration=step_s).trace
        return steps.timestamps, steps.lengths

    return serving_capacity(result, slo_ms, path=path, arrivals=window)


def _cpu_times() -> tuple[float, float, int] | None:
    """(busy jiffies, all jiffies, CPUs) from /proc/stat; None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    fields = [float(x) for x in lines[0].split()[1:]]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields[:8]) - idle, sum(fields[:8]), max(cpus, 1)


def background_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU the machine's processes use over `seconds` (call it while the service does not
    run and this process waits): other load the service's processes will share the cores with. 0.0 where
    /proc/stat cannot be read."""
    first = _cpu_times()
    time.sleep(seconds)
    last = _cpu_times()
    if first is None or last is None or last[1] <= first[1]:
        return 0.0
    return (last[0] - first[0]) / (last[1] - first[1]) * last[2]


def answered(dep: LocalDeployment) -> float:
    """Requests the deployment's routers have answered so far, whatever the status."""
    total = 0.0
    for p in dep.router_procs():
        with urllib.request.urlopen(f"http://{p.address}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "exitplan_router_requests":
                total += sum(x.value for x in family.samples if x.name.endswith("_total"))
    return total


def measured_search(dep: LocalDeployment, search: Callable[[], T]) -> tuple[T, float]:
    """(what `search` returned, this process's CPU per request the routers answered meanwhile, in ms)."""
    before, sent0 = resource.getrusage(resource.RUSAGE_SELF), answered(dep)
    out = search()
    after, sent = resource.getrusage(resource.RUSAGE_SELF), max(answered(dep) - sent0, 1.0)
    return out, (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / sent * 1e3
