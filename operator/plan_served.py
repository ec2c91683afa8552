"""The plan's capacity as served, for PlanAccurate (plan_accuracy.py): simulated in the planner's threads
once per plan, when a window first reads below the solver's rate.

The solver's rate assumes every replica busy with full batches; served, a plan can hold its SLO only at
a lower rate (planner/predict.py). A window below the solver's rate is therefore judged again against
the plan as served before it counts towards a mismatch, so a plan whose serving path costs what the
simulator says is not re-profiled for it. The simulation uses the profiles the plan in force was made
with (the measured corrections when the drift loop's re-plan applied them).
"""

from __future__ import annotations

import logging

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import plan_accuracy
from exitplan.operator.drift_policy import DriftState
from exitplan.operator.executors import run_planner
from exitplan.operator.service_state import Service, read_inputs
from exitplan.planner.predict import plan_as_served

log = logging.getLogger(__name__)


async def served_rps(svc: Service, state: DriftState, spec: EarlyExitServiceSpec, plan: Plan) -> float:
    """The plan's capacity as served (0.0 when it cannot be simulated: the reason is logged)."""
    tracker = state.accuracy
    try:
        inputs = await read_inputs(svc.client, spec, svc.namespace)
        if inputs.unknown_pools or inputs.missing_profiles:
            log.info("%s/%s: no capacity as served: pools or profiles missing", svc.namespace, svc.name)
            return 0.0
        profiles = tracker.correct(inputs.profiles) if tracker.corrected_key == tracker.plan_key else inputs.profiles
        served = await run_planner(plan_as_served, spec, inputs.pools, profiles, plan)
    except Exception as err:  # a judgement against the solver's rate is still sound: never fail the loop
        log.warning("%s/%s: the plan's capacity as served was not simulated: %s", svc.namespace, svc.name, err)
        return 0.0
    log.info(
        "%s/%s: plan %s as served %.1f req/s (solver %.1f; %d simulated runs)",
        svc.namespace,
        svc.name,
        plan.content_hash(),
        served.rate_rps,
        plan.prediction.goodput_rps,
        served.probes,
    )
    return served.rate_rps


async def compare(
    svc: Service, state: DriftState, spec: EarlyExitServiceSpec, plan: Plan, window: Observations
) -> plan_accuracy.Judgement:
    """Judge a full window against the plan (plan_accuracy.judge), against the plan as served when it reads
    below the solver's rate, and count it (Tracker.record)."""
    tracker = state.accuracy
    verdict = plan_accuracy.judge(plan, window, tracker.served)
    if tracker.needs_served(verdict):
        tracker.served = await served_rps(svc, state, spec, plan)
        verdict = plan_accuracy.judge(plan, window, tracker.served)
    return tracker.record(verdict)
