"""Reading every router replica (operator/router_endpoints.py) and merging their windows
(operator/drift.py combine/subtract): the addresses an Endpoints object gives, in a cluster's shape and the
dev cluster's (devcluster/endpoints.py); when a read is partial; p99 merged from the routers' latency
counts (not the max, not an average), agreement from their shadow samples' counts."""

from __future__ import annotations

import numpy as np

from exitplan.api.observations import (
    LATENCY_EDGES_MS,
    Observations,
    histogram_quantile_ms,
    latency_bucket_counts,
)
from exitplan.devcluster.endpoints import Member, endpoints_object
from exitplan.operator import drift
from exitplan.operator.router_endpoints import Routers, endpoint_urls
from exitplan.worker_image.classify.observe import WindowStats


def test_a_clusters_endpoints_give_each_router_pod_at_the_control_port():
    endpoints = {
        "subsets": [
            {
                "addresses": [{"ip": "10.0.0.7"}, {"ip": "10.0.0.9"}],
                "notReadyAddresses": [{"ip": "10.0.0.8"}],
                "ports": [{"name": "control", "port": 8081}],
            }
        ]
    }
    assert endpoint_urls(endpoints) == ["http://10.0.0.7:8081", "http://10.0.0.8:8081", "http://10.0.0.9:8081"]
    assert endpoint_urls({}) == []


def test_the_dev_clusters_endpoints_give_each_pod_at_its_own_port():
    svc = {
        "metadata": {"name": "m-control", "namespace": "ns", "labels": {"a": "b"}},
        "spec": {"ports": [{"name": "control", "port": 8081}], "publishNotReadyAddresses": True},
    }
    obj = endpoints_object(svc, "127.0.0.1", [Member("r-1", 31002, True), Member("r-0", 31001, False)])
    assert obj["kind"] == "Endpoints" and obj["metadata"]["name"] == "m-control"
    assert endpoint_urls(obj) == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    svc["spec"]["publishNotReadyAddresses"] = False  # the not-ready pod is listed apart
    (first, second) = endpoints_object(svc, "127.0.0.1", [Member("r-1", 31002, True), Member("r-0", 31001, False)])[
        "subsets"
    ]
    assert "notReadyAddresses" in first and "addresses" in second


def test_a_read_that_misses_a_router_or_goes_through_one_address_says_so():
    each = Routers(["http://a:1", "http://b:1"], per_replica=True, replicas=2)
    assert each.shortfall(2) == ""
    assert each.shortfall(1) == "1 of 2 routers read"
    proxied = Routers(["http://svc:1"], per_replica=False, replicas=2)
    assert "one Service address" in proxied.shortfall(1)
    assert Routers(["http://svc:1"], per_replica=False, replicas=1).shortfall(1) == ""


def window(latencies_ms: list[float], agree: int, samples: int, exits: list[int], since: float = 0.0) -> Observations:
    stats = WindowStats("svc", "m", ["r0"], [32], since=since)
    for i, ms in enumerate(latencies_ms):
        stats.record_answer(0 if i < exits[0] else 1, ms / 1000.0, True, 0)
    for i in range(samples):
        stats.record_feedback(0, i < agree)
    return stats.observations(since + 10.0, {}, {}, "h")


def test_p99_of_several_routers_comes_from_their_counts():
    fast = window([10.0] * 990, 0, 0, [0])
    slow = window([500.0] * 10, 0, 0, [0])
    merged = drift.combine([fast, slow])
    exact = float(np.percentile([10.0] * 990 + [500.0] * 10, 99, method="inverted_cdf"))  # 10 ms
    assert merged.requests == 1000
    assert abs(merged.latency.p99_ms - exact) <= 0.1 * exact, (merged.latency.p99_ms, exact)
    assert merged.latency.p99_ms < 0.5 * max(fast.latency.p99_ms, slow.latency.p99_ms)  # not the max
    assert merged.latency_histogram == [a + b for a, b in zip(fast.latency_histogram, slow.latency_histogram)]
    assert merged.latency.max_ms == 500.0


def test_a_later_read_of_the_same_window_gives_the_p99_of_what_came_since():
    early = window([10.0] * 100, 0, 0, [0])
    later = window([10.0] * 100 + [300.0] * 100, 0, 0, [0])
    since = drift.subtract(later, early)
    assert since.requests == 100
    assert abs(since.latency.p99_ms - 300.0) <= 30.0


def test_agreement_of_several_routers_comes_from_their_sample_counts():
    a = window([10.0] * 100, agree=90, samples=100, exits=[50])  # half exit at r0, 90 % agree
    b = window([10.0] * 100, agree=10, samples=10, exits=[50])
    merged = drift.combine([a, b])
    (ramp,) = merged.agreement
    assert (ramp.agree, ramp.samples) == (100, 110)
    assert abs(merged.agreement_overall - (1 - 0.5 * (1 - 100 / 110))) < 1e-9
    assert merged.agreement_ci_low < merged.agreement_overall < merged.agreement_ci_high


def test_the_latency_histogram_reads_back_its_quantiles():
    values = list(np.random.default_rng(0).lognormal(3.0, 1.0, 5000))
    counts = latency_bucket_counts(values)
    assert len(counts) == len(LATENCY_EDGES_MS) + 1 and sum(counts) == 5000
    for q in (0.5, 0.95, 0.99):
        exact = float(np.quantile(values, q))
        assert abs(histogram_quantile_ms(counts, q) - exact) <= 0.1 * exact, q
    assert histogram_quantile_ms([0] * len(counts), 0.99) == 0.0
