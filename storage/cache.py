"""A remote bundle fetched into a local cache directory and verified (`exitplan up` with an s3:// or
https:// spec.model.bundle): the same fetch and checks as the pods' storage-init container
(initializer.storage_init), into `<cache>/<name>-<key>`, kept for the next run.

| source | reused when | else |
|---|---|---|
| a tarball with its sha256 (https://, http://, s3://...tar.gz) | the copy still matches bundle.yaml's digests (the sha256 pins what was unpacked) | fetched again |
| s3://BUCKET/PREFIX | the store's bundle.yaml is the cached one's (its digests pin every file) and the copy matches them | fetched again |
| s3://...tar.gz without a sha256 | never (nothing pins it) | fetched again |

A path or file:// is not fetched (the directory itself); pvc:// and oci:// live in a cluster and are
refused. Credentials for S3 come from the environment (storage/s3.py's variables) and, over it, an
env file of KEY=VALUE lines: the keys of the Secret that spec.model.bundleSecret names in a cluster
(`kubectl create secret generic NAME --from-env-file FILE` makes one from the same file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from exitplan.api.bundle import MANIFEST
from exitplan.api.bundle_source import HTTP, LOCAL, OCI, PVC, S3, TARBALL_SUFFIXES, SourceError, parse_bundle_uri
from exitplan.storage import https, s3
from exitplan.storage.errors import StorageError
from exitplan.storage.initializer import storage_init
from exitplan.storage.verify import verify_bundle

COMPLETE = ".fetched.json"
"""Beside a cache directory (`<dir>.fetched.json`), written once its bundle was fetched and verified."""
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and `#` comments skipped; quotes around a value dropped), as
    `kubectl create secret generic --from-env-file` reads them."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise StorageError(f"{path}: {err.strerror or err}") from err
    env: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, sep, value = text.partition("=")
        key = key.removeprefix("export ").strip()
        if not sep or not _KEY.match(key):
            raise StorageError(f"{path}: line {number} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def _directory(uri: str, kind: str, sha256: str | None) -> str:
    """`<name>-<key>`: the bundle's last path component and a hash of where it comes from."""
    where = https.shown(uri) if kind == HTTP else uri.rstrip("/")  # a presigned URL's query changes, not its file
    name = where.rsplit("/", 1)[-1]
    for suffix in TARBALL_SUFFIXES:
        name = name.removesuffix(suffix)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip(".-") or "bundle"
    key = hashlib.sha256(f"{where}\n{sha256 or ''}".encode()).hexdigest()[:12]
    return f"{name[:60]}-{key}"


def _store_manifest_is(source_uri: str, bucket: str, prefix: str, cached: Path, env: dict[str, str]) -> bool:
    """Whether the store's bundle.yaml under `prefix` is byte for byte the cached one."""
    store = s3.connect(env)
    probe = cached.parent / f".{cached.name}.remote-{MANIFEST}"
    try:
        s3.download(store, bucket, f"{prefix}/{MANIFEST}" if prefix else MANIFEST, probe, source_uri)
        return probe.read_bytes() == (cached / MANIFEST).read_bytes()
    finally:
        probe.unlink(missing_ok=True)


def _complete(dest: Path) -> Path:
    return dest.with_name(dest.name + COMPLETE)


def _reusable(dest: Path, source_uri: str, kind: str, tarball: bool, sha256: str | None, env: dict[str, str]) -> bool:
    if not _complete(dest).is_file() or not (dest / MANIFEST).is_file():
        return False
    if kind == S3 and not tarball:
        source = parse_bundle_uri(source_uri)
        if not _store_manifest_is(source_uri, source.location, source.path, dest, env):
            return False
    elif sha256 is None:
        return False
    try:
        verify_bundle(dest)
    except StorageError:
        return False  # changed or damaged since: fetch it again
    return True


def cached_bundle(
    uri: str,
    cache: Path,
    *,
    sha256: str | None = None,
    env: dict[str, str] | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """The local directory of the bundle `uri` names: the path itself for a local bundle, else a
    verified copy under `cache` (fetched now, or by an earlier run when still current).
    StorageError, one line, when it cannot be fetched or does not verify."""
    try:
        source = parse_bundle_uri(uri)
    except SourceError as err:
        raise StorageError(str(err)) from err
    if source.kind == LOCAL:
        return Path(source.location).expanduser()
    if source.kind in (PVC, OCI):
        raise StorageError(
            f"{uri}: a {source.kind}:// bundle lives in a cluster; on this machine give a path, s3://BUCKET/PREFIX "
            f"or https://HOST/PATH.tar.gz with spec.model.bundleSha256 (`exitplan bundle push` makes either)"
        )
    environment = {**os.environ, **(env or {})}
    shown = https.shown(uri) if source.kind == HTTP else uri
    dest = cache / _directory(uri, source.kind, sha256)
    if _reusable(dest, uri, source.kind, source.tarball, sha256, environment):
        say(f"{shown}: using the verified copy in {dest}")
        return dest
    _complete(dest).unlink(missing_ok=True)
    allow_http = source.kind == HTTP and uri.startswith("http://")  # as the operator: the spec says http:// on purpose
    try:
        storage_init(uri, dest, sha256=sha256, allow_http=allow_http, env=environment, say=say)
    except StorageError:
        shutil.rmtree(dest, ignore_errors=True)  # no half copy left in the cache
        raise
    _complete(dest).write_text(json.dumps({"source": shown, "sha256": sha256}) + "\n")
    return dest
