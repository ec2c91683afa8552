"""client/loadgen.py `young_collections_only`: no full garbage collection pauses the load generator's event
loop while a replay runs, young ones still reclaim cycles, and everything is as before afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a fresh interpreter: whether the same work triggers a full collection outside a replay depends on
# how large the heap already is (a full collection waits for a quarter of it to be new), which a test
# process that imported everything else would not show.
PROBE = r"""
import gc, json
from exitplan.client.loadgen import young_collections_only

def churn(n):
    kept = []
    for i in range(n):
        a = []
        a.append(a)  # a cycle: only the collector frees it
        if i % 2 == 0:
            kept.append({"i": i})  # long-lived for the run, as a replay's outcomes are
    return len(kept)

def collections_while(fn):
    seen = {0: 0, 1: 0, 2: 0}
    def callback(phase, info):
        if phase == "start":
            seen[info["generation"]] += 1
    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return seen

before = gc.get_threshold()
plain = collections_while(lambda: churn(600_000))
frozen = []
def during():
    with young_collections_only():
        frozen.append(gc.get_freeze_count())
        churn(600_000)
inside = collections_while(during)
print(json.dumps({"plain": plain, "inside": inside, "frozen": frozen[0], "restored": gc.get_threshold() == before,
                  "unfrozen": gc.get_freeze_count() == 0, "enabled": gc.isenabled()}))
"""


def test_a_replay_runs_without_full_collections_and_restores_the_collector():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    plain, inside = ({int(k): v for k, v in got[key].items()} for key in ("plain", "inside"))
    assert plain[2] >= 1, got  # the same work outside a replay triggers full collections
    assert inside[0] > 100, got  # young collections go on
    assert inside[2] == 2, got  # only the collections before the replay starts and after it ends
    assert got["frozen"] > 0 and got["restored"] and got["unfrozen"] and got["enabled"], got
