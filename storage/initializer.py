"""`exitplan storage-init URI DEST`: fetch a bundle into DEST and verify it (the pods' storage-init
init container; also by hand, to check a copy; `exitplan up` fetches through cache.py).

- s3://, https://, http://, a path or file://: DEST is emptied (only a directory that storage-init
  filled before, or an empty one) and filled, then verified.
- pvc:// and oci:// (`--verify-only`, as the operator runs it): the pod mounted the claim, or its
  bundle-image init container copied the image's /bundle, at DEST; it is verified where it lies.

Verification reads every file bundle.yaml's digests name; a file that is missing or differs fails
with the file named. A bundle without digests passes, reported "unverified".
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from exitplan.api.bundle import MANIFEST, bundle_files, file_sha256
from exitplan.api.bundle_source import HTTP, LOCAL, OCI, PVC, S3, BundleSource, SourceError, parse_bundle_uri
from exitplan.storage import archive, https, s3
from exitplan.storage.errors import StorageError
from exitplan.storage.limits import ArchiveLimits, too_big, too_many
from exitplan.storage.verify import FETCH_MARKER, Verification, verify_bundle

DOWNLOAD = ".exitplan-download"
"""A tarball on its way, beside the bundle it unpacks into (removed once unpacked)."""


def _prepare(dest: Path) -> None:
    """Empty `dest` for a fetch: it must be new, empty, or filled by storage-init before."""
    dest.mkdir(parents=True, exist_ok=True)
    entries = list(dest.iterdir())
    if entries and not (dest / FETCH_MARKER).exists():
        raise StorageError(f"{dest} is not empty and storage-init did not fill it; give a new or empty directory")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (dest / FETCH_MARKER).write_text("a bundle fetched by `exitplan storage-init`; it may empty this directory\n")


def _copy_local(src: Path, dest: Path, uri: str) -> None:
    if not (src / MANIFEST).is_file():
        raise StorageError(f"{uri}: no {MANIFEST} in {src}")
    for rel in [MANIFEST, *bundle_files(src)]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest / rel)


def _fetch_s3(
    source: BundleSource, dest: Path, sha256: str | None, env: dict[str, str] | None, limits: ArchiveLimits
) -> None:
    store = s3.connect(env)
    if source.tarball:
        tarball = dest / DOWNLOAD
        s3.download(store, source.location, source.path, tarball, source.uri)
        _unpack(tarball, dest, source.uri, sha256, limits)
        return
    count = total = 0
    for key, rel, size in s3.objects(store, source.location, source.path, source.uri):
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise StorageError(f"{source.uri}: object key {key!r} would land outside the bundle directory")
        count, total = count + 1, total + size
        if count > limits.max_files:
            raise too_many(source.uri, limits, total - size)
        if total > limits.max_bytes:
            raise too_big(source.uri, limits, total - size, f"its objects hold {total} bytes")
        s3.download(store, source.location, key, dest / rel, source.uri)
    if count == 0:
        raise StorageError(f"{source.uri}: no objects under that prefix at {store.endpoint}")


def _unpack(tarball: Path, dest: Path, uri: str, sha256: str | None, limits: ArchiveLimits) -> None:
    if sha256 is not None:
        got = file_sha256(tarball)
        if got != sha256:
            raise StorageError(f"{uri}: the tarball's sha256 is {got}, not {sha256} (spec.model.bundleSha256)")
    try:
        archive.extract_tarball(tarball, dest, uri, limits)
    finally:
        tarball.unlink(missing_ok=True)


def fetch(
    source: BundleSource,
    dest: Path,
    *,
    sha256: str | None,
    allow_http: bool,
    env: dict[str, str] | None = None,
    limits: ArchiveLimits | None = None,
) -> None:
    """Fill `dest` (emptied first) with the bundle `source` names; `env`: the S3 variables (storage/s3.py;
    None: this process's environment); `limits`: what a remote bundle may hold (storage/limits.py)."""
    limits = (limits or ArchiveLimits()).check()
    if source.kind in (PVC, OCI):
        raise StorageError(
            f"{source.uri}: a {source.kind}:// bundle is mounted (pvc) or copied out of its image (oci) by the "
            "pod itself; verify it where it lies with --verify-only"
        )
    _prepare(dest)
    if source.kind == LOCAL:
        _copy_local(Path(source.location).expanduser(), dest, source.uri)
    elif source.kind == S3:
        _fetch_s3(source, dest, sha256, env, limits)
    elif source.kind == HTTP:
        if sha256 is None:
            raise StorageError(f"{https.shown(source.uri)}: an http(s) bundle needs its sha256 (--sha256)")
        tarball = dest / DOWNLOAD
        https.download(source.location, tarball, sha256, allow_http)
        _unpack(tarball, dest, https.shown(source.uri), None, limits)


def storage_init(
    uri: str,
    dest: Path,
    *,
    sha256: str | None = None,
    allow_http: bool = False,
    verify_only: bool = False,
    env: dict[str, str] | None = None,
    say: Callable[[str], None] = print,
    limits: ArchiveLimits | None = None,
) -> Verification:
    """Fetch (unless `verify_only`) and verify; StorageError with a one-line reason otherwise. `env`: the
    S3 variables (None: this process's environment); `limits`: what the bundle may unpack to."""
    try:
        source = parse_bundle_uri(uri)
    except SourceError as err:
        raise StorageError(str(err)) from err
    shown = https.shown(uri) if source.kind == HTTP else uri
    try:
        if not verify_only:
            say(f"fetching {shown} into {dest}")
            fetch(source, dest, sha256=sha256, allow_http=allow_http, env=env, limits=limits)
        result = verify_bundle(dest, shown)
    except OSError as err:  # the local side: a full disk, a read-only or missing directory
        raise StorageError(f"{shown}: {err.filename or dest}: {err.strerror or err}") from err
    say(f"{shown}: {result.summary()}")
    return result
