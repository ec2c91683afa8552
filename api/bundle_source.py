"""Where a bundle comes from: the URI forms of `spec.model.bundle`, parsed once for the operator
(which volumes and init containers a pod gets) and the storage initializer (what it fetches).

| form | what |
|---|---|
| `/path`, `file:///path` (or a relative path) | a directory on the node (a hostPath; the operator allows only its configured prefixes) |
| `pvc://CLAIM/PATH` | directory PATH of a PersistentVolumeClaim of the service's namespace, mounted read-only |
| `s3://BUCKET/PREFIX` | the objects under PREFIX/ of any S3-compatible store (or one tarball object, `...tar.gz`) |
| `https://HOST/PATH.tar.gz` | a tarball over HTTPS, pinned by its sha256 (`http://` too, see `exitplan storage-init`) |
| `oci://REGISTRY/REPO:TAG` | an image holding the bundle at `/bundle` (copied out by an init container) |

Every form but the first two is remote: the pods' storage-init container fetches it into an emptyDir
(pvc and oci: verifies it where it lies) and checks it against the digests in its bundle.yaml.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL, PVC, S3, HTTP, OCI = "local", "pvc", "s3", "http", "oci"
SCHEMES = {"file": LOCAL, "pvc": PVC, "s3": S3, "http": HTTP, "https": HTTP, "oci": OCI}
IMAGE_BUNDLE_DIR = "/bundle"
"""Where an oci:// bundle image holds the bundle."""
TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")
FORMS = "a path, file:///PATH, pvc://CLAIM/PATH, s3://BUCKET/PREFIX, https://HOST/PATH.tar.gz or oci://IMAGE"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IMAGE = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)


class SourceError(ValueError):
    """A bundle URI that names no source exitplan can read; the message says which forms it takes."""


@dataclass(frozen=True)
class BundleSource:
    kind: str
    """local, pvc, s3, http or oci."""
    uri: str
    """The URI as given."""
    location: str = ""
    """local: the path; pvc: the claim; s3: the bucket; http: the URL; oci: the image reference."""
    path: str = ""
    """pvc: the directory in the claim ('' for its root); s3: the key prefix or the tarball's key."""

    @property
    def remote(self) -> bool:
        """True for every source the pods fetch or verify (not a directory on the node)."""
        return self.kind != LOCAL

    @property
    def tarball(self) -> bool:
        """An http(s) URL, or an s3 object named like a tarball (`.tar.gz`, `.tgz`, `.tar`)."""
        name = urlsplit(self.location).path if self.kind == HTTP else self.path
        return self.kind == HTTP or (self.kind == S3 and name.endswith(TARBALL_SUFFIXES))


def _relative(value: str, what: str, uri: str) -> str:
    """A relative path inside a claim or bucket: no `..`, no empty components (slashes at the ends dropped)."""
    value = value.strip("/")
    if value and (any(part in ("", ".", "..") for part in value.split("/")) or posixpath.normpath(value) != value):
        raise SourceError(
            f"bundle URI {uri!r}: the {what} {value!r} must be a plain relative path (no '.', '..' or '//')"
        )
    return value


def parse_bundle_uri(uri: str) -> BundleSource:
    """The source a bundle URI names; SourceError for a malformed one."""
    uri = uri.strip()
    if "://" not in uri:
        if not uri:
            raise SourceError(f"an empty bundle URI: give {FORMS}")
        return BundleSource(LOCAL, uri, location=uri)
    scheme = uri.split("://", 1)[0]
    kind = SCHEMES.get(scheme)
    if kind is None:
        raise SourceError(f"bundle URI {uri!r}: unknown scheme {scheme!r}; give {FORMS}")
    rest = uri.split("://", 1)[1]
    if kind == LOCAL:
        return BundleSource(LOCAL, uri, location=rest)
    if kind == OCI:
        if not _IMAGE.match(rest):
            raise SourceError(
                f"bundle URI {uri!r}: {rest!r} is not an image reference (REGISTRY/REPO:TAG or @sha256:...)"
            )
        return BundleSource(OCI, uri, location=rest)
    if kind == HTTP:
        parts = urlsplit(uri)
        if not parts.hostname or parts.fragment or not parts.path.endswith(TARBALL_SUFFIXES):
            raise SourceError(
                f"bundle URI {uri!r}: an http(s) bundle is a tarball URL, https://HOST/PATH.tar.gz (.tgz, .tar); "
                "`exitplan bundle push BUNDLE FILE.tar.gz` writes one"
            )
        return BundleSource(HTTP, uri, location=uri)
    head, _, tail = rest.partition("/")
    if kind == PVC:
        if not _DNS_SUBDOMAIN.match(head):
            raise SourceError(f"bundle URI {uri!r}: {head!r} is not a PersistentVolumeClaim name")
        return BundleSource(PVC, uri, location=head, path=_relative(tail, "path in the claim", uri))
    if not _BUCKET.match(head):
        raise SourceError(f"bundle URI {uri!r}: {head!r} is not an S3 bucket name")
    return BundleSource(S3, uri, location=head, path=_relative(tail, "key prefix", uri))
