"""An emulated Kubernetes API server for tests and `exitplan dev-cluster`: kmock's emulator plus
what kopf, kubectl and the operator need from a real one.

kmock 0.8 (`kmock.KubernetesEmulator`) stores objects and serves list/watch/fetch/create/patch/
delete. `DevKubeAPI` adds, on top of the same object store and discovery:

- object metadata a real server sets: `uid`, a cluster-wide increasing `resourceVersion`,
  `generation` (bumped when anything but metadata/status changes), `creationTimestamp`,
  `generateName`;
- patches by content type (merge, JSON patch, kubectl's strategic merge as a merge patch with its
  `$` directives dropped); a failed JSON-patch `test` answers 422 (kopf's optimistic concurrency),
  a stale `metadata.resourceVersion` in a merge patch answers 409; the `status` subresource only
  changes `status`, the main endpoint never does;
- watches that honour `?resourceVersion` (replaying a bounded event log, 410 when it is too old),
  `labelSelector`, `fieldSelector` (metadata.name / metadata.namespace) and `timeoutSeconds`;
  lists with label selectors and a real list resourceVersion;
- the built-in resources that kopf and the operator use (namespaces, events, services,
  configmaps, secrets, pods, deployments, jobs, pod disruption budgets, CRDs, kopf peerings), declared for
  discovery;
- CRDs that register their resource when created (so `kubectl apply -f crds/` works) and whose
  OpenAPI schema (JSON schema draft 4) and CEL rules (`x-kubernetes-validations`, evaluated with
  cel-python) reject invalid custom resources with 422 like a real server; server-side printer
  columns (`kubectl get ees` asks for a Table);
- a garbage-collector stand-in (`_collect_garbage`): when an object goes, objects whose
  ownerReferences name its uid are deleted too (background cascading). A real cluster's GC does
  this; the operator never deletes its children itself.

The object-level rules it applies (error statuses, label and field selectors, merge patches) are
in `kubeobjects.py`.

What it does not have, on purpose: PUT (replace), the scale subresource, admission webhooks,
controllers (Deployments get their status from the local pod runner, not from a controller).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import rendering

from exitplan.api.manifest import Manifest
from exitplan.devcluster import paths, tables
from exitplan.devcluster import schema as devschema
from exitplan.devcluster.kubeobjects import (
    api_error,
    field_match,
    labels_match,
    merge_patch,
    now,
    parse_label_selector,
    strip_directives,
)

# (group/version/plural, kind, namespaced, short names, subresources)
BUILTINS: list[tuple[str, str, bool, list[str], list[str]]] = [
    ("v1/namespaces", "Namespace", False, ["ns"], ["status"]),
    ("v1/events", "Event", True, ["ev"], []),
    ("v1/services", "Service", True, ["svc"], ["status"]),
    ("v1/configmaps", "ConfigMap", True, ["cm"], []),
    ("v1/secrets", "Secret", True, [], []),
    ("v1/pods", "Pod", True, ["po"], ["status"]),
    ("v1/endpoints", "Endpoints", True, ["ep"], []),
    ("apps/v1/deployments", "Deployment", True, ["deploy"], ["status"]),
    ("batch/v1/jobs", "Job", True, [], ["status"]),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ["pdb"], ["status"]),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, ["netpol"], []),  # stored, not enforced
    (
        "apiextensions.k8s.io/v1/customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ["crd", "crds"],
        ["status"],
    ),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False, [], ["status"]),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True, [], ["status"]),
]
VERBS = {"get", "list", "watch", "create", "patch", "delete"}
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
EVENTS = kmock.resource("v1/events")
PROTOBUF = "application/vnd.kubernetes.protobuf"
PROTOBUF_REFUSED = (
    f"this emulated API server reads JSON only, not {PROTOBUF} (what `kubectl create` sends for built-in "
    "kinds): write the object as YAML and `kubectl apply -f` it"
)
EVENT_LOG = 4096
"""Watch events kept per resource for `?resourceVersion` replays; older ones answer 410 Gone."""
MAX_EVENTS_STORED = 2000
"""Core Events kept (oldest dropped), as a real server's TTL would."""
ObjectKey = tuple[kmock.resource, str | None, str]
"""An object in the store: (resource, namespace or None when cluster-scoped, name)."""
REQUEST_HISTORY = 4
"""Served requests kept for kmock's DSL (between REQUEST_HISTORY and twice that). kmock finds the
reaction for a request by scanning its whole request history through each reaction's filters, so
an unbounded history makes every request cost more than the one before: ~90 ms of CPU per request
on average over the first 2,000, and the 200-service benchmark (bench/operator_scale.py) never
finishes; with this one ~1 ms. Filters (`api[criteria] << 500`) see each request as before;
request slices (`api[...][:n]`) and request counts see the recent ones only."""


