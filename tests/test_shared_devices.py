"""Worker processes sharing accelerators (`GPUPool.spec.sharedDevices`: several runtimes on one GPU, as
Arlo packs its per-bucket runtimes, and as one GPU holds every cell of the GPU proof): the planner caps
the goodput at what the devices compute, the routers' CPU apart, and the simulator time-slices the
pool's batches on the devices while the routers run on the host."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_planner_service import cpu_profile, cpu_spec
from test_planner_serving_path import THRESHOLDS, _busy

from exitplan.api.resources import GPUPoolSpec, RouterSettings, ServingCosts
from exitplan.planner import PlanInfeasible, plan_service
from exitplan.planner.predict import serving_capacity, serving_path

SERVING = ServingCosts(router_ms=0.05, hop_ms=0.1, threads=1)


def _gpu_pool(capacity: int, devices: int | None) -> dict[str, GPUPoolSpec]:
    pool = GPUPoolSpec(
        capacity=capacity,
        gpu_resource="nvidia.com/gpu",
        memory_bytes=80 << 30,
        link_bandwidth_gbps=100,
        shared_devices=devices,
    )
    return {"gpu": pool}


def _plan(capacity: int, devices: int | None, router_ms: float = SERVING.router_ms):
    profile = cpu_profile("gpu")
    profile.serving = SERVING.model_copy(update={"router_ms": router_ms})
    spec = cpu_spec(router=RouterSettings(replicas=4))
    spec = spec.model_copy(update={"pools": [spec.pools[0].model_copy(update={"name": "gpu"})]})
    return plan_service("minilm", spec, _gpu_pool(capacity, devices), {"gpu": profile}, thresholds=THRESHOLDS)


def test_processes_sharing_one_device_are_capped_at_what_it_computes():
    own = _plan(4, None)
    shared = _plan(4, 1)
    assert own.plan.cells == shared.plan.cells  # the layout is the solver's; the devices cap the prediction
    busy = _busy(shared)  # device-ms per request of the plan's cells (a batch holds the device, whatever threads)
    assert shared.plan.prediction.goodput_rps == pytest.approx(min(own.plan.prediction.goodput_rps, 1000.0 / busy))
    assert shared.plan.prediction.goodput_rps < own.plan.prediction.goodput_rps
    assert any("pool gpu: 1 shared device(s)" in n for n in shared.notes)
    two = _plan(4, 2)
    assert two.plan.prediction.goodput_rps == pytest.approx(min(own.plan.prediction.goodput_rps, 2000.0 / busy))


def test_the_routers_cpu_does_not_join_the_devices():
    """On shared cores the routers' CPU joins the workers' demand; on shared devices it does not (the routers
    run on the host): the cap is the devices over the cells' device time alone, however costly the routers."""
    cheap, costly = _plan(4, 1), _plan(4, 1, router_ms=0.5)
    cap = lambda r: next(n for n in r.notes if "shared device(s)" in n)  # noqa: E731
    assert cap(cheap) == cap(costly) and "routers" not in cap(cheap)


def test_the_simulator_time_slices_the_pool_on_its_devices():
    """The same plan served with its processes on their own devices, then sharing one: the capacity as
    served falls to about what one device computes (the fluid cap), not below half of it."""
    own, shared = _plan(4, None), _plan(4, 1)
    free = serving_capacity(own, 250.0, path=serving_path(own, routers=4)).rate_rps
    sliced_path = serving_path(shared, routers=4)
    assert sliced_path.devices == (("gpu", 1.0),) and sliced_path.cores is None
    sliced = serving_capacity(shared, 250.0, path=sliced_path).rate_rps
    assert sliced < 0.8 * free
    assert 0.5 * shared.plan.prediction.goodput_rps <= sliced <= 1.1 * shared.plan.prediction.goodput_rps


def test_shared_devices_need_a_gpu_resource_and_a_process_each():
    with pytest.raises(ValidationError, match="sharedDevices needs a gpuResource"):
        GPUPoolSpec(capacity=4, gpu_resource="", shared_devices=1)
    with pytest.raises(ValidationError, match="more than the worker processes"):
        GPUPoolSpec(capacity=2, shared_devices=3)


def _plan_in(memory_bytes: int, devices: int | None):
    profile = cpu_profile("gpu")
    profile.serving = SERVING
    spec = cpu_spec(router=RouterSettings(replicas=4))
    spec = spec.model_copy(update={"pools": [spec.pools[0].model_copy(update={"name": "gpu"})]})
    pool = _gpu_pool(4, devices)["gpu"].model_copy(update={"memory_bytes": memory_bytes})
    return plan_service("minilm", spec, {"gpu": pool}, {"gpu": profile}, thresholds=THRESHOLDS)


def test_processes_sharing_a_device_share_its_memory():
    """Four processes on one device each hold a quarter of its memory: a model that fits one device whole is
    split so that each process's blocks fit its quarter, and one too large for a quarter is refused."""
    assert GPUPoolSpec(capacity=4, shared_devices=1, memory_bytes=100).process_memory_bytes == 25
    assert GPUPoolSpec(capacity=5, shared_devices=2, memory_bytes=90).process_memory_bytes == 30  # 3 on the fullest
    assert GPUPoolSpec(capacity=4, memory_bytes=100).process_memory_bytes == 100
    whole = _plan_in(128 << 20, None).plan
    assert {c.split for c in whole.cells} == {0} and len(whole.splits) == 1
    shared = _plan_in(128 << 20, 1).plan
    assert {c.split for c in shared.cells} == {0, 1}  # each process holds half the blocks, in 32 MiB
    with pytest.raises(PlanInfeasible):
        _plan_in(64 << 20, 1)  # 16 MiB per process: not even the plan's smallest split fits
    assert _plan_in(64 << 20, None).plan.cells
