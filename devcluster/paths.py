"""Request paths of the core `namespaces` resource, which kmock 0.8 reads as namespaced paths.

kmock's path parser (`kmock._internal.parsing.parse_path`) takes `/api/v1/namespaces/X/...` as "in
namespace X": `/api/v1/namespaces` (what `kubectl get ns` lists) fails with a ValueError and
`/api/v1/namespaces/default` parses with no resource at all. `install()` wraps that parser, once per
process, so that these paths name the namespaces resource itself; every other path parses as before.
"""

from __future__ import annotations

from typing import Any

from kmock._internal import parsing

NAMESPACE_SUBRESOURCES = ("status", "finalize")


def parse_path(path: str, original: Any = parsing.parse_path) -> parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"]:
        rest = parts[3:]
        if not rest:
            return parsing.ParsedPath("", "v1", "namespaces")
        if len(rest) == 1 or (len(rest) == 2 and rest[1] in NAMESPACE_SUBRESOURCES):
            return parsing.ParsedPath("", "v1", "namespaces", None, rest[0], rest[1] if len(rest) == 2 else None)
    return original(path)  # type: ignore[no-any-return]


def install() -> None:
    """Read namespace paths as the namespaces resource (idempotent)."""
    if parsing.parse_path is not parse_path:
        parsing.parse_path = parse_path
