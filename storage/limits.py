"""What a bundle archive may unpack to: the total size, the number of members and the compression ratio.

A tarball is read as one stream (storage/archive.py): the compressed bytes through a counter, the
decompressed ones through :class:`GuardedStream`, which refuses the archive the moment it passes a limit,
so that a bomb (a 200 KB tar.gz of 200 MB of zeros) is refused after a few MiB read, never unpacked.

- total size: the sum of the members' declared sizes (checked on each header, before its data is
  written) and the decompressed stream itself may not pass `max_bytes`. The operator passes the bundle's
  stated size (spec.model.bundleSize), else its default (env EXITPLAN_BUNDLE_MAX_BYTES, else
  DEFAULT_MAX_BYTES), as `exitplan storage-init --max-bytes`.
- members: at most `max_files` files and directories.
- ratio: once RATIO_FLOOR bytes are decompressed, at most `max_ratio` decompressed bytes per compressed
  byte read. Real bundles are ONNX weights (about 1.1:1) and a little text; gzip's own ceiling is about
  1032:1.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Protocol

from exitplan.storage.errors import StorageError

GiB = 1024**3
DEFAULT_MAX_BYTES = 20 * GiB
DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_RATIO = 100.0
RATIO_FLOOR = 1024 * 1024
"""Decompressed bytes before the ratio is judged (a tiny tarball is mostly headers and padding)."""
ENV_MAX_BYTES = "EXITPLAN_BUNDLE_MAX_BYTES"
ENV_MAX_FILES = "EXITPLAN_BUNDLE_MAX_FILES"
ENV_MAX_RATIO = "EXITPLAN_BUNDLE_MAX_RATIO"


class ArchiveLimitError(StorageError):
    """An archive that passes one of its limits; the message names the limit, the figure read before
    refusing and how to raise it."""


@dataclass(frozen=True)
class ArchiveLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES
    max_ratio: float = DEFAULT_MAX_RATIO

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ArchiveLimits:
        """The defaults, or what EXITPLAN_BUNDLE_MAX_BYTES / _MAX_FILES / _MAX_RATIO say (the operator's
        environment: set through the chart's operator.extraEnv)."""
        env = dict(os.environ if env is None else env)
        try:
            return cls(
                int(env.get(ENV_MAX_BYTES) or DEFAULT_MAX_BYTES),
                int(env.get(ENV_MAX_FILES) or DEFAULT_MAX_FILES),
                float(env.get(ENV_MAX_RATIO) or DEFAULT_MAX_RATIO),
            )
        except ValueError as err:
            raise StorageError(f"{ENV_MAX_BYTES}, {ENV_MAX_FILES} and {ENV_MAX_RATIO} take numbers: {err}") from err

    def check(self) -> ArchiveLimits:
        if self.max_bytes < 1 or self.max_files < 1 or self.max_ratio < 1:
            raise StorageError(f"archive limits must be positive (max ratio at least 1), got {self}")
        return self


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class CountingReader:
    """A binary file read through, counting the bytes read (the compressed side of the ratio)."""

    def __init__(self, raw: Readable) -> None:
        self.raw, self.count = raw, 0

    def read(self, size: int = -1, /) -> bytes:
        data = self.raw.read(size)
        self.count += len(data)
        return data

    def seekable(self) -> bool:
        return False  # read once, front to back

    def seek(self, offset: int, /) -> int:
        raise io.UnsupportedOperation("an archive is read as one stream")


class GuardedStream:
    """The decompressed stream of an archive, refused once it passes `limits` (ArchiveLimitError)."""

    def __init__(self, inner: Readable, compressed: CountingReader, limits: ArchiveLimits, source: str) -> None:
        self.inner, self.compressed, self.limits, self.source = inner, compressed, limits, source
        self.count = 0
        self.slack = 1024 * (limits.max_files + 2) + 20 * 512  # tar headers and padding beside the data

    def read(self, size: int = -1, /) -> bytes:
        data = self.inner.read(size)
        self.count += len(data)
        limits = self.limits
        if self.count > limits.max_bytes + self.slack:
            raise too_big(self.source, limits, self.count, f"its stream passed {self.count} bytes")
        if self.count >= RATIO_FLOOR and self.count > limits.max_ratio * max(self.compressed.count, 1):
            ratio = self.count / max(self.compressed.count, 1)
            raise ArchiveLimitError(
                f"{self.source}: refusing the tarball: it inflates {ratio:.0f}:1, above the limit of "
                f"{limits.max_ratio:g}:1 (read {self.count} bytes from {self.compressed.count} compressed before "
                f"refusing); raise it with --max-ratio (the operator's env {ENV_MAX_RATIO})"
            )
        return data


def too_big(source: str, limits: ArchiveLimits, read: int, what: str) -> ArchiveLimitError:
    return ArchiveLimitError(
        f"{source}: refusing the tarball: {what}, above the limit of {limits.max_bytes} bytes (read {read} "
        f"bytes before refusing); state the bundle's size in spec.model.bundleSize or raise --max-bytes "
        f"(the operator's env {ENV_MAX_BYTES})"
    )


def too_many(source: str, limits: ArchiveLimits, read: int) -> ArchiveLimitError:
    return ArchiveLimitError(
        f"{source}: refusing the tarball: more than {limits.max_files} members, the limit (read {read} bytes "
        f"before refusing); raise it with --max-files (the operator's env {ENV_MAX_FILES})"
    )
