"""The CRDs in crds/ are generated from the typed models, are structural, and reject what the
pydantic models reject (OpenAPI ranges/enums/required + CEL rules, checked by the same validator
the emulated API server uses)."""

from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import ValidationError

from exitplan.api.resources import KINDS as MODELS
from exitplan.devcluster.schema import Validator
from exitplan.operator import crdgen


def test_generated_crds_are_up_to_date(tmp_path):
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    for name, text in crdgen.render_all().items():
        assert (crdgen.CRD_DIR / name).read_text() == text, (
            f"crds/{name} is stale: run python -m exitplan.operator.crdgen"
        )
    assert crdgen.main(["--check"]) == 0


def _walk(schema, path="$"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", sorted(crdgen.KINDS))
def test_crds_are_structural(kind):
    crd = yaml.safe_load((crdgen.CRD_DIR / f"{crdgen.KINDS[kind].plural}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    for path, node in _walk(version["schema"]["openAPIV3Schema"]):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert "type" in node, f"{path} has no type (not structural)"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
    assert crd["spec"]["names"]["shortNames"] == crdgen.KINDS[kind].short


def test_ees_crd_has_status_subresource_printer_columns_and_descriptions():
    crd = crdgen.build_crd("EarlyExitService")
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Phase",
        "Ready",
        "Goodput",
        "Measured",
        "P99-ms",
        "Exits",
        "Splits",
        "Cost/h",
        "Reason",
        "Age",
    ]
    assert columns["Ready"]["jsonPath"] == ".status.ready"  # worker replicas ready / planned
    assert columns["Measured"]["jsonPath"] == ".status.drift.goodputRps"  # next to the planned goodput
    assert columns["Reason"]["jsonPath"] == ".status.reason"
    assert [n for n, c in columns.items() if c.get("priority")] == ["Splits", "Cost/h"]  # -o wide
    props = version["schema"]["openAPIV3Schema"]["properties"]
    slo = props["spec"]["properties"]["slo"]
    assert slo["required"] == ["latencyMs"] and "p99" in slo["properties"]["latencyMs"]["description"]
    assert slo["properties"]["latencyMs"]["exclusiveMinimum"] is True
    mode = props["spec"]["properties"]["planner"]["properties"]["mode"]
    assert mode["enum"] == ["active", "advisory"]
    cond = props["status"]["properties"]["conditions"]["items"]
    assert cond["properties"]["type"]["enum"] == [
        "Planned",
        "Ready",
        "Progressing",
        "Degraded",
        "PlanInfeasible",
        "ProfilingFailed",
        "PlanAccurate",
    ]
    assert crdgen.build_crd("GPUPool")["spec"]["scope"] == "Cluster"
    assert crdgen.build_crd("ModelProfile")["spec"]["scope"] == "Namespaced"


VALID = {
    "EarlyExitService": {
        "model": {"name": "minilm", "bundle": "/b"},
        "slo": {"latencyMs": 100, "slackMs": 5},
        "workload": {"lengthBuckets": [32, 64, 128]},
        "pools": [{"name": "a"}, {"name": "b", "maxGpus": 2}],
        "planner": {"mode": "advisory", "drift": {"lengthScore": 0.2}},
    },
    "GPUPool": {"capacity": 4, "nodeSelector": {"pool": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    "ModelProfile": {
        "model": "m",
        "pool": "a",
        "batchSizes": [1, 4],
        "seqLens": [32],
        "blocks": [{"name": "b0", "latencyMs": [[1.0, 2.0]]}, {"name": "b1", "latencyMs": [[1, 2]]}],
        "ramps": [{"name": "r0", "afterBlock": 0, "latencyMs": [[0.1, 0.2]]}],
        "survival": [0.5],
    },
}

# (kind, dotted path, value): each makes the spec invalid for pydantic; the CRD must reject it too.
INVALID = [
    ("EarlyExitService", "slo.latencyMs", 0),
    ("EarlyExitService", "slo.latencyMs", -5),
    ("EarlyExitService", "slo.slackMs", 100),  # CEL: slack below latency
    ("EarlyExitService", "slo.slackMs", 250),
    ("EarlyExitService", "workload.lengthBuckets", [64, 32]),  # CEL: strictly increasing
    ("EarlyExitService", "workload.lengthBuckets", [32, 32]),
    ("EarlyExitService", "pools", [{"name": "a"}, {"name": "a"}]),  # CEL: unique pools
    ("EarlyExitService", "pools", []),
    ("EarlyExitService", "planner.mode", "sometimes"),
    ("EarlyExitService", "planner.periodSeconds", 1),
    ("EarlyExitService", "accuracy.maxDrop", 1.0),
    ("EarlyExitService", "model.name", "Not_DNS"),
    ("EarlyExitService", "model.bundle", None),  # required
    ("GPUPool", "capacity", -1),
    ("GPUPool", "capacity", None),
    ("GPUPool", "tolerations", [{"operator": "Sometimes"}]),
    ("GPUPool", "linkBandwidthGbps", 0),
    ("ModelProfile", "batchSizes", []),
    ("ModelProfile", "survival", [1.5]),
]


def _set(doc, dotted, value):
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return doc


def _validator(kind):
    schema = crdgen.build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return Validator(schema)


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_specs_pass_both(kind):
    MODELS[kind].model_validate({"spec": VALID[kind], "metadata": {"name": "x"}})
    assert _validator(kind).problems({"apiVersion": "exitplan.io/v1alpha1", "kind": kind, "spec": VALID[kind]}) == []


@pytest.mark.parametrize("kind,field,value", INVALID)
def test_invalid_specs_fail_both(kind, field, value):
    spec = _set(VALID[kind], field, value)
    with pytest.raises(ValidationError):
        MODELS[kind].model_validate({"spec": spec})
    problems = _validator(kind).problems({"apiVersion": "exitplan.io/v1alpha1", "kind": kind, "spec": spec})
    assert problems, f"the CRD accepts {kind} with {field}={value!r}, pydantic rejects it"


def test_cel_rules_of_the_profile_shape():
    bad_rows = _set(VALID["ModelProfile"], "blocks", [{"name": "b0", "latencyMs": [[1.0]]}])
    assert any("seqLens x batchSizes" in p for p in _validator("ModelProfile").problems({"spec": bad_rows}))
    bad_ramp = _set(VALID["ModelProfile"], "ramps", [{"name": "r", "afterBlock": 7, "latencyMs": [[0.1, 0.2]]}])
    assert any("existing block" in p for p in _validator("ModelProfile").problems({"spec": bad_ramp}))
    bad_surv = _set(VALID["ModelProfile"], "survival", [0.5, 0.4])
    assert any("one entry per ramp" in p for p in _validator("ModelProfile").problems({"spec": bad_surv}))
