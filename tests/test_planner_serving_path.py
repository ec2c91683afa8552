"""The serving path in the plan (planner/serving_path.py, the cost model's hop): the worker's own work per
batch in every split's time, the routers' CPU and shared cores capping the predicted goodput."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_service import CPU_POOLS, cpu_profile, cpu_spec

from exitplan.api.resources import GPUPoolSpec, RouterSettings, ServingCosts
from exitplan.planner import plan_service
from exitplan.planner.costmodel import CostModel
from exitplan.planner.serving_path import path_limits

THRESHOLDS = {"ramp1": 0.8, "ramp3": 0.8}


def _plan(pools=CPU_POOLS, serving: ServingCosts | None = None, routers: int = 2, **spec):
    profile = cpu_profile()
    profile.serving = serving
    return plan_service(
        "minilm",
        cpu_spec(router=RouterSettings(replicas=routers), **spec),
        pools,
        {"cpu": profile},
        thresholds=THRESHOLDS,
    )


def _busy(result, split0_hop_ms: float = 0.0, colocated: bool = False) -> float:
    """Core-ms per request the plan's cells keep busy: per cell, the share of inputs reaching it x its
    replicas' time per input (split 0's less `split0_hop_ms` per batch, or at its rate in the routers with
    `colocated`), from the problem's rates."""
    problem, plan = result.problem, result.plan
    s = len(plan.splits)
    busy = 0.0
    for c in plan.cells:
        split = plan.splits[c.split]
        k = plan.buckets.index(c.bucket)
        table = problem.colocated_rate if colocated and c.split == 0 else problem.rate
        rate = table[s - 1, 0, split.first_block, split.last_block, k]
        per_input = 1000.0 / rate - (split0_hop_ms / c.batch_size if c.split == 0 else 0.0)
        busy += problem.shares[k] * problem.sigma_in[split.first_block] * per_input
    return busy


def test_the_workers_hop_is_added_once_to_every_splits_time_per_batch():
    plain, hop = cpu_profile(), cpu_profile()
    hop.serving = ServingCosts(router_ms=1.0, hop_ms=0.75)
    pool = CPU_POOLS["cpu"]
    a, b = CostModel(plain, "cpu", pool), CostModel(hop, "cpu", pool)
    s = np.asarray([1.0, 0.6, 0.6, 0.3, 0.3, 0.3, 0.3])
    for kw in ({}, {"expected": True, "transfer": False}):
        ta, tb = a.stage_tables([1, 4], 64, s, [True, True], **kw), b.stage_tables([1, 4], 64, s, [True, True], **kw)
        finite = np.isfinite(ta)
        assert np.array_equal(finite, np.isfinite(tb))
        assert np.allclose(tb[finite] - ta[finite], 0.75)
    assert b.full_model_ms(64) == pytest.approx(a.full_model_ms(64) + 0.75)


def test_without_serving_costs_or_shared_cores_the_prediction_is_the_solvers():
    result = _plan()
    assert not any("serving path limits" in n for n in result.notes)
    assert result.plan.prediction.goodput_rps == pytest.approx(result.solution.goodput)


def test_routers_cap_the_goodput_at_their_cpu_per_request():
    free = _plan(serving=ServingCosts(router_ms=0.0, hop_ms=0.0)).plan.prediction.goodput_rps
    router_ms = 2000.0 / free  # one router at this cost answers half what the workers could
    result = _plan(serving=ServingCosts(router_ms=router_ms, hop_ms=0.0), routers=1)
    assert result.plan.prediction.goodput_rps == pytest.approx(1000.0 / router_ms)
    assert result.plan.prediction.goodput_rps == pytest.approx(free / 2)
    assert any("1 router(s)" in n and "serving path limits" in n for n in result.notes)
    two = _plan(serving=ServingCosts(router_ms=router_ms, hop_ms=0.0), routers=2)
    assert two.plan.prediction.goodput_rps == pytest.approx(free)  # two routers: the workers bind again


def _cores_pools(cores: int | None, capacity: int = 2) -> dict[str, GPUPoolSpec]:
    base = CPU_POOLS["cpu"].model_copy(update={"capacity": capacity, "shared_cores": cores})
    return {"cpu": base}


