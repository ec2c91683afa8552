"""The plan's capacity as served (planner/predict.py): the routers' CPU, shared cores and admission count."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exitplan.api.resources import (
    SLO,
    EarlyExitServiceSpec,
    ModelRef,
    PlannerSettings,
    PoolRef,
    RouterSettings,
    ServingCosts,
)
from exitplan.planner.compare import plan_config
from exitplan.planner.predict import serving_capacity, serving_path
from exitplan.planner.sim_cores import SharedCores
from exitplan.planner.sim_path import RouterState, ServingPath
from exitplan.planner.simulator import Simulation
from exitplan.planner.synthetic import bert_base_profile, gpu_pool

SLO_MS = 100.0


def _plan(router_ms: float, *, shared_cores: int | None = None, gpus: int = 4, colocate: str = "off", seq=(128,)):
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=SLO_MS),
        pools=[PoolRef(name="v100")],
        planner=PlannerSettings(max_splits=1, colocate=colocate),
        router=RouterSettings(replicas=1),
    )
    pool = gpu_pool("v100", gpus).model_copy(update={"shared_cores": shared_cores})
    profile = bert_base_profile("v100", seq_lens=seq).model_copy(
        update={"serving": ServingCosts(router_ms=router_ms, hop_ms=0.1, threads=1)}
    )
    return plan_config("vanilla", "bert", spec, {"v100": pool}, {"v100": profile}, lengths=[128] * 100)


def test_the_routers_cpu_bounds_what_is_served():
    """One router at 2 ms per request answers at most 500 req/s, however many GPUs stand behind it; with
    the SLO's room for its queue it serves most of that."""
    result = _plan(2.0, gpus=8)
    path = serving_path(result)
    assert path.router_ms == 2.0 and path.routers == 1 and path.cores is None
    got = serving_capacity(result, SLO_MS, seconds=6.0)
    assert 0.7 * 500.0 <= got.rate_rps <= 500.0, got.rate_rps
    assert got.run is not None and got.run.attainment >= 0.99
    # without the router's cost the same GPUs serve several times more
    free = serving_capacity(result, SLO_MS, path=ServingPath(), seconds=6.0)
    assert free.rate_rps > 2 * got.rate_rps, (free.rate_rps, got.rate_rps)


def test_shared_cores_bound_the_workers_routers_and_the_sender_together():
    """Workers, router and a load generator on one core: the core's 1000 ms per second over the CPU every
    request takes beside the workers' is an upper bound, and the served capacity falls below the capacity
    with the same router on cores of its own."""
    result = _plan(0.5, shared_cores=1)
    alone = serving_capacity(result, SLO_MS, path=ServingPath(router_ms=0.5), seconds=6.0).rate_rps
    path = serving_path(result, sender_ms=1.0)
    assert path.cores == 1.0 and path.sender_ms == 1.0
    shared = serving_capacity(result, SLO_MS, path=path, seconds=6.0).rate_rps
    assert 0 < shared <= 1000.0 / (0.5 + 1.0), shared
    assert shared < 0.9 * alone, (shared, alone)


def test_processor_sharing_slows_every_thread_while_the_cores_are_oversubscribed_and_conserves_work():
    """planner/sim_cores.py: on two cores, three one-thread jobs run at 2/3 speed; when one ends the others
    speed up at once (a speed fixed at their start would leave a core idle)."""
    cores: SharedCores[str] = SharedCores(2.0)
    for name, ms in (("a", 1.0), ("b", 3.0), ("c", 3.0)):
        cores.start(0.0, ms, 1, name)
    assert cores.speed() == pytest.approx(2 / 3)
    assert cores.due() == pytest.approx(0.0015)  # a: 1 ms of work at 2/3 speed
    assert cores.finished(0.0015) == ["a"]
    assert cores.speed() == 1.0 and cores.due() == pytest.approx(0.0035)  # b, c: 2 ms left each, a core each
    assert cores.finished(0.0035) == ["b", "c"] and cores.due() == math.inf
    # 8 core-ms of work (a batch of two threads for 3 ms, a router's 2 ms from 1 ms on) on two cores: all done at 4 ms
    batch: SharedCores[str] = SharedCores(2.0)
    batch.start(0.0, 3.0, 2, "batch of two threads")
    assert batch.speed() == 1.0
    batch.start(0.001, 2.0, 1, "router")
    assert batch.speed() == pytest.approx(2 / 3)
    done_at = []
    while batch.jobs:
        t = batch.due()
        done_at += [(name, round(t * 1e3, 6)) for name in batch.finished(t)]
    assert done_at == [("batch of two threads", 4.0), ("router", 4.0)]
    # other load beside them: two cores' worth always running, one job at 2/3 speed
    loaded: SharedCores[str] = SharedCores(2.0, background=1.0)
    loaded.start(0.0, 1.0, 2, "x")
    assert loaded.due() == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="cores > 0"):
        SharedCores(0.0)


