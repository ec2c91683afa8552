"""Kubernetes API semantics on plain objects, for the emulated API server (`apiserver.py`): error
statuses, label and field selectors, and the patch formats (JSON merge patch, strategic merge patch
read as a merge patch).
"""

from __future__ import annotations

import copy
import datetime as dt
import re
from typing import Any

import kmock

from exitplan.api.manifest import Manifest


def now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={"causes": []})


def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """`a=b,c!=d,e,!f,g in (x,y),h notin (z)` -> [(key, op, values)]."""
    terms: list[tuple[str, str, tuple[str, ...]]] = []
    for part in re.split(r",(?![^()]*\))", text.strip()):
        part = part.strip()
        if not part:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", part):
            terms.append((m[1], m[2], tuple(v.strip() for v in m[3].split(","))))
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|!=|=)\s*([\w./-]*)", part):
            terms.append((m[1], "!=" if m[2] == "!=" else "=", (m[3],)))
        elif m := re.fullmatch(r"(!?)([\w./-]+)", part):
            terms.append((m[2], "!" if m[1] else "exists", ()))
        else:
            raise api_error(400, "BadRequest", f"unable to parse label selector term {part!r}")
    return terms


def labels_match(labels: dict[str, str], terms: list[tuple[str, str, tuple[str, ...]]]) -> bool:
    for key, op, values in terms:
        have = labels.get(key)
        if op == "exists":  # (an existence term has no values: the others' values[0] would not exist)
            ok = key in labels
        elif op == "!":
            ok = key not in labels
        else:
            ok = {
                "=": have == values[0] if values else False,
                "!=": have != values[0] if values else True,
                "in": have in values,
                "notin": have not in values,
            }[op]
        if not ok:
            return False
    return True


def field_value(obj: Manifest, key: str) -> str:
    """A field selector's value of an object: the dotted path's value as text, '' when absent (as a
    real server compares absent fields, e.g. an Event's `involvedObject.fieldPath`)."""
    value: Any = obj
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None or isinstance(value, (dict, list)) else str(value)


def field_match(obj: Manifest, selector: str) -> bool:
    """`metadata.name=x,involvedObject.kind!=Pod,...`: any dotted field path (Events are selected by
    `involvedObject.*`, which `kubectl describe` asks for)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        negate = key.endswith("!")
        key = key.rstrip("!=")
        if (field_value(obj, key) == value.lstrip("=")) == negate:
            return False
    return True


def strip_directives(patch: Any) -> Any:
    """A strategic merge patch as a JSON merge patch: `$patch`, `$setElementOrder/...` dropped."""
    if isinstance(patch, dict):
        return {k: strip_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [strip_directives(v) for v in patch]
    return patch


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
