"""Open files: a load test holds a connection per request in flight, and 1024 (a common soft limit) runs out.

`raise_open_files_limit` raises this process's soft limit to its hard one (a local front holds two
descriptors per piped connection, a load generator one per request in flight); `connection_ceiling` is how
many connections a replay may keep open at once under the limit in force.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

RESERVED = 256
"""Descriptors left for everything else in the process (files, the event loop, listening sockets)."""


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            log.warning("could not raise the open-files limit from %d: %s", soft, err)
            return soft
        return target
    return soft


def connection_ceiling() -> int:
    """Connections a replay keeps open at most: a quarter of the (raised) open-files limit less RESERVED
    (a request through a local front in this process holds up to three descriptors: the client's socket
    and the front's two); at least 64."""
    return max(64, (raise_open_files_limit() - RESERVED) // 4)