def test_shared_cores_cap_what_the_workers_compute_together():
    """Two worker processes on one core compute what one does; on two cores, what two do. The bound is
    the cores over the busy time per request, which the test recomputes from the cells and rates."""
    serving = ServingCosts(router_ms=0.5, hop_ms=0.3, threads=1)
    own = _plan(pools=_cores_pools(None), serving=serving)
    one = _plan(pools=_cores_pools(1), serving=serving)
    two = _plan(pools=_cores_pools(2), serving=serving)
    assert own.plan.cells == one.plan.cells  # the same layout: the cap is on the prediction
    # busy core-ms per request: per cell, its share of the inputs reaching it x 1000 / (its replicas' rate)
    busy = _busy(one) + serving.router_ms  # every pool shares cores: the routers run beside the workers
    assert one.plan.prediction.goodput_rps == pytest.approx(min(own.plan.prediction.goodput_rps, 1000.0 / busy))
    assert one.plan.prediction.goodput_rps < own.plan.prediction.goodput_rps
    assert two.plan.prediction.goodput_rps == pytest.approx(min(own.plan.prediction.goodput_rps, 2000.0 / busy))
    assert any("pool cpu: 1 shared core(s)" in n and "and the routers" in n for n in one.notes)


def test_threads_multiply_the_cores_a_worker_keeps_busy():
    one_thread = _plan(pools=_cores_pools(4, capacity=2), serving=ServingCosts(router_ms=0.0, hop_ms=0.0, threads=1))
    four = _plan(pools=_cores_pools(4, capacity=2), serving=ServingCosts(router_ms=0.0, hop_ms=0.0, threads=4))
    limits_1 = path_limits(
        one_thread.inputs,
        one_thread.problem,
        one_thread.plan.splits,
        one_thread.plan.buckets,
        one_thread.plan.cells,
        routers=2,
    )
    limits_4 = path_limits(four.inputs, four.problem, four.plan.splits, four.plan.buckets, four.plan.cells, routers=2)
    (core_1,) = [x.goodput_rps for x in limits_1 if "shared core" in x.what]
    (core_4,) = [x.goodput_rps for x in limits_4 if "shared core" in x.what]
    assert core_4 == pytest.approx(core_1 / 4)


# ---------------------------------------------------------------- the router and split 0 in one process


def _co(colocate: str = "auto", cores: int | None = 1, serving: ServingCosts | None = None, routers: int = 2):
    from exitplan.api.resources import PlannerSettings

    serving = serving or ServingCosts(router_ms=2.0, hop_ms=1.0, colocated_ms=0.8, threads=1)
    return _plan(
        pools=_cores_pools(cores),
        serving=serving,
        routers=routers,
        planner=PlannerSettings(max_splits=2, colocate=colocate),
    )


def test_colocation_is_chosen_where_the_hop_costs_the_shared_cores_more_than_it_gains():
    apart, together = _co("off"), _co("auto")
    assert not apart.plan.colocate and together.plan.colocate
    assert together.plan.splits == apart.plan.splits  # the same layout; split 0 moves into the routers
    assert [(c.split, c.bucket, c.replicas) for c in together.plan.cells] == [
        (c.split, c.bucket, c.replicas) for c in apart.plan.cells
    ]
    # In the routers split 0 has no hop to amortize: it runs the batch that serves most without it, here a
    # smaller one (trimming: a bigger batch runs at its longest row), at least what the hop's batch would
    problem, hop = together.problem, 1.0
    for a, b in zip(apart.plan.cells, together.plan.cells):
        if a.split != 0:
            assert a == b
            continue
        k, p = together.plan.buckets.index(a.bucket), 0
        split = together.plan.splits[0]
        option = (len(together.plan.splits) - 1, p, split.first_block, split.last_block, k)
        at_apart_batch = a.batch_size / (a.batch_size / problem.rate[option] - hop / 1e3)
        assert b.batch_size == problem.colocated_batch[option] and b.batch_size < a.batch_size
        assert problem.colocated_rate[option] >= at_apart_batch > problem.rate[option]
    # The bound recomputed here: per cell its busy time per input (split 0 at its rate in the routers), plus
    # the co-located router's CPU; one shared core.
    busy = _busy(together, colocated=True) + 0.8
    assert together.plan.prediction.goodput_rps == pytest.approx(1000.0 / busy)
    assert together.plan.prediction.goodput_rps > apart.plan.prediction.goodput_rps
    assert any("split 0 runs in the routers" in n for n in together.notes)
    assert together.plan.content_hash() != apart.plan.content_hash()  # what the data plane runs changed


