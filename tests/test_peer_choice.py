"""The next-hop choice (DensePipe's "least running / capacity") over the peers a sender knows."""

from __future__ import annotations

from exitplan.worker_image.peer_choice import Peer, PeerSet


def _peers(*peers: Peer) -> PeerSet:
    ps = PeerSet([])
    for p in peers:
        ps.peers[p.address] = p
    return ps


def test_a_faster_pod_takes_more_before_it_counts_as_busier():
    fast = Peer("fast:1", split=1, bucket=32, batch_size=8, capacity=300.0, ready=True)
    slow = Peer("slow:1", split=1, bucket=32, batch_size=8, capacity=100.0, ready=True)
    ps = _peers(fast, slow)
    sent = {"fast:1": 0, "slow:1": 0}
    for _ in range(40):  # inputs pile up (nothing answers): the choice follows running / capacity
        chosen = ps.choose(32, 1)
        chosen.running += 1
        sent[chosen.address] += 1
    assert sent == {"fast:1": 30, "slow:1": 10}


def test_equal_batch_sizes_split_evenly_until_every_pod_reports_a_rate():
    a = Peer("a:1", split=0, bucket=32, batch_size=8, capacity=0.0, ready=True)
    b = Peer("b:1", split=0, bucket=32, batch_size=8, capacity=500.0, ready=True)
    ps = _peers(a, b)
    for _ in range(10):
        ps.choose(32, 0).running += 1
    assert a.running == b.running == 5


def test_stragglers_and_excluded_and_unready_pods_are_passed_over():
    a = Peer("a:1", split=0, bucket=32, batch_size=8, capacity=500.0, ready=True, straggler=True, last_probe=1e18)
    b = Peer("b:1", split=0, bucket=32, batch_size=8, capacity=100.0, ready=True, running=50)
    c = Peer("c:1", split=0, bucket=32, batch_size=8, capacity=900.0, ready=False)
    d = Peer("d:1", split=0, bucket=32, batch_size=8, capacity=900.0, ready=True)
    ps = _peers(a, b, c, d)
    assert ps.choose(32, 0).address == "d:1"
    assert ps.choose(32, 0, exclude={"d:1"}).address == "b:1"  # the straggler only if every pod is one
    assert ps.choose(64, 0) is None


async def test_a_pod_that_misses_one_info_probe_stays_in_the_hop_and_a_dead_one_leaves_at_once():
    import asyncio

    import aiohttp
    from aiohttp import web

    state = {"delay": 0.0}

    async def info(_: web.Request) -> web.Response:
        await asyncio.sleep(state["delay"])
        return web.json_response(
            {"split": 1, "bucket": 32, "pool": "cpu", "batchSize": 8, "capacity": 100.0, "ready": True}
        )

    app = web.Application()
    app.router.add_get("/v1/info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    peers = PeerSet([("127.0.0.1", port)], info_timeout_s=0.3)
    address = f"127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await peers.refresh(session)
            assert peers.peers[address].ready
            state["delay"] = 0.6  # over the probe's timeout
            await peers.refresh(session)
            assert peers.peers[address].ready, "one missed probe took a live pod out of the hop"
            await peers.refresh(session)
            assert not peers.peers[address].ready, "two missed probes in a row should take it out"
            state["delay"] = 0.0
            await peers.refresh(session)
            assert peers.peers[address].ready
            await runner.cleanup()  # the pod is gone: the connection is refused
            await peers.refresh(session)
            assert not peers.peers[address].ready
    finally:
        await runner.cleanup()


def test_a_pod_marked_a_straggler_is_counted_once_per_mark_on_the_routers_metric():
    from exitplan.worker_image.metrics import RouterMetrics

    metrics = RouterMetrics("svc")
    metrics.zero([32], ["r0", "final"], [(0, "gpu-a")])
    labels = {"service": "svc", "split": "0", "pool": "gpu-a"}
    assert metrics.registry.get_sample_value("exitplan_router_stragglers_marked_total", labels) == 0.0
    slow = Peer("slow:1", split=0, bucket=32, batch_size=8, capacity=100.0, ready=True, pool="gpu-a")
    ps = _peers(slow)
    ps.on_straggler = metrics.straggler_marked  # as the router wires its peer sets
    for _ in range(20):  # slow for longer than the streak: marked once, not once per response
        ps.observe_service(slow, service_ms=50.0, expected_ms=10.0)
    assert slow.straggler
    assert metrics.registry.get_sample_value("exitplan_router_stragglers_marked_total", labels) == 1.0
    for _ in range(20):  # recovers, then slow again: a second mark
        ps.observe_service(slow, service_ms=10.0, expected_ms=10.0)
    assert not slow.straggler
    for _ in range(20):
        ps.observe_service(slow, service_ms=50.0, expected_ms=10.0)
    assert metrics.registry.get_sample_value("exitplan_router_stragglers_marked_total", labels) == 2.0


def test_an_ejected_pod_is_out_of_rotation_until_it_answers_its_health_check():
    from exitplan.worker_image.control_bodies import WorkerInfo

    stalled = Peer("stalled:1", split=0, bucket=32, batch_size=8, capacity=900.0, ready=True)
    twin = Peer("twin:1", split=0, bucket=32, batch_size=8, capacity=100.0, ready=True, running=40)
    ps = _peers(stalled, twin)
    assert ps.choose(32, 0) is stalled  # the least loaded
    ps.eject(stalled, 0.25)
    assert stalled.ejected and stalled.ejections == 1
    assert all(ps.choose(32, 0) is twin for _ in range(5))
    assert ps.choose(32, 0, exclude=["twin:1"]) is stalled  # every other one ejected: still better than none
    stalled.take(WorkerInfo(split=0, bucket=32, batch_size=8, ready=True, capacity=900.0))
    assert not stalled.ejected and ps.choose(32, 0) is stalled


def test_the_hedge_bound_follows_the_profile_and_the_observed_round_trips_above_a_floor():
    from exitplan.worker_image.control_bodies import WorkerInfo

    peer = Peer("a:1")
    peer.take(WorkerInfo(split=0, bucket=32, batch_size=8, expected_ms={"32": {"a": 20.0, "b": 10.0}}))
    assert peer.full_batch_ms == 100.0  # a + b x batch
    ps = _peers(peer)
    assert ps.hedge_after_s([peer]) == 0.4  # 4 x the full batch's 100 ms, above the 0.25 s floor
    assert ps.hedge_after_s([Peer("b:1")]) == 0.25  # no profile yet: the floor
    for _ in range(100):
        ps.observe_round_trip(0.5)
    assert ps.hedge_after_s([peer]) == 1.0  # 2 x the observed p99
