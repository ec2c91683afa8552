"""S3-compatible object stores (AWS S3, MinIO, Ceph RGW, GCS's XML API, ...) through the MinIO
Python SDK. The endpoint and credentials come from the environment, with the AWS names most tools
share (the keys of the Secret that spec.model.bundleSecret names):

| variable | meaning |
|---|---|
| AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY | credentials (both unset: anonymous requests) |
| AWS_SESSION_TOKEN | temporary credentials' token |
| AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL | `http(s)://host[:port]` of the store (default https://s3.amazonaws.com) |
| AWS_REGION or AWS_DEFAULT_REGION | the bucket's region (default: asked of the store) |
| AWS_CA_BUNDLE | a PEM file of the CA certificates that sign an https endpoint's certificate |

The MinIO SDK (and urllib3 under it) is the `worker` extra, needed only where an s3:// bundle is fetched
or pushed: this module imports it inside the functions that use it, so that the rest of `storage/`
(https, pvc, oci sources, verification) runs without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from exitplan.storage.errors import StorageError

DEFAULT_ENDPOINT = "https://s3.amazonaws.com"


@dataclass
class Store:
    client: Any
    """minio.Minio"""
    endpoint: str


def endpoint_url(env: dict[str, str] | None = None) -> str:
    env = dict(os.environ if env is None else env)
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or DEFAULT_ENDPOINT


def connect(env: dict[str, str] | None = None) -> Store:
    """A client of the store the environment names (nothing is sent yet)."""
    import certifi
    import urllib3
    from minio import Minio

    env = dict(os.environ if env is None else env)
    endpoint = endpoint_url(env)
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
        raise StorageError(f"AWS_ENDPOINT_URL {endpoint!r} must be http(s)://HOST[:PORT] of an S3-compatible store")
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=10.0, read=120.0),
        retries=urllib3.Retry(total=2, backoff_factor=0.5, status_forcelist=[500, 502, 503, 504]),
        cert_reqs="CERT_REQUIRED",
        ca_certs=env.get("AWS_CA_BUNDLE") or certifi.where(),
    )
    client = Minio(
        parts.netloc,
        access_key=env.get("AWS_ACCESS_KEY_ID") or None,
        secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        session_token=env.get("AWS_SESSION_TOKEN") or None,
        secure=parts.scheme == "https",
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        http_client=http,
    )
    return Store(client, endpoint)


def explain(err: Exception, what: str, store: Store) -> StorageError:
    """One line for a failed request: what the store answered, or why it could not be reached."""
    from minio.error import InvalidResponseError, S3Error, ServerError
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(err, S3Error):
        return StorageError(f"{what}: the S3 endpoint {store.endpoint} answered {err.code}: {err.message}")
    if isinstance(err, (ServerError, InvalidResponseError)):
        return StorageError(f"{what}: the S3 endpoint {store.endpoint} failed: {err}")
    if isinstance(err, Urllib3Error):
        reason = getattr(err, "reason", None) or err
        return StorageError(f"{what}: cannot reach the S3 endpoint {store.endpoint}: {reason}")
    return StorageError(f"{what}: {err}")


def _errors() -> tuple[type[Exception], ...]:
    from minio.error import MinioException
    from urllib3.exceptions import HTTPError as Urllib3Error

    return (MinioException, Urllib3Error, ValueError)


def objects(store: Store, bucket: str, prefix: str, what: str) -> Iterator[tuple[str, str, int]]:
    """(key, path relative to the prefix, size in bytes) of every object under `prefix/`."""
    head = f"{prefix}/" if prefix else ""
    try:
        for obj in store.client.list_objects(bucket, prefix=head, recursive=True):
            if not obj.is_dir and not obj.object_name.endswith("/"):  # folder markers hold nothing
                yield obj.object_name, obj.object_name[len(head) :], int(obj.size or 0)
    except _errors() as err:
        raise explain(err, what, store) from err


def download(store: Store, bucket: str, key: str, target: Path, what: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        store.client.fget_object(bucket, key, str(target), tmp_file_path=str(target.with_name(f".{target.name}.part")))
    except _errors() as err:
        raise explain(err, what, store) from err


def upload(store: Store, bucket: str, key: str, source: Path, what: str) -> None:
    try:
        store.client.fput_object(bucket, key, str(source))
    except _errors() as err:
        raise explain(err, what, store) from err
