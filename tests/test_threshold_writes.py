"""How often the drift loop writes live thresholds into the plan, and what such a write touches: at most once
per service every drift_writes.refresh_seconds (the routers hold every pushed set meanwhile; at 200 services
the re-tune's pushes, each written at once into every child, saturated the API server), and only the plan
ConfigMap: the other children carry the plan's layout hash, which the thresholds are not part of."""

from __future__ import annotations

import asyncio
import collections
import time

from test_operator_builders import make_plan

from exitplan.api.observations import BucketObservations, LatencySummary, Observations
from exitplan.operator import drift, drift_writes, live_thresholds
from exitplan.operator.service_state import Service

PERIOD = 20.0


def test_a_write_is_due_at_most_once_per_refresh_interval():
    memo: dict = {}
    now = time.monotonic()
    assert live_thresholds.write_due(memo, now, PERIOD)  # never written: at once
    memo[live_thresholds.WRITTEN_KEY] = now
    every = drift_writes.refresh_seconds(PERIOD)
    assert every == 5 * PERIOD
    slack = PERIOD / (2 * drift.CHECKS_PER_PERIOD)  # half the time between two reads: as the figures' refresh
    assert not live_thresholds.write_due(memo, now + every - slack - 1, PERIOD)
    assert live_thresholds.write_due(memo, now + every - slack, PERIOD)
    assert not live_thresholds.write_due(memo, now + every - PERIOD / 8 - 1, PERIOD, reads=4)
    # written with the status at `now`: the figures' refresh falls due at the same read (one status write)
    for read in (now + every - slack - 0.5, now + every - slack, now + every - slack + 0.5):
        refresh = drift_writes.write_due(now, read, PERIOD, says_other=False, figures_moved=False)
        assert refresh == live_thresholds.write_due({live_thresholds.WRITTEN_KEY: now}, read, PERIOD)
    assert drift_writes.refresh_seconds(600.0) == 600.0  # 5 minutes, but never more often than a period
    assert drift_writes.refresh_seconds(30.0) == 150.0


def test_a_set_that_is_not_due_waits_in_the_memo_without_touching_the_api():
    # client=None: any API call would raise, so this also shows that nothing was read or written
    memo: dict = {live_thresholds.WRITTEN_KEY: time.monotonic()}
    svc = Service(body={"metadata": {"name": "s", "namespace": "ns"}}, client=None, memo=memo)  # type: ignore[arg-type]
    first = {"ramp0": 0.9, "ramp1": 0.8}
    assert not asyncio.run(live_thresholds.write_thresholds(svc, first, "tune-savings", PERIOD, 3, "plan-a"))
    newer = {"ramp0": 0.95, "ramp1": 0.85}
    assert not asyncio.run(live_thresholds.write_thresholds(svc, newer, "tune-accuracy", PERIOD, 4, "plan-a"))
    assert memo[live_thresholds.PENDING_KEY] == (newer, 4, "tune-accuracy", "plan-a")  # the newest waits
    assert not asyncio.run(live_thresholds.write_pending(svc, PERIOD, "plan-a"))  # still not due: nothing tried
    assert live_thresholds.PENDING_KEY in memo
    # a re-plan since (another plan in force): the set is not written into it, and no longer waits
    memo[live_thresholds.WRITTEN_KEY] = time.monotonic() - drift_writes.refresh_seconds(PERIOD)  # due now
    assert not asyncio.run(live_thresholds.write_pending(svc, PERIOD, "plan-b"))
    assert live_thresholds.PENDING_KEY not in memo


def test_thresholds_are_not_part_of_the_layout_hash():
    plan = make_plan([(0, 32, "gpu-a", 2), (1, 128, "gpu-b", 1)])
    tuned = plan.model_copy(update={"thresholds": {"ramp1": 0.9, "ramp3": 0.8}, "thresholds_version": 2})
    assert tuned.layout_hash() == plan.layout_hash()
    assert tuned.content_hash() != plan.content_hash()  # what the routers run did change
    moved = make_plan([(0, 32, "gpu-a", 3), (1, 128, "gpu-b", 1)])
    assert moved.layout_hash() != plan.layout_hash()


