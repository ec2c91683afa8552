"""Bundle tarballs over HTTP(S) (urllib), pinned by their sha256.

Plain `http://` is refused unless the host is this machine (localhost, 127.0.0.1, ::1) or the caller
allows it (`exitplan storage-init --allow-http`; the operator passes it when spec.model.bundle says
`http://`, which someone chose on purpose): the sha256 still pins what arrives, but anyone on the path
sees it. A URL's query (a presigned URL's signature) never appears in a message.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from exitplan.storage.errors import StorageError

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
TIMEOUT_S = 60.0
CHUNK = 1 << 20


def shown(url: str) -> str:
    """The URL without its query and credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def check_scheme(url: str, allow_http: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme == "https" or (parts.scheme == "http" and (allow_http or parts.hostname in LOCAL_HOSTS)):
        return
    if parts.scheme == "http":
        raise StorageError(
            f"{shown(url)}: plain http to another machine is refused; use https, or pass --allow-http "
            "(the sha256 still pins the content)"
        )
    raise StorageError(f"{shown(url)}: not an http(s) URL")


def download(url: str, target: Path, sha256: str, allow_http: bool = False) -> None:
    """Fetch `url` into `target`; StorageError when the server cannot be reached, answers an error, or
    sends bytes whose sha256 is not `sha256`."""
    check_scheme(url, allow_http)
    request = urllib.request.Request(url, headers={"User-Agent": "exitplan-storage-init"})
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer, open(target, "wb") as out:
            while chunk := answer.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as err:
        raise StorageError(f"{shown(url)}: the server answered HTTP {err.code} {err.reason}") from err
    except urllib.error.URLError as err:
        raise StorageError(f"{shown(url)}: cannot reach the server: {err.reason}") from err
    except (TimeoutError, OSError) as err:
        raise StorageError(f"{shown(url)}: the download failed: {err}") from err
    got = digest.hexdigest()
    if got != sha256:
        raise StorageError(
            f"{shown(url)}: the tarball's sha256 is {got}, not {sha256} (spec.model.bundleSha256, --sha256): "
            "the file changed since it was pushed, or the URL names another one"
        )
