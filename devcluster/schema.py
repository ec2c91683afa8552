"""What the emulated API server (apiserver.py) checks and prints for custom resources, the way a real
one does: the CRD's OpenAPI v3 schema (JSON schema draft 4 semantics), its CEL rules
(`x-kubernetes-validations`, evaluated with cel-python, numbers typed by the schema as Kubernetes
does), and the simple JSONPaths of printer columns.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.evaluation import CELFunction

from exitplan.api.manifest import Manifest


def _is_sorted(items: Any) -> celtypes.BoolType:
    """Kubernetes' CEL list extension `isSorted()` (cel-python lacks the k8s libraries)."""
    values = list(items)
    return celtypes.BoolType(all(a <= b for a, b in zip(values, values[1:])))


K8S_CEL_FUNCTIONS: dict[str, CELFunction] = {"isSorted": _is_sorted}


def _to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """JSON -> CEL values, with numbers typed by the schema (type: number is always a double)."""
    kind = schema.get("type")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): _to_cel(v, props.get(k, extra)) for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([_to_cel(v, schema.get("items", {})) for v in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, (int, float)):
        if kind == "number" or isinstance(value, float) and kind != "integer":
            return celtypes.DoubleType(float(value))
        return celtypes.IntType(int(value))
    if isinstance(value, str):
        return celtypes.StringType(value)
    return value


class Validator:
    """Checks a custom resource against its CRD version's openAPIV3Schema and CEL rules."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._json = jsonschema.Draft4Validator(schema)
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def _program(self, rule: str) -> Any:
        if rule not in self._programs:
            self._programs[rule] = self._env.program(self._env.compile(rule), functions=K8S_CEL_FUNCTIONS)
        return self._programs[rule]

    def problems(self, body: Manifest) -> list[str]:
        """Messages for every violation, each naming the field path; empty when valid."""
        out = []
        for err in sorted(self._json.iter_errors(body), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in err.absolute_path) or "<root>"
            out.append(f"{path}: {err.message}")
        if not out:  # CEL rules only run on schema-valid objects, as in Kubernetes
            self._walk_cel(body, self.schema, "", out)
        return out

    def _walk_cel(self, value: Any, schema: dict[str, Any], path: str, out: list[str]) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            try:
                ok = self._program(rule["rule"]).evaluate({"self": _to_cel(value, schema)})
            except Exception as err:  # noqa: BLE001 - CEL evaluation errors are validation failures too
                ok = False
                rule = {**rule, "message": f"{rule.get('message', rule['rule'])} ({err})"}
            if not (isinstance(ok, (bool, celtypes.BoolType)) and bool(ok)):
                out.append(f"{path or '<root>'}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    self._walk_cel(value[key], sub, f"{path}.{key}".lstrip("."), out)
        elif isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self._walk_cel(item, schema["items"], f"{path}[{i}]", out)


def apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Fill absent properties that have a schema `default` (Kubernetes' structural defaulting)."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = sub["default"]
            if key in value:
                apply_defaults(value[key], sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(item, schema["items"])


def json_path(obj: Any, path: str) -> Any:
    """Evaluate a printer column's simple JSONPath (`.a.b`, `.a[0].b`, `.a[*].b`)."""
    current: list[Any] = [obj]
    for part in path.strip().lstrip(".").replace("[", ".[").split("."):
        if not part:
            continue
        nxt: list[Any] = []
        for item in current:
            if part == "[*]" and isinstance(item, list):
                nxt.extend(item)
            elif part.startswith("[") and isinstance(item, list):
                idx = int(part[1:-1])
                if -len(item) <= idx < len(item):
                    nxt.append(item[idx])
            elif isinstance(item, dict) and part in item:
                nxt.append(item[part])
        current = nxt
    if not current:
        return None
    return current[0] if len(current) == 1 else ",".join(str(c) for c in current)


def age(timestamp: str) -> str:
    """kubectl's AGE rendering (5s, 3m, 2h, 4d)."""
    try:
        then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return timestamp
    secs = max(0, int((dt.datetime.now(dt.UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"
