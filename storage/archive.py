"""Bundle tarballs: written deterministically (sorted, no times or owners: the same bundle gives the
same sha256), read safely (only files and directories, every one inside the target directory, within
the limits of storage/limits.py)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import posixpath
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import IO, cast

from exitplan.api.bundle import MANIFEST, bundle_files, file_sha256
from exitplan.storage.errors import StorageError
from exitplan.storage.limits import ArchiveLimits, CountingReader, GuardedStream, Readable, too_big, too_many

STAGING = ".exitplan-unpack"
"""Where a tarball is unpacked, beside the bundle, until all of it passed."""


def write_tarball(bundle: Path, target: Path) -> str:
    """`bundle` as a gzipped tarball at `target` (bundle.yaml first, then every file by path); its sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    compress = target.name.endswith((".gz", ".tgz"))
    with open(tmp, "wb") as raw:
        stream = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) if compress else raw
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel in [MANIFEST, *bundle_files(bundle)]:
                info = tar.gettarinfo(str(bundle / rel), arcname=rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
                with open(bundle / rel, "rb") as handle:
                    tar.addfile(info, handle)
        if compress:
            stream.close()
    os.replace(tmp, target)
    return file_sha256(target)


def _name(member: tarfile.TarInfo) -> str:
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    return name


def _check(member: tarfile.TarInfo, source: str) -> None:
    name = _name(member)
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or posixpath.isabs(name):
        raise StorageError(
            f"{source}: tar member {member.name!r} would land outside the bundle directory; refusing the tarball"
        )
    if not (member.isfile() or member.isdir()):
        kind = "link" if member.issym() or member.islnk() else "special file"
        raise StorageError(f"{source}: tar member {member.name!r} is a {kind}; a bundle tarball holds only files")


def _top_folder(names: list[str]) -> str:
    """The one folder every member sits in, when bundle.yaml is there and not at the top ('' otherwise)."""
    if MANIFEST in names:
        return ""
    tops = {n.split("/", 1)[0] for n in names if n}
    if len(tops) == 1 and f"{next(iter(tops))}/{MANIFEST}" in names:
        return next(iter(tops))
    return ""


def _decompressed(raw: CountingReader, head: bytes) -> Readable:
    """The decompressed side of `raw` by its first bytes: gzip, bzip2, xz, else a plain tar."""
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(None, "rb", fileobj=raw)
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw, "rb")
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(cast("IO[bytes]", raw), "rb")  # LZMAFile reads only read()
    return raw


def _unpack(stream: GuardedStream, staging: Path, limits: ArchiveLimits, source: str) -> list[str]:
    """Every member of the tar `stream` into `staging`, checked one by one before it is written; their names."""
    names: list[str] = []
    declared = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            _check(member, source)
            names.append(_name(member))
            if len(names) > limits.max_files:
                raise too_many(source, limits, stream.count)
            declared += member.size
            if declared > limits.max_bytes:
                raise too_big(source, limits, stream.count, f"its members declare {declared} bytes")
            if _name(member) not in ("", "."):
                tar.extract(member.replace(name=_name(member), deep=False), staging, filter="data")
    return names


def _move_up(staging: Path, dest: Path, top: str) -> None:
    """What `staging` holds (or, with `top`, its one folder holds) into `dest`."""
    root = staging / top if top else staging
    for entry in sorted(root.iterdir()):
        target = dest / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def extract_tarball(tarball: Path, dest: Path, source: str, limits: ArchiveLimits | None = None) -> None:
    """Unpack a bundle tarball into `dest`, read as one stream within `limits` (storage/limits.py: total
    size, members, compression ratio; ArchiveLimitError past one): members with `..`, absolute names,
    links or devices are refused (the member is named); a tarball of one folder holding bundle.yaml is
    unpacked from inside it. Nothing lands in `dest` unless the whole tarball passes."""
    limits = (limits or ArchiveLimits()).check()
    staging = dest / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with open(tarball, "rb") as handle:
            raw = CountingReader(handle)
            head = handle.read(6)
            handle.seek(0)
            stream = GuardedStream(_decompressed(raw, head), raw, limits, source)
            names = _unpack(stream, staging, limits, source)
        _move_up(staging, dest, _top_folder(names))
    except tarfile.FilterError as err:
        raise StorageError(f"{source}: refusing the tarball: {err}") from err
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as err:
        raise StorageError(f"{source}: not a readable tarball: {err}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
