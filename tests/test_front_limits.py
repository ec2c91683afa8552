"""The local front and the load generator raise their process's open-files limit (the front holds two
descriptors per piped connection beside the load its process may generate, and 1024, a common soft limit,
runs out in a load test); a replay keeps no more connections open than the limit allows."""

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
        "import resource; from exitplan.client.open_files import raise_open_files_limit as r; "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], r(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, preexec_fn=lower, check=True
    )
    before, returned, after = (int(x) for x in out.stdout.split())
    assert before == low
    expected = hard if hard != resource.RLIM_INFINITY else max(low, 1 << 16)
    assert returned == after == expected


def test_a_replay_keeps_its_connections_within_the_open_files_limit():
    """Where the hard limit is 1,024, a replay keeps at most (1024 - 256) / 4 = 192 connections open: past
    that a request waits for a connection (late, counted so) rather than the process running out of
    descriptors."""

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    code = "from exitplan.client.open_files import connection_ceiling as c; print(c())"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, preexec_fn=low, check=True)
    assert int(out.stdout) == 192