def window(since: float, until: float, requests: int) -> Observations:
    return Observations(
        service="s",
        model="m",
        since=since,
        until=until,
        requests=requests,
        within_slo=requests,
        ramps=["ramp1"],
        survival=[0.5],
        latency=LatencySummary(p50_ms=5.0, p99_ms=20.0),
        per_bucket={"128": BucketObservations(requests=requests, within_slo=requests, load_seconds=2.0)},
        thresholds={"ramp1": 0.9},
    )


def test_judging_a_window_leaves_the_windows_read_as_they_were():
    """subtract and combine copy the newest window and change the copy (per bucket and latency too)."""
    old, new = window(0.0, 5.0, 100), window(0.0, 10.0, 300)
    before = (old.model_dump_json(), new.model_dump_json())
    piece = drift.subtract(new, old)
    assert piece.requests == 200 and piece.per_bucket["128"].requests == 200
    both = drift.combine([piece, window(10.0, 15.0, 50)])
    assert both.requests == 250 and both.per_bucket["128"].requests == 250
    piece.latency.p99_ms, piece.thresholds["ramp1"], piece.per_bucket["128"].within_slo = 99.0, 0.1, 0
    assert (old.model_dump_json(), new.model_dump_json()) == before  # the copy's own latency, dicts, buckets


def test_the_drift_loops_shortcuts_say_what_combining_would():
    """The survival series and the plan comparison read a block's span, arrivals and survival without
    combining it (drift.span, pooled_arrivals, pooled_survival): the same figures as combine's, also when
    a window has other buckets or ramps than the newest (left out, as combine leaves them out)."""
    import random

    rng = random.Random(4)
    for _ in range(200):
        block, t = [], 0.0
        for _ in range(rng.randint(1, 4)):
            ramps, buckets = rng.choice([1, 2]), rng.choice([1, 2])
            w = window(t, t + rng.uniform(1.0, 5.0), rng.randint(0, 400))
            w.survival = [rng.random() for _ in range(ramps)]
            w.ramps = [f"ramp{k}" for k in range(ramps)]
            w.length_histogram = [rng.randint(0, 200) for _ in range(buckets)]
            w.length_buckets = [32, 128][:buckets]
            block.append(w)
            t = w.until + rng.choice([0.0, 1.0])
        rng.shuffle(block)
        whole = drift.combine(block)
        assert drift.span(block) == whole.until - whole.since
        assert drift.pooled_arrivals(block) == drift.arrivals(whole)
        assert drift.pooled_survival(block) == whole.survival


