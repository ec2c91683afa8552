"""A router's feedback read a piece at a time (`GET /v1/window.npz?after=K&ring=R`): the ring's numbering
(worker_image/classify/observe.FeedbackRing), the numbers carried in the npz answer, and the reader that keeps
each router's window and adds what is new (worker_image/router_fleet.FeedbackFollower). The HTTP path against
a running router: tests/test_dataplane.py."""

from __future__ import annotations

import numpy as np

from exitplan.worker_image.classify.observe import FeedbackRing
from exitplan.worker_image.control_bodies import FeedbackArrays
from exitplan.worker_image.router_fleet import FeedbackFollower

RAMPS = 3
SAVING, COST = np.array([3.0, 2.0, 1.0]), np.array([0.1, 0.1, 0.1])


def fill(ring: FeedbackRing, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        assert ring.add(list(rng.uniform(0.5, 1.0, RAMPS)), list(rng.integers(0, 3, RAMPS)), int(rng.integers(0, 3)))


def answer(ring: FeedbackRing, last: int, after: tuple[str, int] | None = None) -> FeedbackArrays:
    """What the router's GET /v1/window.npz answers, as the client parses it."""
    return FeedbackArrays.from_npz(ring.window(SAVING, COST, last=last, after=after).to_npz())


def same(a: FeedbackArrays, b: FeedbackArrays) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("conf", "pred", "final"))


def test_a_read_after_a_sample_number_carries_only_the_samples_since():
    ring = FeedbackRing(RAMPS, capacity=64)
    fill(ring, 10, 0)
    first = answer(ring, 32)
    assert (first.added, first.ring, first.final.size) == (10, ring.ring, 10)
    fill(ring, 7, 1)
    since = answer(ring, 32, (ring.ring, first.added))
    assert since.final.size == 7 and since.added == 17
    assert same(since, FeedbackArrays(*(x[-7:] for x in ring.arrays()), SAVING, COST))
    assert answer(ring, 32, (ring.ring, 17)).final.size == 0  # nothing new: an empty answer, still numbered
    assert answer(ring, 5, (ring.ring, 10)).final.size == 5  # never more than `last`
    # another ring's number (the router restarted), or one this ring never reached: the whole window
    assert answer(ring, 32, ("another", 10)).final.size == 17
    assert answer(ring, 32, (ring.ring, 99)).final.size == 17
    assert FeedbackRing(RAMPS).ring != ring.ring


def test_a_window_file_carries_no_numbers():
    arrays = FeedbackArrays(np.zeros((2, RAMPS)), np.zeros((2, RAMPS), int), np.zeros(2, int), SAVING, COST)
    parsed = FeedbackArrays.from_npz(arrays.to_npz())
    assert parsed.added is None and parsed.ring is None and same(parsed, arrays)


def test_a_safetensors_answer_carries_the_same_arrays_and_numbers_as_the_npz_and_either_parses():
    """What the operator asks a router for (`?format=safetensors`) holds what the npz holds, dtypes and the ring's
    numbers included; `from_body` reads either (a router that predates the format answers an npz), and a body
    that is neither is a ValueError, as a broken npz is."""
    import pytest

    ring = FeedbackRing(RAMPS, capacity=64)
    fill(ring, 23, 3)
    for window in (ring.window(SAVING, COST, last=16), ring.window(SAVING, COST, last=16, after=(ring.ring, 23))):
        npz, st = FeedbackArrays.from_body(window.to_npz()), FeedbackArrays.from_body(window.to_safetensors())
        for name in ("conf", "pred", "final", "saving_ms", "cost_ms"):
            a, b = getattr(npz, name), getattr(st, name)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert (st.added, st.ring) == (npz.added, npz.ring) == (23, ring.ring)
    assert st.final.size == 0 and st.conf.shape == (0, RAMPS)  # nothing new: empty, still [0, R]
    plain = FeedbackArrays(np.zeros((2, RAMPS), np.float32), np.zeros((2, RAMPS), int), np.zeros(2, int), SAVING, COST)
    assert FeedbackArrays.from_body(plain.to_safetensors()).ring is None
    for body in (b"", b"not a window at all", plain.to_safetensors()[:-5]):
        with pytest.raises(ValueError):
            FeedbackArrays.from_body(body)


def test_the_follower_keeps_each_routers_window_as_a_whole_read_would_give_it():
    ring, follower, url = FeedbackRing(RAMPS, capacity=256), FeedbackFollower(last=40), "http://router-0:8081"
    assert follower.after(url) is None  # nothing kept: read it whole
    for step in range(12):
        fill(ring, [3, 25, 0, 11, 60, 1][step % 6], step)
        window = follower.follow(url, answer(ring, follower.last, follower.after(url)))
        assert same(window, answer(ring, 40)) and window.added == ring.added
    # the router restarts: a new ring numbers from 0; an answer that does not follow on replaces what is kept
    restarted = FeedbackRing(RAMPS, capacity=256)
    fill(restarted, 5, 99)
    window = follower.follow(url, answer(restarted, 40, follower.after(url)))
    assert window.final.size == 5 and window.ring == restarted.ring
    # a router that predates the numbers: each answer replaces what is kept
    plain = FeedbackArrays(*ring.arrays(), SAVING, COST)
    assert follower.follow(url, plain) is plain and follower.after(url) is None
    follower.keep_only([])
    assert follower.kept == {}
