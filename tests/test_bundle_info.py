"""A remote generation bundle's bundle info (operator/bundle_info.py): what `exitplan operator
publish-bundle-info` puts into its ConfigMap, and that planning from the ConfigMap reads it exactly as
planning from the directory does."""

from __future__ import annotations

import json
import shutil

import pytest
from generation_helpers import tiny_decoder_bundle
from typer.testing import CliRunner

from exitplan.api.bundle import BundleError, read_manifest
from exitplan.cli import app
from exitplan.operator import bundle_info
from exitplan.planner.errors import PlannerError
from exitplan.planner.generation import read_measurements

MEASURED = {
    "profile": {"block_ms": [4.0, 4.0, 4.0], "head_ms": {"0": 0.1, "1": 0.1, "2": 0.1}, "decide_share": {"2": 1.0}},
    "thresholds": [{"threshold": 1.0, "disagreement": 0.0, "decide_share": {"2": 1.0}}],
}


@pytest.fixture
def bundle(tmp_path):
    target = tmp_path / "decoder"
    shutil.copytree(tiny_decoder_bundle(), target, ignore=shutil.ignore_patterns("profiles"))
    (target / "profiles").mkdir()
    (target / "profiles" / "generation-gpu-a.json").write_text(json.dumps(MEASURED))
    (target / "profiles" / "notes.txt").write_text("not a measurement")
    return target


def roundtrip(bundle) -> bundle_info.BundleTexts:
    cm = bundle_info.configmap(bundle_info.read_dir(bundle), "ns", "svc-bundle-info", "svc", "uid-1", "key")
    return bundle_info.from_configmap(json.loads(json.dumps(cm)), "s3://b/decoder")


def test_the_configmap_carries_what_the_directory_says(bundle):
    cm = bundle_info.configmap(bundle_info.read_dir(bundle), "ns", "svc-bundle-info", "svc", "uid-1", "key")
    assert set(cm["data"]) == {"bundle.yaml", "generation-gpu-a.json"}  # small texts only, no weights
    assert cm["metadata"]["annotations"] == {bundle_info.A_SOURCE: "key"}
    assert cm["metadata"]["labels"][bundle_info.L_OF] == "svc" and "exitplan.io/service" not in cm["metadata"]["labels"]
    owner = cm["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-1" and owner["kind"] == "EarlyExitService" and "blockOwnerDeletion" not in owner
    texts = roundtrip(bundle)
    assert "s3://b/decoder" in texts.where
    assert bundle_info.manifest_of(texts) == read_manifest(bundle)
    profile, points = bundle_info.measurements_of(texts, "gpu-a")
    assert (profile, points) == read_measurements(bundle / "profiles" / "generation-gpu-a.json")
    assert bundle_info.measurements_of(texts, "gpu-b") == (None, [])


def test_bad_texts_fail_with_the_source_named(bundle):
    texts = roundtrip(bundle)
    broken = bundle_info.BundleTexts(texts.where, "blocks: [", {"gpu-a": "{"})
    with pytest.raises(
        BundleError, match=r"ConfigMap ns/svc-bundle-info \(bundle s3://b/decoder\): bundle.yaml: not valid"
    ):
        bundle_info.manifest_of(broken)
    with pytest.raises(PlannerError, match="generation-gpu-a.json: not a generation measurements file"):
        bundle_info.measurements_of(broken, "gpu-a")
    invalid = bundle_info.BundleTexts(texts.where, "name: x\n")
    with pytest.raises(BundleError, match="invalid manifest"):
        bundle_info.manifest_of(invalid)


def test_more_than_a_configmap_holds_is_refused_clearly(bundle, tmp_path):
    (bundle / "profiles" / "generation-big.json").write_text(" " * bundle_info.MAX_BYTES)
    with pytest.raises(BundleError, match="more than the 1048576 a ConfigMap holds"):
        bundle_info.configmap(bundle_info.read_dir(bundle), "ns", "x")
    result = CliRunner().invoke(
        app,
        ["operator", "publish-bundle-info", str(bundle), "--name", "x", "--kubeconfig", str(tmp_path / "none")],
    )
    assert result.exit_code == 2 and "generation-big.json 1048576 B" in result.output
    assert "keep only the measurements of the pools you serve on" in result.output


def test_a_directory_without_a_bundle_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["operator", "publish-bundle-info", str(tmp_path), "--name", "x"])
    assert result.exit_code == 2 and "no bundle.yaml here" in result.output
