"""Generate the CRDs in `crds/` from the typed models (api/resources.py, operator/status.py).

    python -m exitplan.operator.crdgen            # (re)write crds/*.yaml
    python -m exitplan.operator.crdgen --check    # exit 1 when crds/ differs from the models

The OpenAPI v3 schema comes from pydantic's JSON schema, made structural the way Kubernetes
wants it: `$ref`s inlined, optional fields without `null` branches, `exclusiveMinimum` as the
OpenAPI 3.0 boolean, no `additionalProperties: false` (Kubernetes prunes unknown fields instead),
descriptions from the docstrings written under each field. Cross-field checks that a schema
cannot say are CEL rules (`x-kubernetes-validations`) listed in `CEL_RULES`, each mirroring a
pydantic validator of the same model (tests/test_crds.py checks that both agree).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from exitplan.api import resources as res
from exitplan.operator.status import ServiceStatus

CRD_DIR = Path(__file__).resolve().parent.parent / "crds"

# Cross-field rules, keyed by the model they sit on. Each mirrors a pydantic validator.
CEL_RULES: dict[type[BaseModel], list[dict[str, str]]] = {
    res.SLO: [
        {
            "rule": "!has(self.slackMs) || self.slackMs < self.latencyMs",
            "message": "slo.slackMs must be below slo.latencyMs",
        }
    ],
    res.Workload: [
        {
            "rule": "!has(self.lengthBuckets) || (self.lengthBuckets.isSorted() && "
            "self.lengthBuckets.all(b, self.lengthBuckets.exists_one(c, c == b)))",
            "message": "workload.lengthBuckets must increase strictly",
        }
    ],
    res.ModelRef: [
        {
            "rule": "!self.bundle.contains('://') || self.bundle.matches('^(file|pvc|s3|https?|oci)://')",
            "message": "model.bundle: a path, file://, pvc://, s3://, https://, http:// or oci:// URI",
        },
        {
            "rule": "!self.bundle.matches('^https?://') || has(self.bundleSha256)",
            "message": "model.bundleSha256 is required for an http(s):// bundle",
        },
        {
            "rule": "!has(self.bundleSha256) || self.bundle.matches('^(https?|s3)://[^?]*[.](tar[.]gz|tgz|tar)([?].*)?$')",
            "message": "model.bundleSha256 applies to tarball bundles only",
        },
        {
            "rule": "!has(self.bundleSecret) || self.bundle.startsWith('s3://')",
            "message": "model.bundleSecret applies to s3:// bundles only",
        },
    ],
    res.EarlyExitServiceSpec: [
        {
            "rule": "self.pools.all(p, self.pools.exists_one(q, q.name == p.name))",
            "message": "pools must name each GPUPool once",
        }
    ],
    res.ModelProfileSpec: [
        {
            "rule": "self.blocks.all(b, size(b.latencyMs) == size(self.seqLens) && "
            "b.latencyMs.all(row, size(row) == size(self.batchSizes)))",
            "message": "every block's latencyMs must be seqLens x batchSizes",
        },
        {
            "rule": "!has(self.ramps) || self.ramps.all(r, r.afterBlock < size(self.blocks) && "
            "size(r.latencyMs) == size(self.seqLens))",
            "message": "every ramp must follow an existing block and have seqLens rows of latencyMs",
        },
        {
            "rule": "!has(self.survival) || size(self.survival) == 0 || !has(self.ramps) || "
            "size(self.survival) == size(self.ramps)",
            "message": "survival must have one entry per ramp",
        },
    ],
}

# Caps on the lists that CEL rules iterate: Kubernetes estimates each rule's cost from maxItems
# and refuses a CRD whose rules could cost too much. The typed models have no such caps; these
# are far above any real service (a real profile has ~10 batch sizes and lengths, <100 blocks).
MAX_ITEMS: dict[tuple[type[BaseModel], str], tuple[int, ...]] = {
    (res.EarlyExitServiceSpec, "pools"): (32,),
    (res.Workload, "length_buckets"): (64,),
    (res.ModelProfileSpec, "batch_sizes"): (64,),
    (res.ModelProfileSpec, "seq_lens"): (64,),
    (res.ModelProfileSpec, "blocks"): (512,),
    (res.ModelProfileSpec, "ramps"): (512,),
    (res.ModelProfileSpec, "survival"): (512,),
    (res.BlockProfile, "latency_ms"): (64, 64),
    (res.RampProfile, "latency_ms"): (64, 64),
}


@dataclass(frozen=True)
class Column:
    """A printer column of `kubectl get` (priority 1: only with `-o wide`)."""

    name: str
    type: str
    json_path: str
    priority: int = 0


@dataclass(frozen=True)
class CrdKind:
    """What a kind's CRD says beyond its schema: names, scope, the spec and status models, columns."""

    plural: str
    singular: str
    short: list[str]
    scope: str
    spec: type[BaseModel]
    status: type[BaseModel] | None
    columns: tuple[Column, ...]


