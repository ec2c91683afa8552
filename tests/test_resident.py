"""A batch kept on the device between blocks (worker_image/resident.py): the same answers as the host path,
row for row -- exits at every threshold, the state forwarded to the next split, fp16 bundles too -- here on
the CPU provider (the same IO-bound code a GPU worker runs), and the Gather models it writes as bytes are
valid ONNX."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch
from exitplan.worker_image.resident import ONNX_TYPES, ResidentRange, gather_model


def _same(a, b) -> None:
    assert [(e.row, e.ramp) for e in a.exits] == [(e.row, e.ramp) for e in b.exits]
    for x, y in zip(a.exits, b.exits):
        assert np.array_equal(x.logits, y.logits) and x.confidence == y.confidence
    assert np.array_equal(a.rows, b.rows)
    assert sorted(a.state) == sorted(b.state)
    for name in a.state:
        assert a.state[name].dtype == b.state[name].dtype and np.array_equal(a.state[name], b.state[name])


def _texts(bundle, n: int, bucket: int):
    from exitplan.prepare.measure import load_heldout

    heldout = load_heldout(bundle, read_manifest(bundle))
    ids = [s[:bucket] for s in heldout.ids[:n]]
    return pad_batch(ids, bucket)


@pytest.mark.parametrize("last_block", [2, 5])
def test_minilm_on_the_device_answers_as_on_the_host(minilm_bundle, last_block):
    host = BundleRuntime(minilm_bundle, last_block=last_block, buckets=[32], resident=False)
    device = BundleRuntime(minilm_bundle, last_block=last_block, buckets=[32], resident=True)
    state = _texts(minilm_bundle, 24, 32)
    ramps = [r.name for r in host.manifest.exit_ramps()]
    for limit in (2.0, 0.99, 0.9, 0.6, 0.0):  # none exit ... all exit at the first ramp
        thresholds = {r: limit for r in ramps}
        _same(device.run_range(state, 32, thresholds), host.run_range(state, 32, thresholds))


def test_a_later_split_and_a_cnn_answer_as_on_the_host(minilm_bundle, digits_bundle):
    first = BundleRuntime(minilm_bundle, last_block=2, buckets=[16], resident=False)
    state = first.run_range(_texts(minilm_bundle, 16, 16), 16, {}).state
    host = BundleRuntime(minilm_bundle, first_block=3, buckets=[16], resident=False)
    device = BundleRuntime(minilm_bundle, first_block=3, buckets=[16], resident=True)
    thresholds = {r.name: 0.8 for r in host.manifest.exit_ramps()}
    _same(device.run_range(state, 16, thresholds), host.run_range(state, 16, thresholds))
    manifest = read_manifest(digits_bundle)
    spec = manifest.inputs[0]
    x = np.random.default_rng(0).standard_normal((20, *[int(d) for d in spec.shape[1:]])).astype(np.float32)
    host = BundleRuntime(digits_bundle, last_block=1, resident=False)
    device = BundleRuntime(digits_bundle, last_block=1, resident=True)
    for limit in (0.5, 0.9):
        thresholds = {r.name: limit for r in manifest.exit_ramps()}
        _same(device.run_range({spec.name: x}, None, thresholds), host.run_range({spec.name: x}, None, thresholds))


def test_an_fp16_bundle_stays_fp16_on_the_device(digits_bundle, tmp_path):
    from exitplan.prepare.precision import convert_bundle

    fp16 = convert_bundle(digits_bundle, tmp_path / "fp16", "fp16").directory
    manifest = read_manifest(fp16)
    spec = manifest.inputs[0]
    x = np.random.default_rng(1).standard_normal((12, *[int(d) for d in spec.shape[1:]])).astype(np.float32)
    host = BundleRuntime(fp16, last_block=1, resident=False).run_range({spec.name: x}, None, {"ramp0": 0.9})
    device = BundleRuntime(fp16, last_block=1, resident=True).run_range({spec.name: x}, None, {"ramp0": 0.9})
    _same(device, host)
    assert all(a.dtype == np.float16 for a in device.state.values())


def test_resident_is_chosen_for_gpu_providers_only(digits_bundle):
    assert BundleRuntime(digits_bundle).resident is False
    assert ResidentRange.for_providers(("CUDAExecutionProvider", "CPUExecutionProvider")).device == "cuda"
    assert ResidentRange.for_providers(("CPUExecutionProvider",)).device == "cpu"


@pytest.mark.parametrize("dtype", sorted(ONNX_TYPES, key=str))
def test_the_gather_models_are_valid_onnx_and_drop_rows(dtype):
    for rank in (1, 2, 3):
        model = onnx.load_from_string(gather_model(ONNX_TYPES[dtype], rank))
        onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(gather_model(ONNX_TYPES[dtype], 3), providers=["CPUExecutionProvider"])
    data = (np.random.default_rng(2).standard_normal((6, 2, 3)) * 10).astype(dtype)
    rows = np.array([5, 0, 2], dtype=np.int64)
    assert np.array_equal(session.run(None, {"data": data, "rows": rows})[0], data[rows])