@attrs.define(kw_only=True)
class DevKubeAPI(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the metadata, patch, watch and discovery semantics that
    kopf, kubectl and the exitplan operator rely on (see the module docstring)."""

    _rv: int = attrs.field(default=0, init=False)
    _log: dict[kmock.resource, collections.deque[tuple[int, Manifest]]] = attrs.field(
        factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=EVENT_LOG)), init=False
    )
    _first_rv: dict[Any, int] = attrs.field(factory=dict, init=False)
    _validators: dict[Any, devschema.Validator] = attrs.field(factory=dict, init=False)
    _columns: dict[Any, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    _pending: list[tuple[Any, Manifest]] = attrs.field(factory=list, init=False)
    _events: collections.deque[tuple[ObjectKey, str]] = attrs.field(factory=collections.deque, init=False)
    """The core Events created, oldest first, with their uids (what `_trim_events` drops from)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        paths.install()  # `/api/v1/namespaces[/NAME]` name the namespaces resource (kubectl get ns)
        for key, kind, namespaced, short, subresources in BUILTINS:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=VERBS,
                shortnames=short,
                subresources=subresources,
            )
        for name in ("default", "kube-system"):
            self.put_object("v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # ------------------------------------------------------------ direct access (tests, runner)

    def put_object(self, resource: str | kmock.resource, body: Manifest) -> Manifest:
        """Store an object as if created over HTTP (synchronously; no watch event for a live
        stream is lost: the event goes to the log and, when the loop runs, to the bus)."""
        res = resource if isinstance(resource, kmock.resource) else kmock.resource(resource)
        return self._create(res, body.get("metadata", {}).get("namespace"), copy.deepcopy(body), notify=False)

    def get_object(self, resource: str, namespace: str | None, name: str) -> Manifest | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def list_objects(self, resource: str, namespace: str | None = None, selector: str = "") -> list[Manifest]:
        res = kmock.resource(resource)
        terms = parse_label_selector(selector)
        return [
            copy.deepcopy(o)
            for o in self._live(res, namespace)
            if labels_match(o.get("metadata", {}).get("labels") or {}, terms)
        ]

    # ------------------------------------------------------------ helpers

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _namespaced(self, res: kmock.resource) -> bool:
        return bool(res in self.resources and self.resources[res].namespaced)

    def _known(self, res: kmock.resource | None) -> kmock.resource:
        if res is None or res not in self.resources:
            raise api_error(404, "NotFound", f"the server could not find the requested resource {res}")
        return res

    def _existing(self, res: kmock.resource, namespace: str | None, name: str | None) -> ObjectKey:
        """The key of a live object, or 404 NotFound."""
        key = (res, namespace if self._namespaced(res) else None, name or "")
        if name is None or key not in self._objects or self._objects[key].deleted:
            raise api_error(404, "NotFound", f'{res.plural} "{name}" not found')
        return key

    def _live(self, res: kmock.resource, namespace: str | None) -> list[Manifest]:
        return [
            obj.raw
            for (r, ns, _), obj in self._objects.items()
            if r == res and not obj.deleted and (namespace is None or ns == namespace)
        ]

    def _record(self, res: kmock.resource, kind: str, obj: Manifest, notify: bool = True) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        rv = int(obj["metadata"]["resourceVersion"])
        self._log[res].append((rv, event))
        self._first_rv.setdefault(res, rv)
        if len(self._log[res]) == EVENT_LOG:
            self._first_rv[res] = self._log[res][0][0]
        if notify:
            self._pending.append((res, event))

    async def _flush(self) -> None:
        events, self._pending[:] = list(self._pending), []
        for res, event in events:
            await self._buses[res].put(event)

    def _store(self, key: ObjectKey, body: Manifest) -> None:
        if key in self._objects:
            self._objects[key].history.append(body)
            del self._objects[key].history[:-3]  # bounded memory: keep the last versions only
        else:
            self._objects[key] = body

    def _validate(self, res: kmock.resource, body: Manifest) -> None:
        validator = self._validators.get(res)
        if validator is not None:
            problems = validator.problems(body)
            if problems:
                kind = body.get("kind", res.plural)
                name = body.get("metadata", {}).get("name", "")
                raise api_error(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(problems))

    def _default(self, res: kmock.resource, body: Manifest) -> None:
        validator = self._validators.get(res)
        if validator is not None:
            devschema.apply_defaults(body, validator.schema)

    # ------------------------------------------------------------ mutations

    def _create(self, res: kmock.resource, namespace: str | None, body: Manifest, notify: bool = True) -> Manifest:
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "the body of a create must be a JSON object")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise api_error(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        namespace = (namespace or meta.get("namespace") or "default") if self._namespaced(res) else None
        if namespace is not None and res != kmock.resource("v1/namespaces"):
            meta["namespace"] = namespace
        key = (res, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise api_error(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        self._validate(res, body)
        self._default(res, body)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1, creationTimestamp=now())
        meta.pop("deletionTimestamp", None)
        if res == CRDS:
            self._register_crd(body)
        self._store(key, body)
        self._record(res, "ADDED", body, notify)
        if res == EVENTS:
            self._events.append((key, meta["uid"]))
            self._trim_events()
        return body

    def _patch(self, request: rendering.Request) -> Manifest:
        res = self._known(request.resource)
        key = self._existing(res, request.namespace, request.name)
        old: Manifest = self._objects[key].raw
        new: Manifest
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        data = request.data
        status_only = request.subresource == "status"
        has_status = "status" in self.resources[res].subresources
        try:
            if ctype == "application/json-patch+json":
                if not isinstance(data, list):
                    raise api_error(400, "BadRequest", "a JSON patch must be a list of operations")
                new = jsonpatch.apply_patch(copy.deepcopy(old), data)
            else:
                if not isinstance(data, dict):
                    raise api_error(400, "BadRequest", f"a {ctype or 'merge'} patch must be a JSON object")
                data = strip_directives(data)
                want_rv = (data.get("metadata") or {}).get("resourceVersion")
                if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                    raise api_error(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on {res.plural} "{request.name}": '
                        "the object has been modified; please apply your changes to the latest version",
                    )
                new = merge_patch(old, data)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict, jsonpatch.InvalidJsonPatch) as err:
            raise api_error(422, "Invalid", f"the JSON patch does not apply: {err}") from err
        if status_only:  # the status subresource changes only the status
            new = (
                {**old, "status": new.get("status")}
                if "status" in new
                else {k: v for k, v in old.items() if k != "status"}
            )
        elif has_status:  # ... and the main endpoint never changes it
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "name", "namespace", "creationTimestamp", "generation", "deletionTimestamp"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
        if not old["metadata"].get("deletionTimestamp"):
            meta.pop("deletionTimestamp", None)
        self._validate(res, new)
        self._default(res, new)
        if _spec_part(new) != _spec_part(old):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        if new == old:
            return old  # a no-op patch does not bump resourceVersion (nor wake watchers)
        meta["resourceVersion"] = self._next_rv()
        if res == CRDS:
            self._register_crd(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._store(key, new)
            self._remove(res, key)
            return new
        self._store(key, new)
        self._record(res, "MODIFIED", new)
        return new

    def _delete(self, res: kmock.resource, namespace: str | None, name: str | None) -> Manifest:
        key = self._existing(res, namespace, name)
        obj = copy.deepcopy(self._objects[key].raw)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                meta["resourceVersion"] = self._next_rv()
                self._store(key, obj)
                self._record(res, "MODIFIED", obj)
            return obj
        self._remove(res, key)
        return obj

    def _remove(self, res: kmock.resource, key: ObjectKey) -> None:
        obj = copy.deepcopy(self._objects[key].raw)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key].delete()
        self._record(res, "DELETED", obj)
        if res == CRDS:
            self._unregister_crd(obj)
        self._collect_garbage(obj["metadata"].get("uid"))

    def _collect_garbage(self, owner_uid: str | None) -> None:
        """GC stand-in: delete every object owned (ownerReferences) by a deleted uid, recursively.
        A real cluster's garbage collector does this in the background; kmock has none."""
        if not owner_uid:
            return
        for (res, ns, name), obj in list(self._objects.items()):
            if obj.deleted:
                continue
            owners = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(o.get("uid") == owner_uid for o in owners):
                self._delete(res, ns, name)

    def _trim_events(self) -> None:
        """Drop the oldest Events past MAX_EVENTS_STORED (in the order created; one deleted or created again
        under its name meanwhile is left alone). A queue of its own: every Event's create scanned the whole
        store before, which at 200 services' events a period was a core of this server's time."""
        while len(self._events) > MAX_EVENTS_STORED:
            key, uid = self._events.popleft()
            obj = self._objects[key] if key in self._objects else None
            if obj is not None and not obj.deleted and obj.raw["metadata"].get("uid") == uid:
                del self._objects[key]

    # ------------------------------------------------------------ CRDs

    def _register_crd(self, crd: Manifest) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            res = kmock.resource(spec.get("group", ""), version["name"], names.get("plural"))
            self.resources[res] = kmock.ResourceInfo(
                kind=names.get("kind"),
                singular=names.get("singular") or names.get("kind", "").lower(),
                namespaced=spec.get("scope") == "Namespaced",
                verbs=VERBS,
                shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                subresources=list(version.get("subresources", {})),
            )
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if schema:
                self._validators[res] = devschema.Validator(schema)
            self._columns[res] = version.get("additionalPrinterColumns", [])

    def _unregister_crd(self, crd: Manifest) -> None:
        spec = crd.get("spec", {})
        for version in spec.get("versions", []):
            res = kmock.resource(spec.get("group", ""), version["name"], spec.get("names", {}).get("plural"))
            self.resources.pop(res, None)
            self._validators.pop(res, None)
            for key, obj in list(self._objects.items()):  # a CRD takes its objects with it
                if key[0] == res and not obj.deleted:
                    self._remove(res, key)

    # ------------------------------------------------------------ serving (kmock fallbacks)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator's own mutation step: ours happens in the _serve_* fallbacks,
        # so a reaction a test injects (e.g. `api['patch', kmock.resource(...)] << 500`)
        # intercepts a request *instead of* it, the way a failing server would.
        if len(self._requests) > 2 * REQUEST_HISTORY:  # kept short: see REQUEST_HISTORY
            del self._requests[:-REQUEST_HISTORY]
            for payload in self._payloads:
                del payload._requests[:-REQUEST_HISTORY]
        if request.headers.get("Content-Type", "").startswith(PROTOBUF) and request.body:
            # kubectl sends built-in kinds as protobuf; 415 makes client-go send them again as JSON
            raise api_error(415, "UnsupportedMediaType", PROTOBUF_REFUSED)
        return await kmock.RawHandler._handle(self, request)

    async def _serve_create(self, request: rendering.Request) -> rendering.Response:
        res = self._known(request.resource)
        async with self._lock:
            obj = self._create(res, request.namespace, copy.deepcopy(request.data))
            await self._flush()
        return rendering.Response(status=201, payload=copy.deepcopy(obj))

    async def _serve_update(self, request: rendering.Request) -> Manifest:
        async with self._lock:
            obj = self._patch(request)
            await self._flush()
        return copy.deepcopy(obj)

    async def _serve_delete(self, request: rendering.Request) -> Manifest:
        res = self._known(request.resource)
        async with self._lock:
            obj = self._delete(res, request.namespace, request.name)
            await self._flush()
        return obj

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        res = self._known(request.resource)
        key = self._existing(res, request.namespace, request.name)
        obj = copy.deepcopy(self._objects[key].raw)
        return self._table(res, [obj]) if self._wants_table(request) else obj

    async def _serve_list(self, request: rendering.Request) -> Any:
        res = self._known(request.resource)
        terms = parse_label_selector(request.params.get("labelSelector", ""))
        fields = request.params.get("fieldSelector", "")
        items = [
            copy.deepcopy(o)
            for o in self._live(res, request.namespace)
            if labels_match(o.get("metadata", {}).get("labels") or {}, terms) and field_match(o, fields)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        if self._wants_table(request):
            return self._table(res, items)
        info = self.resources[res]
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        return {
            "apiVersion": api_version,
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _serve_watch(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        # JSON, as a real server labels a watch stream (kmock's default, octet-stream, stops kubectl's
        # watches: "no stream serializers registered for application/octet-stream")
        return rendering.Response(headers={"Content-Type": "application/json"}, payload=self._watch(request))

    async def _watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""
        res = self._known(request.resource)
        terms = parse_label_selector(request.params.get("labelSelector", ""))
        fields = request.params.get("fieldSelector", "")
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        bus = self._buses[res]
        async with self._lock:
            mark = await bus.mark()
            if since and since != "0":
                first = self._first_rv.get(res, 0)
                if len(self._log[res]) == EVENT_LOG and int(since) < first:
                    backlog = [
                        {
                            "type": "ERROR",
                            "object": {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "code": 410,
                                "reason": "Expired",
                                "message": f"too old resource version: {since}",
                            },
                        }
                    ]
                else:
                    backlog = [e for rv, e in self._log[res] if rv > int(since)]
            else:
                backlog = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self._live(res, request.namespace)]

        def wanted(event: Manifest) -> bool:
            obj = event.get("object", {})
            if event.get("type") == "ERROR":
                return True
            meta = obj.get("metadata", {})
            return (
                (request.namespace is None or meta.get("namespace") == request.namespace)
                and labels_match(meta.get("labels") or {}, terms)
                and field_match(obj, fields)
            )

        try:
            for event in backlog:
                if wanted(event):
                    yield event
                if event["type"] == "ERROR":
                    return
            stream = aiter(bus.stream(since=mark))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    event = await asyncio.wait_for(anext(stream), remaining)
                except TimeoutError:
                    return
                if wanted(event):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        listing = await super()._serve_version(request)
        if not isinstance(listing, dict):  # kmock's discovery document is a JSON object
            return listing
        if listing.get("groupVersion", "").startswith("/"):  # kmock writes "/v1" for the core group
            listing["groupVersion"] = listing["groupVersion"][1:]
        for entry in listing.get("resources", []):  # subresources have no short names of their own
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch"])
        return listing

    # ------------------------------------------------------------ tables (kubectl get)

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    def _table(self, res: kmock.resource, items: list[Manifest]) -> Manifest:
        return tables.table(res.plural or "", self._columns.get(res), items, str(self._rv))


def _spec_part(obj: Manifest) -> Manifest:
    """What a change of bumps `metadata.generation`: everything but the metadata and the status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


class ApiServer:
    """Serves a DevKubeAPI over HTTP on localhost (aiohttp's low-level server)."""

    def __init__(self, api: DevKubeAPI | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.api = api or DevKubeAPI()
        self.host, self.port = host, port
        self._runner: aiohttp.web.ServerRunner | None = None

    @property
    def url(self) -> str:
        reach = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{reach}:{self.port}"

    async def __aenter__(self) -> ApiServer:
        await self.api.__aenter__()
        server = aiohttp.web.Server(self.api)
        self._runner = aiohttp.web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=0.5)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.api.__aexit__(None, None, None)

    def kubeconfig(self, namespace: str = "default") -> str:
        """A kubeconfig (YAML text) for kubectl and the operator."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "exitplan-dev",
                "clusters": [{"name": "exitplan-dev", "cluster": {"server": self.url}}],
                "users": [{"name": "exitplan-dev", "user": {"token": "exitplan-dev"}}],
                "contexts": [
                    {
                        "name": "exitplan-dev",
                        "context": {"cluster": "exitplan-dev", "user": "exitplan-dev", "namespace": namespace},
                    }
                ],
            },
            indent=2,
        )
