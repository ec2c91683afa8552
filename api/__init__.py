"""exitplan's contracts: custom resource models, the bundle manifest and the Plan (pydantic only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from exitplan.api.resources import KINDS, Resource


class SpecError(ValueError):
    """A resource document that does not validate; the message names the document and field."""


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (`... at line 3, column 11`)."""
    problem = getattr(err, "problem", None) or str(err)
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def validation_problems(err: ValidationError) -> str:
    """A pydantic error in one line: `field.path: message` per problem."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}" for e in err.errors())


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
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {yaml_problem(err)}") from err
    except OSError as err:
        raise SpecError(f"{path}: cannot read: {err.strerror or err}") from err
    return [parse_resource(d, f"{path}[{i}]") for i, d in enumerate(docs)]
