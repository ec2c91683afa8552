"""The operator's call of the planner: thresholds for a first plan, then plan_service in the planner's threads.

Owns the one place a classification service is planned (`plan_in_executor`: never on the event loop,
its solve time a metric, each plan counted by reason) and the first plan's thresholds
(`initial_thresholds`, tuned on the bundle's calibration window when the operator can read the bundle).
A generation service is planned in generation_reconcile.py, a capacity check in capacity.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator.executors import run_planner
from exitplan.operator.metrics import METRICS
from exitplan.operator.names import bundle_path
from exitplan.operator.service_state import ServiceResources
from exitplan.planner import plan_service
from exitplan.planner.problem import OptionCache
from exitplan.planner.tuning.initial import initial_thresholds as tune_initial

log = logging.getLogger("exitplan.operator")


def initial_thresholds(spec: EarlyExitServiceSpec, bounds: list[int] | None = None) -> dict[str, float] | None:
    """Thresholds for a first plan: tuned on the bundle's calibration window under the accuracy
    budget in every length stratum (`bounds`: the service's length buckets; calibration.py) when
    the operator can read the bundle (a local path: the dev-cluster, a mounted volume); else None,
    and the live tuner in the drift loop sets them from the routers' feedback."""
    bundle = Path(bundle_path(spec.model.bundle))
    if not (bundle / "bundle.yaml").is_file():
        return None
    try:
        thresholds, strata = tune_initial(bundle, spec.accuracy.max_drop, bounds or [])
    except (ValueError, OSError, KeyError) as err:
        log.warning("initial thresholds not tuned (%s); the drift loop tunes them from live feedback", err)
        return None
    log.info(
        "initial thresholds %s: disagreement per length stratum on the calibration window %s (budget %g)",
        {k: round(v, 4) for k, v in thresholds.items()},
        [(n, round(d, 4)) for n, d in strata],
        spec.accuracy.max_drop,
    )
    return thresholds


async def plan_in_executor(
    name: str,
    namespace: str,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    *,
    reason: str,
    previous: Plan | None = None,
    observations: Observations | None = None,
    keep_layout: bool = False,
    cache: OptionCache | None = None,
) -> Plan:
    """The planner's entry point in a worker thread (never on the event loop); solve time is a metric.
    `cache`: the service's planner OptionCache (operator/plan_memory.py), kept between its plans."""
    thresholds = dict(observations.thresholds) if observations and observations.thresholds else None
    if thresholds is None and previous is None:
        bounds = list(spec.workload.length_buckets) or sorted(
            {int(n) for p in inputs.profiles.values() for n in p.seq_lens}
        )
        thresholds = await run_planner(initial_thresholds, spec, bounds)

    def solve() -> Plan:
        started = time.perf_counter()
        try:
            result = plan_service(
                name,
                spec,
                inputs.pools,
                inputs.profiles,
                thresholds=thresholds,
                observations=observations,
                previous=previous,
                reason=reason,
                keep_layout=keep_layout,
                cache=cache,
            )
        finally:
            METRICS.record_solve(namespace, name, time.perf_counter() - started)
        return result.plan

    plan = await run_planner(solve)  # the planner's own threads (executors.py)
    METRICS.replans.labels(namespace, name, reason).inc()
    return plan