def test_the_sender_and_a_router_each_take_one_request_at_a_time_in_order():
    """A simulated run's sender and routers (planner/sim_path.py RouterState): FIFO per process, the sender
    before the routers, the routers round robin; where neither costs anything a request is admitted at once."""
    state = RouterState(ServingPath(router_ms=1.0, sender_ms=0.5, routers=2, cores=2.0), [100.0], 0.1)
    assert state.first_stop() == state.sender == 2
    assert state.join(2, 7) and not state.join(2, 8)  # 8 waits for 7
    assert state.done(2) == 8 and state.done(2) is None
    assert [state.next_stop() for _ in range(3)] == [0, 1, 0]
    assert state.work_ms(2) == 0.5 and state.work_ms(0) == 1.0
    free = RouterState(ServingPath(), [100.0], 0.1)
    assert free.first_stop() is None


def test_a_trimming_worker_reports_its_capacity_at_the_lengths_it_runs():
    """Admission starts from the capacity the pods report; a CPU worker that trims reports it at its
    batches' lengths: short inputs in a long bucket give a higher capacity than the bucket's length."""
    result = _plan(0.0, seq=(16, 32, 64, 128))
    sim = Simulation(result.plan, {m.pool_name: m for m in result.inputs.models}, SLO_MS, trim=[8, 16, 128])
    at_bucket = list(sim.capacity)
    rng = np.random.default_rng(0)
    sim.run(np.sort(rng.uniform(0, 1, 50)), np.full(50, 12))
    assert sim.capacity[0] > 1.5 * at_bucket[0], (sim.capacity, at_bucket)


@pytest.mark.parametrize(
    "kwargs", [{"router_ms": -1.0}, {"sender_ms": -1.0}, {"routers": 0}, {"threads": 0}, {"cores": 0.0}]
)
def test_an_impossible_serving_path_is_refused(kwargs):
    with pytest.raises(ValueError, match="invalid serving path"):
        ServingPath(**kwargs)


def test_the_prediction_on_a_searchs_own_steps_counts_the_load_generator(shared_trace):
    """localrun/prediction.py: the plan replayed on the trace windows a capacity search sends, at most the
    rate at which one step holds the whole trace; a load generator on the shared cores lowers it."""
    from exitplan.localrun.prediction import served_capacity

    result = _plan(0.5, shared_cores=2, seq=(16, 32, 64, 128))
    alone = served_capacity(result, result.plan, SLO_MS, trace=shared_trace, reference=None, step_s=4.0)
    busy = served_capacity(result, result.plan, SLO_MS, trace=shared_trace, reference=None, step_s=4.0, sender_ms=1.0)
    assert alone.path.sender_ms == 0.0 and busy.path.sender_ms == 1.0 and busy.path.cores == 2.0
    assert 0 < busy.rate_rps < alone.rate_rps, (busy.rate_rps, alone.rate_rps)
    assert busy.rate_rps <= 1000.0  # the sender alone: 1 ms per request on one core
    assert busy.run is not None and busy.run.attainment >= 0.99


def test_other_load_on_the_cores_is_read_from_proc_stat_and_shares_them():
    """A busy loop beside the service: /proc/stat shows it (about a core), and the simulation counts such
    load as always running, so a batch on two cores beside two cores' worth of it takes 1.5x as long."""
    import subprocess
    import sys

    from exitplan.localrun.prediction import background_cores

    cores: SharedCores[str] = SharedCores(2.0, background=2.0)
    cores.start(0.0, 1.0, 1, "batch")
    assert cores.due() == pytest.approx(0.0015)
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert background_cores(1.0) >= 0.5
    finally:
        loop.kill()
        loop.wait()


def test_a_plan_read_back_is_simulated_at_its_own_mix_and_survival():
    """planner/predict.py `plan_as_served` (the operator's PlanAccurate): the plan as written, its inputs
    resolved again from the spec, pools and profiles, at the plan's length mix and survival."""
    from exitplan.planner.predict import at_plan_mix, plan_as_served
    from exitplan.planner.service import plan_service

    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=SLO_MS),
        pools=[PoolRef(name="v100")],
        planner=PlannerSettings(max_splits=2),
        router=RouterSettings(replicas=1),
    )
    pools = {"v100": gpu_pool("v100", 4)}
    profile = bert_base_profile("v100", seq_lens=(32, 64, 128)).model_copy(
        update={"serving": ServingCosts(router_ms=1.0, hop_ms=0.1, threads=1)}
    )
    lengths = [32] * 70 + [128] * 30
    thresholds = {r.name: 0.9 for r in profile.ramps}
    result = plan_service("svc", spec, pools, {"v100": profile}, lengths=lengths, thresholds=thresholds)
    plan = result.plan
    back = at_plan_mix(spec, pools, {"v100": profile}, plan)
    assert back.plan is plan and back.inputs.survival == pytest.approx(plan.survival)
    shares = {b: float(back.inputs.mass[back.inputs.grid.index(b)]) for b in plan.buckets}
    assert list(shares.values()) == pytest.approx(plan.length_histogram)
    served = plan_as_served(spec, pools, {"v100": profile}, plan)
    fluid = plan.prediction.goodput_rps
    # one router at 1 ms per request: the solver's rate is capped at its 1,000 req/s on average; served,
    # with bursts and batches that do not fill, less
    assert 0 < served.rate_rps < fluid <= 1000.0, (served.rate_rps, fluid)
    assert served.run is not None and served.run.attainment >= 0.99
    direct = serving_capacity(result, SLO_MS, path=serving_path(result), seconds=4.0, tol=0.02)
    assert served.rate_rps == pytest.approx(direct.rate_rps, rel=0.15)
