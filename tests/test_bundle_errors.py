"""A bundle that does not match its bundle.yaml fails at load with a BundleError naming file and tensor."""

from __future__ import annotations

import shutil

import pytest
import yaml

from exitplan.api.bundle import BundleError
from exitplan.worker_image.bundle_runtime import BundleRuntime

pytestmark = pytest.mark.slow


@pytest.fixture
def digits_copy(digits_bundle, tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(digits_bundle, target)
    return target


def _edit_manifest(bundle, change):
    path = bundle / "bundle.yaml"
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_the_copy_loads(digits_copy):
    assert BundleRuntime(digits_copy).manifest.name == "digits-cnn"


def test_missing_onnx_file_is_named(digits_copy):
    (digits_copy / "blocks" / "block1.onnx").unlink()
    with pytest.raises(BundleError, match=r"blocks/block1\.onnx.*missing"):
        BundleRuntime(digits_copy)


def test_renamed_tensor_in_bundle_yaml_names_file_and_tensor(digits_copy):
    def rename(doc):
        doc["blocks"][0]["outputs"] = ["features0"]
        doc["blocks"][1]["inputs"] = ["features0"]
        doc["ramps"][0]["inputs"] = ["features0"]

    _edit_manifest(digits_copy, rename)
    with pytest.raises(BundleError, match=r"block0\.onnx.*output tensor 'features0'.*\['hidden0'\]"):
        BundleRuntime(digits_copy)


def test_onnx_file_with_other_tensor_names_names_file_and_tensor(digits_copy):
    shutil.copy(digits_copy / "blocks" / "block2.onnx", digits_copy / "blocks" / "block1.onnx")
    with pytest.raises(BundleError, match=r"block1\.onnx.*input tensor 'hidden0'.*\['hidden1'\]"):
        BundleRuntime(digits_copy)
    # a split that does not hold the bad file still loads
    assert BundleRuntime(digits_copy, first_block=0, last_block=0).last_block == 0


def test_extra_onnx_input_is_named(digits_copy):
    def drop(doc):
        doc["ramps"][1]["inputs"] = ["hidden0", "hidden1"]

    _edit_manifest(digits_copy, drop)
    with pytest.raises(BundleError, match=r"ramp1\.onnx.*input tensor 'hidden0'"):
        BundleRuntime(digits_copy)


def test_tensor_nobody_writes_is_named(digits_copy):
    _edit_manifest(digits_copy, lambda doc: doc["ramps"][0].update(inputs=["hidden7"]))
    with pytest.raises(BundleError, match=r"bundle\.yaml.*ramp 'ramp0' reads tensor 'hidden7'"):
        BundleRuntime(digits_copy)


def test_dtype_mismatch_is_named(digits_copy):
    _edit_manifest(digits_copy, lambda doc: doc["inputs"][0].update(dtype="float16"))
    with pytest.raises(BundleError, match=r"block0\.onnx: input tensor 'x' is float32 in the ONNX file but float16"):
        BundleRuntime(digits_copy)


def test_corrupt_onnx_file_is_named(digits_copy):
    (digits_copy / "ramps" / "head.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(BundleError, match=r"ramps/head\.onnx: ONNX Runtime cannot load this file \(ramp 'head'\)"):
        BundleRuntime(digits_copy)


def test_bad_ranges_and_buckets(digits_copy, minilm_bundle):
    with pytest.raises(BundleError, match=r"block range \[2, 1\]"):
        BundleRuntime(digits_copy, first_block=2, last_block=1)
    with pytest.raises(BundleError, match="no sequence axis"):
        BundleRuntime(digits_copy, buckets=[32])
    with pytest.raises(BundleError, match="bucket 256 is outside 1..128"):
        BundleRuntime(minilm_bundle, buckets=[64, 256])
    with pytest.raises(BundleError, match="no bundle.yaml here"):
        BundleRuntime(digits_copy / "blocks")