def test_colocation_is_not_chosen_when_it_costs_more_or_was_not_measured():
    dearer = _co(serving=ServingCosts(router_ms=0.5, hop_ms=0.1, colocated_ms=3.0))
    assert not dearer.plan.colocate
    unmeasured = _co(serving=ServingCosts(router_ms=2.0, hop_ms=1.0))
    assert not unmeasured.plan.colocate


def test_colocation_on_says_why_it_cannot():
    from exitplan.planner.errors import PlanInfeasible

    with pytest.raises(PlanInfeasible, match="colocatedMs"):
        _co("on", serving=ServingCosts(router_ms=2.0, hop_ms=1.0))
    forced = _co("on", serving=ServingCosts(router_ms=0.5, hop_ms=0.1, colocated_ms=3.0))
    assert forced.plan.colocate  # on: even where it predicts less


def test_colocation_on_dedicated_accelerators_needs_one_bucket_and_enough_split0_replicas():
    from exitplan.planner.serving_path import why_not_colocate

    result = _co("off", cores=None)
    inp, plan = result.inputs, result.plan
    if len(plan.buckets) > 1:
        assert "share one accelerator" in why_not_colocate(inp, plan.cells, plan.buckets, 1)
    one_bucket = [c for c in plan.cells if c.bucket == plan.buckets[0]]
    replicas = sum(c.replicas for c in one_bucket if c.split == 0)
    assert why_not_colocate(inp, one_bucket, plan.buckets[:1], replicas) is None
    assert "would each take an accelerator" in why_not_colocate(inp, one_bucket, plan.buckets[:1], replicas + 1)
    spread = [*one_bucket, one_bucket[0].model_copy(update={"pool": "other"})]
    assert "spans pools" in why_not_colocate(inp, spread, plan.buckets[:1], 1)


def test_split0_shedding_its_hop_raises_the_cells_goodput_when_they_bind():
    """Routers and cores far from binding: co-located, the solver's goodput rises by split 0's shorter
    batches (recomputed here per (split, bucket): replicas x rate over the inputs reaching it), at least by
    what the same batch gains without the hop, and by what split 0's best batch without it gains."""
    serving = ServingCosts(router_ms=0.001, hop_ms=5.0, colocated_ms=0.001, threads=1)
    apart, together = _co("off", cores=64, serving=serving), _co("auto", cores=64, serving=serving)
    assert together.plan.colocate and together.plan.splits == apart.plan.splits
    assert [(c.split, c.bucket, c.replicas) for c in together.plan.cells] == [
        (c.split, c.bucket, c.replicas) for c in apart.plan.cells
    ]
    problem, plan = apart.problem, apart.plan
    s = len(plan.splits)
    before: dict[tuple[int, int], float] = {}
    same_batch: dict[tuple[int, int], float] = {}
    best_batch: dict[tuple[int, int], float] = {}
    load: dict[tuple[int, int], float] = {}
    for c in plan.cells:
        split = plan.splits[c.split]
        k = plan.buckets.index(c.bucket)
        option = (s - 1, 0, split.first_block, split.last_block, k)
        rate = problem.rate[option]
        shed = c.batch_size / (c.batch_size / rate - 0.005) if c.split == 0 else rate
        best = problem.colocated_rate[option] if c.split == 0 else rate
        key = (c.split, c.bucket)
        before[key] = before.get(key, 0.0) + c.replicas * rate
        same_batch[key] = same_batch.get(key, 0.0) + c.replicas * shed
        best_batch[key] = best_batch.get(key, 0.0) + c.replicas * best
        load[key] = problem.shares[k] * problem.sigma_in[split.first_block]
    floor = min(same_batch[x] / load[x] for x in load) / min(before[x] / load[x] for x in load)
    gain = min(best_batch[x] / load[x] for x in load) / min(before[x] / load[x] for x in load)
    assert gain >= floor > 1.02
    assert apart.plan.prediction.goodput_rps == pytest.approx(apart.solution.goodput)
    assert together.plan.prediction.goodput_rps == pytest.approx(apart.solution.goodput * gain)
