"""The next-hop choice (DensePipe's "least running / capacity") over the peers a sender knows."""

from __future__ import annotations

from exitplan.worker.discovery import Peer, PeerSet


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
