"""A bundle directory against the digests its bundle.yaml records (`exitplan prepare` writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from exitplan.api.bundle import BundleError, bundle_files, file_sha256, read_manifest
from exitplan.storage.errors import DigestMismatch, StorageError

FETCH_MARKER = ".exitplan-storage-init"
"""Left in a directory storage-init fills: a later run may empty it (and only such a directory)."""


@dataclass
class Verification:
    verified: int = 0
    """Files whose sha256 matched bundle.yaml's digests."""
    has_digests: bool = False
    """False for a bundle prepared before digests were recorded: it loads, unverified."""
    uncovered: list[str] = field(default_factory=list)
    """Files of the directory that the digests do not name (e.g. profiles/ added after prepare)."""

    def summary(self) -> str:
        if not self.has_digests:
            return (
                f"unverified: bundle.yaml records no digests (prepared before they were recorded; "
                f"`exitplan bundle digest` adds them); {len(self.uncovered)} files"
            )
        extra = (
            f"; {len(self.uncovered)} files not covered by the digests: {self.uncovered[:5]}" if self.uncovered else ""
        )
        return f"verified: {self.verified} files match bundle.yaml's sha256 digests{extra}"


def verify_bundle(directory: Path, source: str = "") -> Verification:
    """Check every file bundle.yaml's digests name; StorageError (DigestMismatch) names the first file
    that is missing or differs. A bundle without digests passes as unverified."""
    where = source or str(directory)
    try:
        manifest = read_manifest(directory)
    except BundleError as err:
        raise StorageError(f"{where}: not a bundle: {err}") from err
    present = set(bundle_files(directory)) - {FETCH_MARKER}
    if not manifest.digests:
        return Verification(uncovered=sorted(present))
    named = [b.file for b in manifest.blocks] + [r.file for r in manifest.ramps]
    named += [manifest.tokenizer] if manifest.tokenizer else []
    for rel in named:
        if rel not in manifest.digests:
            raise StorageError(f"{where}: bundle.yaml names {rel} but its digests do not cover it")
    for rel, want in sorted(manifest.digests.items()):
        path = directory / rel
        if rel.startswith("/") or ".." in rel.split("/") or not path.is_file():
            raise StorageError(f"{where}: bundle file {rel} is missing (bundle.yaml's digests name it)")
        got = file_sha256(path)
        if got != want:
            raise DigestMismatch(
                f"{where}: bundle file {rel} has sha256 {got[:16]}..., bundle.yaml records {want[:16]}...: "
                "the copy is corrupt or the file changed after `exitplan prepare`"
            )
    return Verification(len(manifest.digests), True, sorted(present - set(manifest.digests)))
