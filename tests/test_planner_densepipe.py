"""DensePipe placement (CP-SAT) against exhaustive search; skip-aware: often-run splits get more."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.densepipe import exhaustive, place
from exitplan.planner.errors import PlanInfeasible


@pytest.mark.parametrize("seed", range(12))
def test_placement_equals_exhaustive(seed):
    rng = np.random.default_rng(seed)
    n, P = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    mu = rng.uniform(5, 50, (n, P))
    mu[rng.random((n, P)) < 0.15] = 0.0
    mu[:, 0] = np.maximum(mu[:, 0], 1.0)  # every split fits somewhere
    q = np.concatenate([[1.0], np.sort(rng.uniform(0.1, 1.0, n - 1))[::-1]])
    caps = rng.integers(1, 4, P)
    balance = 0.5 if seed % 3 == 0 else None
    want = exhaustive(mu, q, caps, np.ones(P), balance)
    if want < 0:
        with pytest.raises(PlanInfeasible):
            place(mu, q, caps, np.ones(P), balance=balance)
        return
    got = place(mu, q, caps, np.ones(P), balance=balance)
    assert got.optimal
    got.verify(mu, q, np.asarray(caps), mu > 0)
    assert got.goodput == pytest.approx(want, rel=2e-3)


def test_often_executed_splits_get_more_and_faster_replicas():
    # Two splits; the second runs for 20 % of inputs. Pool 0 is 3x faster than pool 1.
    mu = np.array([[30.0, 10.0], [30.0, 10.0]])
    out = place(mu, [1.0, 0.2], caps=[4, 4], costs=[3.0, 1.0])
    cap = (out.replicas * mu).sum(axis=1)
    assert cap[0] > cap[1]
    assert out.replicas[0, 0] >= out.replicas[1, 0]


def test_split_that_fits_nowhere_names_it():
    with pytest.raises(PlanInfeasible) as err:
        place([[10.0], [0.0]], [1.0, 0.5], [2], [1.0])
    assert err.value.field == "splits[1]"
