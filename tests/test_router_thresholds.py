"""One versioned set of thresholds per service, the same on every router (worker_image/threshold_set.py,
worker_image/classify/router_thresholds.py, worker_image/router_fleet.py).

On a real local deployment (the digits bundle, 2 and then 3 routers behind the front, as `exitplan up
--routers N` runs them): a POST to one router is merged into the set in force (the ramps it leaves out
keep their values) as the next version, and every router and the worker serve that version as soon as
the POST is answered; `"replace": true` replaces the whole set; a set given to one router only (a
versioned post, not forwarded) reaches the others through their sync; a tuning step of the tuner of
`exitplan up`, on the feedback of every router, leaves every router on the version it pushed; the
answers and the model metadata name the version. Loops that wait are hang guards, not deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import free_port_block, service_spec

from exitplan.api.bundle import read_manifest
from exitplan.localrun.autotune import AutoTuner
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan
from exitplan.planner.tuning.autotune import LIVE
from exitplan.worker_image.control_bodies import FeedbackArrays
from exitplan.worker_image.router_fleet import merge_feedback
from exitplan.worker_image.threshold_set import ThresholdHolder, ThresholdSet

PATH = "/v2/models/digits/infer"
HANG_GUARD_S = 120.0


def test_the_newest_version_wins_whatever_the_order_and_a_tie_is_broken_the_same_everywhere():
    a, b = ThresholdSet({"r0": 0.9, "r1": 0.8}, 3), ThresholdSet({"r0": 0.5, "r1": 0.8}, 3)
    newest = ThresholdSet({"r0": 0.7}, 4)
    ends = set()
    for order in ([a, b, newest], [newest, b, a], [b, a, newest]):
        holder = ThresholdHolder(ThresholdSet({"r0": 2.0, "r1": 2.0}, 0))
        for s in order:
            holder.adopt(s, "api")
        ends.add(holder.current.key())
    assert ends == {newest.key()}
    tie = ThresholdHolder(ThresholdSet())
    tie.adopt(a, "api"), tie.adopt(b, "api")
    other = ThresholdHolder(ThresholdSet())
    other.adopt(b, "api"), other.adopt(a, "api")
    assert tie.current == other.current  # the digest decides, the same on both


def test_a_post_merges_unless_it_replaces():
    held = ThresholdSet({"r0": 0.98, "r1": 0.99}, 5)
    assert held.changed({"r0": 0.5}, replace=False, version=None) == ThresholdSet({"r0": 0.5, "r1": 0.99}, 6)
    assert held.changed({"r0": 0.5}, replace=True, version=None) == ThresholdSet({"r0": 0.5}, 6)
    assert held.changed({"r1": 0.9}, replace=False, version=9).version == 9


def test_a_new_unversioned_plan_is_the_next_version_and_the_same_plan_again_changes_nothing():
    holder = ThresholdHolder(ThresholdSet({"r0": 0.9}, 4))
    assert not holder.adopt_plan({"r0": 0.9}, 0)
    assert holder.adopt_plan({"r0": 0.8}, 0) and holder.current == ThresholdSet({"r0": 0.8}, 5)
    assert not holder.adopt_plan({"r0": 0.1}, 2)  # an older versioned plan: the routers' set stands


async def test_a_pod_that_missed_a_push_counts_the_change_under_the_reason_it_was_made_for():
    """A pod behind is caught up with the set in force under that set's own reason (a plan update stays a
    plan update on the pod that read it from the pusher, not from its own plan file)."""
    from aiohttp import web

    from exitplan.worker_image.peer_choice import Peer, PeerSet
    from exitplan.worker_image.threshold_push import catch_up

    posted: list[dict] = []

    async def thresholds(request: web.Request) -> web.Response:
        posted.append(await request.json())
        return web.json_response({"thresholds": posted[-1]["thresholds"], "version": posted[-1]["version"]})

    app = web.Application()
    app.router.add_post("/v1/thresholds", thresholds)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        holder = ThresholdHolder(ThresholdSet({"r0": 0.9}, 4))
        assert holder.adopt_plan({"r0": 0.8}, 0) and holder.reason == "plan-update"
        peers = PeerSet([])
        peers.peers["p"] = Peer(f"127.0.0.1:{port}", ready=True, thresholds_key=(4, "x"))
        async with aiohttp.ClientSession() as session:
            await catch_up(session, peers, holder)
            assert [(p["reason"], p["version"]) for p in posted] == [("plan-update", 5)]
            holder.adopt(ThresholdSet({"r0": 0.7}, 6), "tune-accuracy")
            await catch_up(session, peers, holder)
            assert [p["reason"] for p in posted] == ["plan-update", "tune-accuracy"]
            peers.peers["p"].thresholds_key = holder.current.key()  # up to date: nothing pushed
            await catch_up(session, peers, holder)
            assert len(posted) == 2
    finally:
        await runner.cleanup()


def test_the_tuner_window_holds_every_routers_feedback_in_proportion():
    def arrays(n: int, label: int) -> FeedbackArrays:
        return FeedbackArrays(np.full((n, 2), 0.5), np.full((n, 2), label), np.full(n, label), np.ones(2), np.zeros(2))

    merged = merge_feedback([arrays(300, 0), arrays(100, 1), arrays(0, 2)], last=200)
    assert merged is not None and merged.final.size == 200
    assert (merged.final == 0).sum() == 150 and (merged.final == 1).sum() == 50
    both = merge_feedback([arrays(30, 0), arrays(20, 1)], last=200)
    assert both is not None and both.final.size == 50  # under the window: every sample
    assert merge_feedback([arrays(0, 0)], last=10) is None


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-routers")
def served(request, digits_bundle, tmp_path_factory):
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=2000.0, shadow=0.5)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("thresholds", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup, thresholds={r.name: 0.9 for r in manifest.exit_ramps()}, replicas=1, batch_size=8, reason="test"
    )
    base = free_port_block(4 + request.param)
    dep = LocalDeployment(
        digits_bundle,
        plan,
        spec,
        tmp_path_factory.mktemp("thresholds"),
        port=base + 3 + request.param,
        base_port=base,
        window_seconds=3600,
        routers=request.param,
    )
    dep.ramps = [r.name for r in manifest.exit_ramps()]
    with dep:
        yield dep


@pytest.fixture(scope="module")
def body(digits_bundle) -> bytes:
    with np.load(digits_bundle / "data" / "heldout.npz") as data:
        image = np.asarray(data["x"][0], dtype=np.float32).ravel().tolist()
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": image}]}).encode()


def controls(dep: LocalDeployment) -> list[str]:
    return [f"http://127.0.0.1:{p}" for p in dep.control_ports]


async def call(session: aiohttp.ClientSession, method: str, url: str, body: object = None) -> dict:
    async with session.request(method, url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def router_sets(session: aiohttp.ClientSession, dep: LocalDeployment) -> list[tuple[int, str, dict]]:
    answers = [await call(session, "GET", f"{url}/v1/thresholds") for url in controls(dep)]
    return [(a["version"], a["digest"], a["thresholds"]) for a in answers]


async def feedback_settled(session: aiohttp.ClientSession, dep: LocalDeployment) -> None:
    """Until every router's feedback ring stops growing (the shadow samples of the load sent are posted after its
    answers): a re-tune then reads all of them, and the next one finds none new."""
    from exitplan.worker_image.control_bodies import FeedbackArrays

    before: list[int | None] = []
    for _ in range(100):
        counts = []
        for url in controls(dep):
            async with session.get(f"{url}/v1/window.npz?last=1&format=safetensors") as resp:
                assert resp.status == 200
                counts.append(FeedbackArrays.from_body(await resp.read()).added)
        if counts == before:
            return
        before = counts
        await asyncio.sleep(0.3)


async def worker_version(dep: LocalDeployment, token: str) -> tuple[int, str]:
    (worker,) = [p for p in dep.procs if p.name.startswith("worker-")]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        info = await call(s, "GET", f"http://{worker.address}/v1/info")
    return info["thresholdsVersion"], info["thresholdsDigest"]


async def test_a_post_to_one_router_is_merged_and_served_by_every_router_when_it_is_answered(served, body):
    dep = served
    r0, r1 = dep.ramps[0], dep.ramps[1]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        (version, _, before), *_ = await router_sets(s, dep)
        posted = await call(s, "POST", f"{controls(dep)[0]}/v1/thresholds", {"thresholds": {r0: 0.5}})
        assert posted["version"] == version + 1
        assert posted["thresholds"] == {**before, r0: 0.5}  # merged: the other ramps keep their values
        sets = await router_sets(s, dep)
        assert len(sets) == len(dep.router_procs()) and {(v, d) for v, d, _ in sets} == {
            (posted["version"], posted["digest"])
        }
        assert await worker_version(dep, dep.control_token) == (posted["version"], posted["digest"])
        # replace: the set is exactly what is posted (to another router this time)
        replaced = await call(
            s, "POST", f"{controls(dep)[-1]}/v1/thresholds", {"thresholds": {r1: 0.75}, "replace": True}
        )
        assert replaced["thresholds"] == {r1: 0.75} and replaced["version"] == version + 2
        assert {(v, d) for v, d, _ in await router_sets(s, dep)} == {(replaced["version"], replaced["digest"])}
        for url in controls(dep):  # the observation windows carry the set's version (what a re-tune's push follows)
            both = await call(s, "GET", f"{url}/v1/observations?window=both")
            assert both["current"]["thresholdsVersion"] == replaced["version"]
            assert both["current"]["thresholds"] == {r1: 0.75}
    async with aiohttp.ClientSession() as s:  # the answers and the metadata through the front name it
        for _ in range(2 * len(dep.router_procs())):
            meta = await call(s, "GET", f"{dep.url}/v2/models/digits")
            assert meta["parameters"]["thresholds_version"] == replaced["version"]
            assert meta["parameters"]["thresholds"] == {r1: 0.75}
            async with s.post(f"{dep.url}{PATH}", data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                assert (await r.json())["parameters"]["thresholds_version"] == replaced["version"]


async def test_a_router_given_a_set_alone_hands_it_to_the_others_at_their_sync(served):
    dep = served
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        (version, _, values), *_ = await router_sets(s, dep)
        lone = {"thresholds": {**values, dep.ramps[0]: 0.66}, "version": version + 10, "replace": True}
        given = await call(s, "POST", f"{controls(dep)[-1]}/v1/thresholds", lone)  # versioned: not forwarded
        end = time.monotonic() + HANG_GUARD_S
        while {(v, d) for v, d, _ in await router_sets(s, dep)} != {(given["version"], given["digest"])}:
            assert time.monotonic() < end, "the routers did not converge"
            await asyncio.sleep(0.1)


async def send_load(url: str, bundle, n: int, at_once: int = 8) -> None:
    """n held-out images, in turn (agreement at an early ramp is measured on varied inputs)."""
    with np.load(bundle / "data" / "heldout.npz") as data:
        held = np.asarray(data["x"], dtype=np.float32)
    images = [held[i % len(held)] for i in range(n)]
    bodies = [
        json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": x.ravel().tolist()}]})
        for x in images
    ]
    async with aiohttp.ClientSession() as s:

        async def one(body: str) -> None:
            async with s.post(f"{url}{PATH}", data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()

        for start in range(0, len(bodies), at_once):
            await asyncio.gather(*(one(b) for b in bodies[start : start + at_once]))


async def test_a_tuning_step_on_every_routers_feedback_leaves_every_router_on_its_version(served, digits_bundle):
    dep = served
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        exit_all = {r: 0.0 for r in dep.ramps}  # every input exits at the first ramp: far over the budget
        await call(s, "POST", f"{controls(dep)[0]}/v1/thresholds", {"thresholds": exit_all})
        await send_load(dep.url, digits_bundle, 600)
        tuner = AutoTuner(controls(dep), dep.ramps, 0.01, config=replace(LIVE, tails=()), token=dep.control_token)
        try:
            decision = await asyncio.to_thread(tuner.step)
        finally:
            await asyncio.to_thread(tuner.stop)
        assert decision.thresholds is not None and decision.trigger == "breach", decision
        sets = await router_sets(s, dep)
        assert {v for v, _, _ in sets} == {tuner.version} and all(t == decision.thresholds for _, _, t in sets)
        assert (await worker_version(dep, dep.control_token))[0] == tuner.version


async def test_the_operators_re_tune_runs_the_live_loops_policy_and_keeps_its_state(served, digits_bundle):
    """The operator's re-tune (operator/live_thresholds.retune) on the same routers: a breach is repaired and
    pushed to every router, and the tuner's state is kept in the service's memo, so the next re-tune counts
    only the samples since the breach (none yet: no savings claimed on the samples that broke the budget)."""
    from exitplan.operator import live_thresholds
    from exitplan.operator.service_state import Service

    dep = served
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        exit_all = {r: 0.0 for r in dep.ramps}
        await call(s, "POST", f"{controls(dep)[0]}/v1/thresholds", {"thresholds": exit_all})
        await send_load(dep.url, digits_bundle, 600)
        await feedback_settled(s, dep)  # shadow feedback arrives after the answers
        # written into the plan a moment ago: the new set waits in the memo (client=None: no API call is made)
        memo: dict = {live_thresholds.WRITTEN_KEY: time.monotonic()}
        svc = Service(body={"metadata": {"name": "digits", "namespace": "ns"}}, client=None, memo=memo)  # type: ignore[arg-type]
        access = live_thresholds.RouterAccess(controls(dep), dep.control_token, None)
        await live_thresholds.retune(svc, dep.spec, dep.ramps, access=access, in_force=exit_all)
        state = memo[live_thresholds.TUNER_KEY]
        assert state.fresh == 0 and state.previous is not None  # a breach: fresh samples count from here
        pushed = memo[live_thresholds.PENDING_KEY][0]
        assert pushed != exit_all and all(pushed[r] >= exit_all[r] for r in dep.ramps)  # raised only
        sets = await router_sets(s, dep)
        assert all(t == pushed for _, _, t in sets)  # every router runs the repaired set
        await live_thresholds.retune(svc, dep.spec, dep.ramps, access=access, in_force=pushed)
        after = memo[live_thresholds.TUNER_KEY]
        assert after.fresh == 0  # nothing arrived since
        assert memo[live_thresholds.PENDING_KEY][2] != "tune-savings"  # probation: savings wait for fresh samples


async def test_the_operators_re_tune_pushes_after_the_version_its_drift_read_saw_without_asking_again(
    served, digits_bundle
):
    """Given the version the drift read saw with the thresholds in force, the re-tune's push is the version after
    it: the routers are not asked for their set first (a GET per router and re-tune at a fleet's scale). A
    version past the routers' own shows it: a GET first would have pushed the version after theirs."""
    from exitplan.operator import live_thresholds
    from exitplan.operator.service_state import Service

    dep = served
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        exit_all = {r: 0.0 for r in dep.ramps}  # far over the budget: the re-tune repairs and pushes
        posted = await call(s, "POST", f"{controls(dep)[0]}/v1/thresholds", {"thresholds": exit_all})
        await send_load(dep.url, digits_bundle, 600)
        await feedback_settled(s, dep)  # shadow feedback arrives after the answers
        memo: dict = {live_thresholds.WRITTEN_KEY: time.monotonic()}  # no write into the plan now: no API call
        svc = Service(body={"metadata": {"name": "digits", "namespace": "ns"}}, client=None, memo=memo)  # type: ignore[arg-type]
        access = live_thresholds.RouterAccess(controls(dep), dep.control_token, None)
        seen = posted["version"] + 3
        await live_thresholds.retune(svc, dep.spec, dep.ramps, access=access, in_force=exit_all, in_force_version=seen)
        values, version = memo[live_thresholds.PENDING_KEY][0], memo[live_thresholds.PENDING_KEY][1]
        assert version == seen + 1 and values != exit_all
        assert {(v, tuple(sorted(t.items()))) for v, _, t in await router_sets(s, dep)} == {
            (seen + 1, tuple(sorted(values.items())))
        }
