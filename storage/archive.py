"""Bundle tarballs: written deterministically (sorted, no times or owners: the same bundle gives the
same sha256), read safely (only files and directories, every one inside the target directory)."""

from __future__ import annotations

import gzip
import os
import posixpath
import tarfile
from pathlib import Path

from exitplan.api.bundle import MANIFEST, bundle_files, file_sha256
from exitplan.storage.errors import StorageError


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


def extract_tarball(tarball: Path, dest: Path, source: str) -> None:
    """Unpack a bundle tarball into `dest`: members with `..`, absolute names, links or devices are
    refused (the member is named); a tarball of one folder holding bundle.yaml is unpacked from inside it."""
    try:
        with tarfile.open(tarball, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                _check(member, source)
            top = _top_folder([_name(m) for m in members])
            kept = []
            for member in members:
                name = _name(member)
                if top:
                    name = name[len(top) + 1 :] if name.startswith(top + "/") else ""
                if name and name != ".":
                    kept.append(member.replace(name=name, deep=False))
            tar.extractall(dest, members=kept, filter="data")
    except tarfile.FilterError as err:
        raise StorageError(f"{source}: refusing the tarball: {err}") from err
    except (tarfile.TarError, EOFError, OSError) as err:
        raise StorageError(f"{source}: not a readable tarball: {err}") from err
