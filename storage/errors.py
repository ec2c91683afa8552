"""The one error of the storage room: a one-line reason, what the storage-init container leaves as
its termination message (the operator quotes it in the service's condition)."""

from __future__ import annotations


class StorageError(Exception):
    """A bundle that cannot be fetched, verified or pushed; the message is one line that names the
    source, the file or the endpoint at fault."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class DigestMismatch(StorageError):
    """A file whose sha256 is not the one bundle.yaml records."""
