"""kopf's diff-base essence of an EarlyExitService, built side by side in one run (alternated rounds): kopf's own
AnnotationsDiffBaseStorage (a deep copy of the whole body, then the status and most metadata deleted) against
operator/essence.LeanDiffBaseStorage (the same essence from a view of the body without them). The body is a
service as the drift loop leaves it: 10 plan cells, the conditions, a drift report, kopf's annotations, managed
fields (tests/test_essence.py's); kopf builds one essence per watch event, and every status write comes back as one.

    python -P bench/diffbase_build.py [--rounds 3] [--cells 10]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import kopf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_essence  # noqa: E402

from exitplan.operator.essence import LeanDiffBaseStorage  # noqa: E402

CALLS = 2000


def service(cells: int) -> dict[str, Any]:
    """tests/test_essence.py's service (kopf's and another operator's annotations, managed fields, owners) with
    the status the drift loop leaves: `cells` plan cells, six conditions, a drift report."""
    cell = {"split": 0, "bucket": 128, "pool": "a100", "replicas": 2, "readyReplicas": 2, "batch": 16, "layers": "0-11"}
    conditions = [
        {"type": t, "status": "True", "reason": "Fine", "message": "all is well " * 4, "observedGeneration": 3}
        for t in ("Ready", "Progressing", "Planned", "PlanAccurate", "Degraded", "ProfilingFailed")
    ]
    drift = {"lengthScore": 0.04, "survivalError": 0.01, "p99Ms": 41.5, "goodputRps": 812.0, "requests": 16240}
    plan = {"hash": "0123456789ab", "goodputRps": 900.0, "cells": [dict(cell, split=i % 2) for i in range(cells)]}
    return test_essence.body({"phase": "Ready", "plan": plan, "conditions": conditions, "drift": drift})


def per_call_us(storage: kopf.AnnotationsDiffBaseStorage, body: kopf.Body) -> float:
    start = time.process_time()
    for _ in range(CALLS):
        storage.build(body=body, extra_fields=["spec"])
    return 1e6 * (time.process_time() - start) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cells", type=int, default=10)
    args = parser.parse_args()
    body = kopf.Body(service(args.cells))
    stock, lean = kopf.AnnotationsDiffBaseStorage(prefix="exitplan.io"), LeanDiffBaseStorage(prefix="exitplan.io")
    same = stock.build(body=kopf.Body(copy.deepcopy(dict(body))), extra_fields=["spec"]) == lean.build(
        body=body, extra_fields=["spec"]
    )
    print(f"the same essence: {same}")
    for r in range(args.rounds):
        a, b = per_call_us(stock, body), per_call_us(lean, body)
        print(f"round {r + 1}: kopf's build {a:.1f} us, lean build {b:.1f} us ({a / b:.1f}x)")


if __name__ == "__main__":
    main()
