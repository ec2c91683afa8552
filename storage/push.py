"""`exitplan bundle push BUNDLE URI`: upload a bundle where pods can fetch it.

- `s3://BUCKET/PREFIX`: every file under PREFIX/ (bundle.yaml last, so a reader never finds a
  manifest whose files are not there yet); `s3://BUCKET/KEY.tar.gz`: one tarball object.
- a path ending in .tar.gz, .tgz or .tar: the bundle as one tarball there (to host over https);
  any other path: a directory, where `<bundle name>.tar.gz` and its `.sha256` are written.

The bundle is verified against its digests first; a bundle without digests is refused (run
`exitplan bundle digest BUNDLE`), since its receivers could not verify it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from exitplan.api.bundle import MANIFEST, BundleError, bundle_files, read_manifest
from exitplan.api.bundle_source import LOCAL, S3, TARBALL_SUFFIXES, SourceError, parse_bundle_uri
from exitplan.storage import archive, s3
from exitplan.storage.errors import StorageError
from exitplan.storage.verify import verify_bundle


@dataclass
class Pushed:
    uri: str
    """Where the bundle is now."""
    files: int
    sha256: str | None = None
    """The tarball's sha256 (spec.model.bundleSha256), for a tarball."""
    size: int = 0
    """Bytes the bundle unpacks to (spec.model.bundleSize): its files' sizes together."""


def push(bundle: Path, uri: str) -> Pushed:
    try:
        manifest = read_manifest(bundle)
        source = parse_bundle_uri(uri)
    except (BundleError, SourceError) as err:
        raise StorageError(str(err)) from err
    if not manifest.digests:
        raise StorageError(
            f"{bundle}: bundle.yaml records no digests, so no receiver could verify it; run "
            f"`exitplan bundle digest {bundle}` first"
        )
    verified = verify_bundle(bundle)
    files = [*bundle_files(bundle), MANIFEST]
    size = sum((bundle / rel).stat().st_size for rel in files)
    if source.kind == S3:
        pushed = _push_s3(bundle, source.location, source.path, uri, files, verified.verified)
        pushed.size = size
        return pushed
    if source.kind != LOCAL:
        raise StorageError(
            f"{uri}: push writes to s3://BUCKET/PREFIX or a local path (a tarball to host over https), "
            f"not to {source.kind}://"
        )
    given = Path(source.location).expanduser()
    tarball = given if given.name.endswith(TARBALL_SUFFIXES) else given / f"{manifest.name}.tar.gz"
    digest = archive.write_tarball(bundle, tarball)
    if tarball != given:  # a directory to serve: the tarball and its checksum file (sha256sum's format)
        tarball.with_name(f"{tarball.name}.sha256").write_text(f"{digest}  {tarball.name}\n")
    return Pushed(str(tarball), len(files), digest, size)


def _push_s3(bundle: Path, bucket: str, key: str, uri: str, files: list[str], count: int) -> Pushed:
    store = s3.connect()
    if key.endswith(TARBALL_SUFFIXES):
        with tempfile.TemporaryDirectory(prefix="exitplan-push-") as tmp:
            tarball = Path(tmp) / Path(key).name
            digest = archive.write_tarball(bundle, tarball)
            s3.upload(store, bucket, key, tarball, uri)
        return Pushed(uri, len(files), digest)
    for rel in files:
        s3.upload(store, bucket, f"{key}/{rel}" if key else rel, bundle / rel, uri)
    return Pushed(uri, len(files))