POOL_COLUMNS = (
    Column("Capacity", "integer", ".spec.capacity"),
    Column("GPU", "string", ".spec.gpuResource"),
    Column("Cost/h", "number", ".spec.costPerHour"),
)
SERVICE_COLUMNS = (
    # kubectl get ees: what the plan promises next to what was measured, READY as worker replicas
    # ready / planned, REASON the phase's condition reason (status.py with_columns)
    Column("Phase", "string", ".status.phase"),
    Column("Ready", "string", ".status.ready"),
    Column("Goodput", "number", ".status.plan.goodputRps"),
    Column("Measured", "number", ".status.drift.goodputRps"),
    Column("P99-ms", "number", ".status.plan.p99Ms"),
    Column("Exits", "string", ".status.plan.exits"),
    Column("Splits", "integer", ".status.plan.splits", priority=1),
    Column("Cost/h", "number", ".status.plan.costPerHour", priority=1),
    Column("Reason", "string", ".status.reason"),
)
PROFILE_COLUMNS = (
    Column("Model", "string", ".spec.model"),
    Column("Pool", "string", ".spec.pool"),
    Column("Measured-on", "string", ".spec.measuredOn"),
)
KINDS: dict[str, CrdKind] = {
    "GPUPool": CrdKind("gpupools", "gpupool", ["gpool"], "Cluster", res.GPUPoolSpec, None, POOL_COLUMNS),
    "EarlyExitService": CrdKind(
        "earlyexitservices",
        "earlyexitservice",
        ["ees"],
        "Namespaced",
        res.EarlyExitServiceSpec,
        ServiceStatus,
        SERVICE_COLUMNS,
    ),
    "ModelProfile": CrdKind(
        "modelprofiles", "modelprofile", ["mprof"], "Namespaced", res.ModelProfileSpec, None, PROFILE_COLUMNS
    ),
}


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written right under each annotated attribute of a class (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, BaseModel) or not issubclass(klass, BaseModel):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Pydantic JSON schema -> Kubernetes structural OpenAPI v3 schema (recursive)."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        inner = _structural(defs[node["$ref"].split("/")[-1]], defs)
        extra = _structural({k: v for k, v in node.items() if k != "$ref"}, defs)
        return {**inner, **extra}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {node}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        return {**_structural(branches[0], defs), **_structural(rest, defs)}  # Optional[X]: absent, never null
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs") or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue  # Kubernetes prunes unknown fields instead
        if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True  # OpenAPI 3.0 form
        elif key == "properties":
            out[key] = {prop: _structural(schema, defs) for prop, schema in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    _model_attach(schema, model)
    return schema


def _columns(columns: tuple[Column, ...]) -> list[dict[str, Any]]:
    """additionalPrinterColumns of the kind's columns, then Age."""
    cols = []
    for column in columns:
        col: dict[str, Any] = {"name": column.name, "type": column.type, "jsonPath": column.json_path}
        if column.priority:
            col["priority"] = column.priority
        cols.append(col)
    return cols + [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]


def build_crd(kind: str) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind, as a plain dict."""
    info = KINDS[kind]
    props: dict[str, Any] = {"spec": openapi_schema(info.spec)}
    required = ["spec"]
    version: dict[str, Any] = {"name": res.VERSION, "served": True, "storage": True}
    if info.status is not None:
        props["status"] = openapi_schema(info.status)
        version["subresources"] = {"status": {}}
    version["schema"] = {
        "openAPIV3Schema": {
            "type": "object",
            "required": required,
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                **props,
            },
        }
    }
    version["additionalPrinterColumns"] = _columns(info.columns)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{info.plural}.{res.GROUP}"},
        "spec": {
            "group": res.GROUP,
            "scope": info.scope,
            "names": {
                "kind": kind,
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": info.short,
                "categories": ["exitplan"],
            },
            "versions": [version],
        },
    }


def _model_attach(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Attach field descriptions and CEL rules, walking nested models by their annotations."""
    if model in CEL_RULES:
        schema["x-kubernetes-validations"] = CEL_RULES[model]
    props = schema.get("properties", {})
    docs = _field_docs(model)
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in props:
            continue
        if docs.get(name):
            props[key]["description"] = docs[name]
        if (model, name) in MAX_ITEMS:
            node = props[key]
            for cap in MAX_ITEMS[(model, name)]:  # outer list, then the lists inside it
                node["maxItems"] = cap
                node = node.get("items", {})
        for sub in _nested_models(field.annotation):
            target = props[key]
            while target.get("type") in ("array", "object") and "properties" not in target:
                target = target.get("items") or target.get("additionalProperties") or {}
            if "properties" in target:
                _model_attach(target, sub)


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    out: list[type[BaseModel]] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    for arg in typing.get_args(annotation):
        out += _nested_models(arg)
    return out


def render_all() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    out = {}
    for kind, info in KINDS.items():
        crd = build_crd(kind)
        header = f"# Generated by `python -m exitplan.operator.crdgen` from {info.spec.__module__}; do not edit.\n"
        out[f"{info.plural}.yaml"] = header + yaml.safe_dump(crd, sort_keys=False, width=110)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when crds/ is stale")
    parser.add_argument("--out", type=Path, default=CRD_DIR, help="output folder (default: crds/)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale CRDs: {', '.join(stale)}; run `python -m exitplan.operator.crdgen`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
