"""kopf's diff-base built without copying the status (operator/essence.py): the same essence as kopf's own
storage builds, for bodies with a status, managed fields, owners, kopf's and another operator's annotations, and
handlers that watch the spec, a status field or a metadata field; and the status is never copied."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from exitplan.operator.essence import LeanDiffBaseStorage


class NoCopy(dict[str, Any]):
    """A status part that fails when copied: the lean build must not copy the status."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise AssertionError("the status was deep-copied")


def body(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {
            "name": "minilm",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"team": "search"},
            "annotations": {
                "exitplan.io/last-handled-configuration": '{"spec":{"slo":{"latencyMs":50}}}\n',
                "exitplan.io/kopf-managed": "yes",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "note": "kept",
            },
            "ownerReferences": [{"kind": "Team", "name": "search", "uid": "t-1", "apiVersion": "v1"}],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
            "finalizers": ["exitplan.io/cleanup"],
        },
        "spec": {"slo": {"latencyMs": 50}, "pools": [{"name": "a100", "maxReplicas": 4}]},
        "status": status if status is not None else {"phase": "Ready", "plan": {"cells": [{"split": 0}]}},
    }


@pytest.mark.parametrize(
    "extra",
    [None, ["spec"], [("spec", "slo")], ["status.phase"], [["status", "plan"]], ["metadata.finalizers"]],
)
def test_the_essence_is_kopfs_own(extra: Any) -> None:
    lean = LeanDiffBaseStorage(prefix="exitplan.io")
    stock = kopf.AnnotationsDiffBaseStorage(prefix="exitplan.io")
    raw = body()
    expected = stock.build(body=kopf.Body(copy.deepcopy(raw)), extra_fields=extra)
    got = lean.build(body=kopf.Body(raw), extra_fields=extra)
    assert got == expected
    assert raw == body()  # the body is left as it was


def test_the_status_is_not_copied_unless_a_handler_watches_it() -> None:
    lean = LeanDiffBaseStorage(prefix="exitplan.io")
    raw = body({"phase": "Ready", "plan": NoCopy(cells=[{"split": 0}])})
    essence = lean.build(body=kopf.Body(raw), extra_fields=["spec"])
    assert "status" not in essence and essence["spec"] == raw["spec"]
    with pytest.raises(AssertionError, match="deep-copied"):  # kopf's own build copies it (and a watcher of it must)
        lean.build(body=kopf.Body(raw), extra_fields=["status.plan"])
