"""Observation windows: survival, agreement with intervals, ramp utility; the feedback ring."""

import numpy as np

from exitplan.api.observations import wilson
from exitplan.worker_image.classify.observe import FeedbackRing, WindowStats
from exitplan.worker_image.control_bodies import FeedbackArrays


def test_wilson_interval_contains_the_estimate_and_narrows_with_samples():
    p, lo, hi = wilson(90, 100)
    assert lo < p == 0.9 < hi
    _, lo2, hi2 = wilson(900, 1000)
    assert hi2 - lo2 < hi - lo
    assert wilson(0, 0) == (1.0, 0.0, 1.0)


def test_wilson_takes_counts_that_do_not_add_up():
    """A router's windows read across its restart can subtract to more agreeing samples than samples (the
    drift loop's since_last): counted as all agreeing, not a math domain error in the operator's read."""
    assert wilson(7, 5) == wilson(5, 5)
    p, lo, hi = wilson(7, 5)
    assert p == 1.0 and 0.0 < lo < hi == 1.0


def test_window_survival_agreement_and_utility():
    w = WindowStats("svc", "m", ["r0", "r1"], [16, 64])
    for _ in range(60):
        w.record_answer(0, 0.01, True)  # exited at r0
    for _ in range(30):
        w.record_answer(1, 0.02, True)  # exited at r1
    for _ in range(10):
        w.record_answer(2, 0.50, False)  # final head
    for i in range(50):
        w.record_feedback(0, i < 45)  # r0 agrees 90 %
        w.record_feedback(1, True)
    obs = w.observations(1.0, {}, {"r0": 0.9, "r1": 0.8}, "h", np.array([10.0, 5.0]), np.array([0.5, 0.5]))
    assert obs.exit_counts == [60, 30, 10]
    np.testing.assert_allclose(obs.survival, [0.4, 0.1])
    assert obs.within_slo == 90
    assert abs(obs.agreement_overall - (1 - 0.6 * 0.1)) < 1e-9
    assert obs.agreement_ci_low < obs.agreement_overall < obs.agreement_ci_high
    r0, r1 = obs.agreement
    assert abs(r0.utility_ms - (60 * 10 - 40 * 0.5) / 100) < 1e-9  # saved by 60 exits, added to 40 that passed
    assert abs(r1.utility_ms - (30 * 5 - 10 * 0.5) / 100) < 1e-9


def test_feedback_ring_keeps_the_latest_in_order_and_rejects_incomplete_samples():
    ring = FeedbackRing(2, capacity=3)
    assert not ring.add([0.5, None], [1, 1], 1)
    assert not ring.add([0.5, float("nan")], [1, 1], 1)
    for k in range(5):
        assert ring.add([0.1 * k, 0.2], [k, k], k)
    conf, pred, final = ring.arrays()
    assert final.tolist() == [2, 3, 4] and pred[:, 0].tolist() == [2, 3, 4]
    window = ring.window(np.array([1.0, 2.0]), np.array([0.1, 0.1]), last=2)
    assert window.final.tolist() == [3, 4] and window.conf.shape == (2, 2)
    data = FeedbackArrays.from_npz(window.to_npz())  # as GET /v1/window.npz carries it
    assert data.final.tolist() == [3, 4] and data.conf.shape == (2, 2) and data.saving_ms.tolist() == [1.0, 2.0]
