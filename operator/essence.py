"""kopf's diff-base (the "essence" of an object it compares with the last handled one), built without copying
what it throws away.

kopf builds an essence on every watch event of an EarlyExitService: a deep copy of the whole body, from which
it then deletes the status and all metadata but labels and annotations. The status is most of the body (the plan's
cells, conditions, the drift figures), and every status write the drift loop makes comes back as a watch event:
at 200 services that copy was about half of kopf's processing of an event (~1 ms each, 70 a period;
bench/operator_scale.py --cpu-profile). `LeanDiffBaseStorage` hands kopf's own build a view of the body without
the status and with only the metadata kopf keeps, so the essence is the same and the copy is of the spec alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf

KEPT_METADATA = ("labels", "annotations", "ownerReferences")
"""The metadata kopf's build reads: the labels and annotations it keeps, and the owners its storage keys use."""


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf.AnnotationsDiffBaseStorage whose essence is built from the body less what the build deletes."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        fields = list(extra_fields or [])
        if any(_top(f) in ("status", "metadata") for f in fields):
            return super().build(body=body, extra_fields=fields)  # a handler watches a field the view leaves out
        meta = body.get("metadata") or {}
        view: dict[str, Any] = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        view["metadata"] = {k: meta[k] for k in KEPT_METADATA if k in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, view)), extra_fields=fields)


def _top(field: kopf.FieldSpec) -> str:
    """The top-level key a handler's field names (kopf takes "a.b", ("a", "b") or ["a", "b"])."""
    parts = field.split(".") if isinstance(field, str) else list(field or [])
    return str(parts[0]) if parts else ""
