"""The service's control token: one Secret per EarlyExitService (`<svc>-control-token`, key `token`).

Created once by the reconcile, before the first pods that mount it, and never rotated by the
operator (delete the Secret and restart the pods to rotate: the next reconcile makes a new one).
Router and worker pods read it from their mounted file; the operator reads it here to talk to the
routers' control endpoints (driftloop.py). The Secret is adopted by the service, so it goes with it.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from exitplan.api.manifest import Manifest
from exitplan.operator import names
from exitplan.operator.kube import ApiError, KubeClient, path
from exitplan.operator.ownership import adopt


def build_secret(owner: Manifest, token: str) -> Manifest:
    """The Secret holding the service's control token, adopted by the service."""
    service = owner["metadata"]["name"]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": names.control_secret_name(service),
            "namespace": owner["metadata"]["namespace"],
            "labels": {**names.MANAGED, names.L_SERVICE: service},
        },
        "data": {names.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
    adopt([secret], owner=owner)
    return secret


def _decode(secret: Manifest) -> str | None:
    try:
        token = base64.b64decode((secret.get("data") or {}).get(names.TOKEN_KEY, "")).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return token or None


async def read_token(client: KubeClient, service: str, namespace: str) -> str | None:
    """The service's control token (None while its Secret does not exist or holds none)."""
    try:
        secret = await client.get(path("Secret", namespace, names.control_secret_name(service)))
    except ApiError as err:
        if err.status == 404:
            return None
        raise
    return _decode(secret)


def _forbidden(err: ApiError, namespace: str) -> ApiError:
    """A 403 on the Secret, said as what to change: the chart grants Secrets only in its namespaces."""
    if err.status != 403:
        return err
    return ApiError(
        403,
        "Forbidden",
        f"the operator may not read or create Secrets in namespace {namespace} (the chart grants them only in "
        f"namespaces.services, never cluster-wide); add {namespace} to the chart's namespaces.services and "
        f"`helm upgrade` ({err.message})",
    )


async def ensure_token(client: KubeClient, owner: Manifest) -> str:
    """The service's control token, its Secret created first when missing (a race with another
    replica of the operator ends with the Secret that was created first)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    try:
        token = await read_token(client, name, namespace)
    except ApiError as err:
        raise _forbidden(err, namespace) from err
    if token is not None:
        return token
    token = secrets.token_urlsafe(32)
    try:
        await client.create(build_secret(owner, token))
    except ApiError as err:
        if err.status != 409:
            raise _forbidden(err, namespace) from err
        again = await read_token(client, name, namespace)
        if again is None:
            raise
        return again
    return token
