"""The local front raises its process's open-files limit: it holds two descriptors per piped connection
beside the load its process may generate, and 1024 (a common soft limit) runs out in a load test."""

from __future__ import annotations

import resource
import subprocess
import sys


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, soft)

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    code = (
        "import resource; from exitplan.localrun.front import raise_open_files_limit as r; "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], r(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, preexec_fn=lower, check=True
    )
    before, returned, after = (int(x) for x in out.stdout.split())
    assert before == low
    expected = hard if hard != resource.RLIM_INFINITY else max(low, 1 << 16)
    assert returned == after == expected
