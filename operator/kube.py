"""A small async Kubernetes API client (aiohttp) for the operator's own calls.

kopf talks to the API for the watched resources; children, pools, profiles and events go through
this client. Connection settings come from the `kubernetes` package's config loaders (in-cluster
service account, else the kubeconfig: $KUBECONFIG or ~/.kube/config), so every kubeconfig that
kubectl accepts works here too. Server errors (5xx, 429) and connection errors are retried with
backoff; 4xx answers raise `ApiError` at once, with the status, so callers handle 404 and 409 on
purpose.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

from exitplan.api.manifest import Manifest

# kind -> (api path prefix, plural, namespaced)
KINDS: dict[str, tuple[str, str, bool]] = {
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "Service": ("/api/v1", "services", True),
    "Endpoints": ("/api/v1", "endpoints", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "Namespace": ("/api/v1", "namespaces", False),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "GPUPool": ("/apis/exitplan.io/v1alpha1", "gpupools", False),
    "EarlyExitService": ("/apis/exitplan.io/v1alpha1", "earlyexitservices", True),
    "ModelProfile": ("/apis/exitplan.io/v1alpha1", "modelprofiles", True),
}
BACKOFFS = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Seconds between retries of a request that failed with 5xx/429 or a connection error."""


class ApiError(Exception):
    """An API answer with a 4xx/5xx status (after retries for the retriable ones)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def path(kind: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    """The REST path of a kind's collection or of one object."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {sorted(KINDS)}")
    prefix, plural, namespaced = KINDS[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced and namespace else f"{prefix}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


def object_path(obj: Manifest, subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return path(obj["kind"], meta.get("namespace"), meta["name"], subresource)


def load_config(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A `kubernetes.client.Configuration`: in-cluster when no kubeconfig is named and the pod has a
    service account, else the kubeconfig (`kubeconfig`, then $KUBECONFIG, then ~/.kube/config)."""
    # deferred: the kubernetes package (the `operator` extra, about a second to import) is read only
    # here, for its config loaders; the dev cluster uses this client without it
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    cfg = kclient.Configuration()
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    if kubeconfig is None:
        try:
            kconfig.load_incluster_config(client_configuration=cfg)
            return cfg
        except kconfig.ConfigException:
            kubeconfig = os.path.expanduser("~/.kube/config")
    kconfig.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return cfg


def bearer(cfg: Any) -> str:
    """The Authorization header value of a kubernetes Configuration ('' when it has no token)."""
    token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken") or ""
    if token and not token.startswith("Bearer "):
        token = f"{cfg.api_key_prefix.get('authorization', 'Bearer')} {token}"
    return token


MAX_IN_FLIGHT = 100
"""Requests in flight to the API server at once (watches aside: a session of their own). The bound is a
semaphore of the client's own, the connection pool is unbounded: aiohttp's pool limit can lose slots to
requests that their timeout cancels while they wait for or take a connection (aio-libs/aiohttp#9670 is one
such case); at 400 services, an apply burst that kept the emulated API server busy past the 30 s timeout
left every later request of the operator timing out (bench/operator_scale.py, session 18)."""


class KubeClient:
    """Async JSON client for one API server."""

    def __init__(
        self,
        server: str,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | bool | None = None,
        backoffs: tuple[float, ...] = BACKOFFS,
        timeout_s: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.timeout_s = timeout_s
        """Each request's limit (connection, sending and the whole answer)."""
        self.headers = headers or {}
        self.ssl: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        """aiohttp's `ssl`: True verifies with the system's CAs, False does not verify, a context is used as given."""
        self.backoffs = backoffs
        self.observers: list[Callable[[str, str, Manifest], None]] = []
        """Called with (method, url, the API's answer) after each write this client made that succeeded
        (POST, PATCH, DELETE): the watch-fed copies (watched.py) expect to see it."""
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeClient:
        """From the in-cluster service account, else from a kubeconfig (as kubectl reads it)."""
        cfg = load_config(kubeconfig, context)
        headers = {"Authorization": bearer(cfg)} if bearer(cfg) else {}
        ctx: ssl.SSLContext | bool | None = None
        if cfg.host.startswith("https"):
            if cfg.verify_ssl:
                ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
                if cfg.cert_file:
                    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            else:
                ctx = False
        return cls(cfg.host, headers, ctx)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._watch_session is not None:
            await self._watch_session.close()
            self._watch_session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Manifest:
        data = None if body is None else orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        for _attempt, backoff in enumerate((*self.backoffs, None)):
            try:
                async with self._in_flight:  # released however the request ends (a timeout cancels it anywhere)
                    answer, err = await self._once(method, url, data, params, headers)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                if backoff is None:
                    raise ApiError(503, "Unavailable", f"{method} {url}: {exc!r}") from exc
                await asyncio.sleep(backoff)
                continue
            if err is None:
                return answer
            if (err.status >= 500 or err.status == 429) and backoff is not None:
                await asyncio.sleep(backoff)  # outside the in-flight slot and the connection
                continue
            raise err
        raise AssertionError("unreachable")  # the last iteration always returns or raises

    async def _once(
        self, method: str, url: str, data: bytes | None, params: dict[str, str] | None, headers: dict[str, str]
    ) -> tuple[Manifest, ApiError | None]:
        """One request: (the answer, None), or ({}, the API's error)."""
        async with self._sess().request(
            method, self.server + url, data=data, params=params, headers=headers, ssl=self.ssl
        ) as rsp:
            raw = await rsp.read()  # orjson: the shared lists of every tick are most of the operator's CPU
        if rsp.status < 400:
            answer = orjson.loads(raw) if raw else {}
            if method != "GET":
                for observe in self.observers:
                    observe(method, url, answer)
            return answer, None
        try:
            status = orjson.loads(raw)
        except orjson.JSONDecodeError:
            status = {"message": raw[:500].decode(errors="replace")}
        if not isinstance(status, dict):
            status = {"message": str(status)[:500]}
        return {}, ApiError(rsp.status, str(status.get("reason") or rsp.reason), str(status.get("message", "")))

    async def get(self, url: str) -> Manifest:
        return await self.request("GET", url)

    async def list(self, url: str, selector: str = "", fields: str = "") -> list[Manifest]:
        params = {k: v for k, v in (("labelSelector", selector), ("fieldSelector", fields)) if v}
        return list((await self.request("GET", url, params=params or None)).get("items", []))

    async def list_at(self, url: str, selector: str = "") -> tuple[builtins.list[Manifest], str]:
        """A list and its resourceVersion (where a watch of the same collection starts)."""
        listing = await self.request("GET", url, params={"labelSelector": selector} if selector else None)
        return list(listing.get("items") or []), str((listing.get("metadata") or {}).get("resourceVersion") or "")

    async def watch(self, url: str, resource_version: str, seconds: int, selector: str = "") -> AsyncIterator[Manifest]:
        """The collection's watch events from `resource_version` until the server ends the watch after
        `seconds` (a connection of its own: watches do not take the requests' connections)."""
        params = {"watch": "true", "resourceVersion": resource_version, "timeoutSeconds": str(seconds)}
        params |= {"allowWatchBookmarks": "true"} | ({"labelSelector": selector} if selector else {})
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
            )
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=seconds + 30)
        async with self._watch_session.get(
            self.server + url, params=params, headers={"Accept": "application/json"}, ssl=self.ssl, timeout=timeout
        ) as rsp:
            if rsp.status >= 400:
                raw = await rsp.read()
                raise ApiError(rsp.status, str(rsp.reason), raw[:500].decode(errors="replace"))
            pending = b""
            async for chunk in rsp.content.iter_any():
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.strip():
                        yield orjson.loads(line)
            if pending.strip():
                yield orjson.loads(pending)

    async def create(self, obj: Manifest) -> Manifest:
        meta = obj["metadata"]
        return await self.request("POST", path(obj["kind"], meta.get("namespace")), body=obj)

    async def merge_patch(self, url: str, patch: Manifest) -> Manifest:
        return await self.request("PATCH", url, body=patch, content_type="application/merge-patch+json")

    async def delete(self, url: str) -> Manifest:
        return await self.request("DELETE", url, body={"propagationPolicy": "Background"})