def test_a_threshold_write_keeps_the_plan_it_wrote_without_reading_the_configmap_back(tmp_path):
    """After a re-tune's set is written into the plan ConfigMap, the plan in force the drift loop reads at every
    router read is the plan written -- the same content hash as a read of the ConfigMap gives. The writes patch
    the ConfigMap at the resourceVersion this process last read or wrote, without reading it first; when someone
    else wrote it meanwhile, the patch conflicts and the write reads it, patches again and keeps their change."""
    import kmock
    import kopf
    from test_operator_support import ALLOWED_HOST_PATHS, ClusterThread, service

    from exitplan.operator import apply as applying
    from exitplan.operator import builders, guards, plan_memory
    from exitplan.operator.ownership import adopt
    from exitplan.operator.service_state import current_plan

    reads: dict[int, kmock.Request] = {}  # the plan ConfigMap's reads, each once (kmock may show one twice)

    def count(req: kmock.Request) -> bool:
        if req.method == "GET" and req.resource is not None and req.resource.plural == "configmaps" and req.name:
            reads[id(req)] = req  # ids stay unique: the requests are kept
        return False

    with ClusterThread(tmp_path) as cluster:
        cluster.api[count] << 500  # never matches: only counts
        body = cluster.create(service("minilm", "tw"))
        plan = make_plan([(0, 32, "gpu-a", 2), (1, 128, "gpu-b", 1)])
        plan = plan.model_copy(update={"thresholds": {"ramp1": 0.9, "ramp3": 0.8}})
        configmap = builders.build_configmap("minilm", "tw", plan)
        adopt([configmap], owner=body)
        cluster.run(applying.apply_one(cluster.client, configmap, applying.ApplyReport()))
        memo = kopf.Memo()  # as the operator's: its settings allow the bundle's host path
        memo.settings = guards.Settings.from_env({guards.ENV_ALLOWED: ALLOWED_HOST_PATHS})
        svc = Service(body=body, client=cluster.client, memo=memo)
        applied = len(reads)
        before = cluster.run(plan_memory.plan_in_force(memo, cluster.client, "minilm", "tw"))
        assert before is not None and len(reads) == applied + 1
        tuned = {"ramp1": 0.95, "ramp3": 0.85}
        assert cluster.run(live_thresholds.persist_thresholds(svc, tuned, "tune-savings", version=2))
        assert len(reads) == applied + 1  # patched at the version the plan's read saw; the plan is not read back
        kept = cluster.run(plan_memory.plan_in_force(memo, cluster.client, "minilm", "tw"))
        assert len(reads) == applied + 1
        stored = cluster.run(current_plan(cluster.client, "minilm", "tw"))
        assert kept is not None and stored is not None
        assert kept.thresholds == stored.thresholds == tuned and kept.thresholds_version == 2
        assert plan_memory.content_hash(memo, kept) == stored.content_hash() != before.content_hash()
        again = {"ramp1": 0.96, "ramp3": 0.86}
        assert cluster.run(live_thresholds.persist_thresholds(svc, again, "tune-savings", version=3))
        assert len(reads) == applied + 2  # the version its own write answered: no read either
        url = f"/api/v1/namespaces/tw/configmaps/{configmap['metadata']['name']}"
        cluster.run(cluster.client.merge_patch(url, {"metadata": {"labels": {"team": "search"}}}))  # someone else
        reads_before = len(reads)
        third = {"ramp1": 0.97, "ramp3": 0.87}
        assert cluster.run(live_thresholds.persist_thresholds(svc, third, "tune-savings", version=4))
        assert len(reads) == reads_before + 1  # the stale version conflicted: read once, patched again
        stored_cm = cluster.run(cluster.client.get(url))
        assert stored_cm["metadata"]["labels"]["team"] == "search"  # their change kept
        stored = cluster.run(current_plan(cluster.client, "minilm", "tw"))
        assert stored is not None and stored.thresholds == third and stored.thresholds_version == 4
        # the service's first write through write_thresholds puts the next off by its stagger
        fresh_memo = kopf.Memo()
        fresh_memo.settings = memo.settings
        first = Service(body=body, client=cluster.client, memo=fresh_memo)
        before_write = time.monotonic()
        fourth = {"ramp1": 0.98, "ramp3": 0.88}
        assert cluster.run(live_thresholds.write_thresholds(first, fourth, "tune-savings", PERIOD, 5))
        put_off = live_thresholds.stagger(body["metadata"]["uid"], PERIOD)
        written_at = fresh_memo[live_thresholds.WRITTEN_KEY]
        assert before_write + put_off <= written_at <= time.monotonic() + put_off
        every, slack = drift_writes.refresh_seconds(PERIOD), PERIOD / 4
        assert not live_thresholds.write_due(fresh_memo, written_at + every - slack - 1, PERIOD)
        assert live_thresholds.write_due(fresh_memo, written_at + every - slack, PERIOD)


def test_services_written_together_write_again_in_different_periods():
    """The write after a service's first is put off by whole periods within one refresh interval, by the
    service's uid: services created together (or after an operator restart) spread their writes."""
    import uuid

    slots = int(drift_writes.refresh_seconds(PERIOD) // PERIOD)
    put_off = [live_thresholds.stagger(str(uuid.UUID(int=k * 7919 + 13)), PERIOD) for k in range(400)]
    assert set(put_off) == {k * PERIOD for k in range(slots)}  # every period of the interval
    assert max(collections.Counter(put_off).values()) < 2 * 400 / slots  # about as many in each
    assert live_thresholds.stagger("some-uid", 600.0) == 0.0  # one period per interval: nothing to spread
    assert live_thresholds.stagger("", PERIOD) == 0.0


def test_combined_windows_carry_the_highest_thresholds_version_or_none_from_a_router_without_one():
    """A re-tune's push follows the highest version the routers hold; a router that predates the field leaves
    none (the re-tune then asks the routers)."""
    a = window(0.0, 10.0, 100).model_copy(update={"thresholds_version": 5})
    b = window(0.0, 12.0, 100).model_copy(update={"thresholds_version": 3})
    assert drift.combine([a, b]).thresholds_version == 5
    assert drift.combine([a, window(0.0, 12.0, 100)]).thresholds_version is None
    assert drift.subtract(a, window(0.0, 5.0, 50)).thresholds_version == 5  # a slice keeps its window's
