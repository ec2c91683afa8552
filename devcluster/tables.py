"""Server-side tables (`Accept: application/json;as=Table`), what `kubectl get` prints.

A custom resource's columns are its CRD version's `additionalPrinterColumns`; the built-in kinds get
the columns a real API server gives them (`kubectl get deploy` READY / UP-TO-DATE / AVAILABLE / AGE,
`kubectl get events` LAST SEEN / TYPE / REASON / OBJECT / MESSAGE, ...), computed from the object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.devcluster import schema as devschema

Cell = Callable[[Manifest], Any]


def _get(obj: Manifest, *keys: str, default: Any = None) -> Any:
    value: Any = obj
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            return default
    return value


def _age(obj: Manifest) -> str:
    return devschema.age(_get(obj, "metadata", "creationTimestamp", default=""))


def _name(obj: Manifest) -> str:
    return str(obj["metadata"]["name"])


def _last_seen(event: Manifest) -> str:
    stamp = (
        _get(event, "series", "lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or _get(event, "metadata", "creationTimestamp", default="")
    )
    return devschema.age(stamp)


def _involved(event: Manifest) -> str:
    ref = event.get("involvedObject") or event.get("regarding") or {}
    return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"


def _ready(pod: Manifest) -> str:
    statuses = _get(pod, "status", "containerStatuses", default=[])
    total = len(_get(pod, "spec", "containers", default=[]))
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _restarts(pod: Manifest) -> int:
    return sum(int(s.get("restartCount", 0)) for s in _get(pod, "status", "containerStatuses", default=[]))


def _ports(svc: Manifest) -> str:
    ports = _get(svc, "spec", "ports", default=[])
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _job_status(job: Manifest) -> str:
    for cond in _get(job, "status", "conditions", default=[]):
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return str(cond["type"])
    return "Running"


BUILTIN: dict[str, list[tuple[str, str, Cell]]] = {
    "namespaces": [
        ("Name", "string", _name),
        ("Status", "string", lambda o: _get(o, "status", "phase", default="Active")),
        ("Age", "string", _age),
    ],
    "deployments": [
        ("Name", "string", _name),
        (
            "Ready",
            "string",
            lambda o: f"{_get(o, 'status', 'readyReplicas', default=0)}/{_get(o, 'spec', 'replicas', default=1)}",
        ),
        ("Up-to-date", "integer", lambda o: _get(o, "status", "updatedReplicas", default=0)),
        ("Available", "integer", lambda o: _get(o, "status", "availableReplicas", default=0)),
        ("Age", "string", _age),
    ],
    "events": [
        ("Last Seen", "string", _last_seen),
        ("Type", "string", lambda o: o.get("type", "")),
        ("Reason", "string", lambda o: o.get("reason", "")),
        ("Object", "string", _involved),
        ("Message", "string", lambda o: o.get("message") or o.get("note", "")),
    ],
    "pods": [
        ("Name", "string", _name),
        ("Ready", "string", _ready),
        ("Status", "string", lambda o: _get(o, "status", "phase", default="Pending")),
        ("Restarts", "integer", _restarts),
        ("Age", "string", _age),
    ],
    "services": [
        ("Name", "string", _name),
        ("Type", "string", lambda o: _get(o, "spec", "type", default="ClusterIP")),
        ("Cluster-IP", "string", lambda o: _get(o, "spec", "clusterIP", default="<none>")),
        ("Port(s)", "string", _ports),
        ("Age", "string", _age),
    ],
    "jobs": [
        ("Name", "string", _name),
        ("Status", "string", _job_status),
        (
            "Completions",
            "string",
            lambda o: f"{_get(o, 'status', 'succeeded', default=0)}/{_get(o, 'spec', 'completions', default=1)}",
        ),
        ("Age", "string", _age),
    ],
    "configmaps": [
        ("Name", "string", _name),
        ("Data", "integer", lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {})),
        ("Age", "string", _age),
    ],
    "secrets": [
        ("Name", "string", _name),
        ("Type", "string", lambda o: o.get("type", "Opaque")),
        ("Data", "integer", lambda o: len(o.get("data") or {})),
        ("Age", "string", _age),
    ],
}
"""Columns of the built-in kinds, by plural: (header, type, cell)."""


def _printer_columns(printer: list[dict[str, Any]]) -> list[tuple[str, str, int, Cell]]:
    """A CRD's additionalPrinterColumns as cells, after the name."""

    def cell(col: dict[str, Any]) -> Cell:
        def value(obj: Manifest) -> Any:
            found = devschema.json_path(obj, col["jsonPath"])
            return devschema.age(found) if col.get("type") == "date" and isinstance(found, str) else found

        return value

    columns: list[tuple[str, str, int, Cell]] = [("Name", "string", 0, _name)]
    columns += [(c["name"], c.get("type", "string"), int(c.get("priority", 0)), cell(c)) for c in printer]
    return columns


def table(plural: str, printer: list[dict[str, Any]] | None, items: list[Manifest], rv: str) -> Manifest:
    """The Table of `items` (a list or one object): built-in columns for `plural`, else the CRD's."""
    if plural in BUILTIN and not printer:
        columns: list[tuple[str, str, int, Cell]] = [(name, kind, 0, cell) for name, kind, cell in BUILTIN[plural]]
    else:
        columns = _printer_columns(printer or [])
    definitions = [
        {"name": n, "type": t, "format": "name" if n == "Name" else "", "priority": p} for n, t, p, _ in columns
    ]
    rows = []
    for obj in items:
        partial = {"apiVersion": obj.get("apiVersion"), "kind": "PartialObjectMetadata", "metadata": obj["metadata"]}
        rows.append({"cells": [cell(obj) for _, _, _, cell in columns], "object": partial})
    return {
        "apiVersion": "meta.k8s.io/v1",
        "kind": "Table",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": definitions,
        "rows": rows,
    }
