"""exitplan's contracts: custom resource models, the bundle manifest and the Plan (pydantic only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from exitplan.api.resources import KINDS, Resource


class SpecError(ValueError):
    """A resource document that does not validate; the message names the document and field."""


def parse_resource(doc: dict[str, Any], source: str = "<input>") -> Resource:
    """Validate one resource document by its `kind`."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in KINDS:
        raise SpecError(f"{source}: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as err:
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise SpecError(f"{source}: invalid {kind}: {fields}") from err


def load_resources(path: str | Path) -> list[Resource]:
    """All exitplan resources in a (multi-document) YAML file, validated."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"{path}: cannot read YAML: {err}") from err
    return [parse_resource(d, f"{path}[{i}]") for i, d in enumerate(docs)]
