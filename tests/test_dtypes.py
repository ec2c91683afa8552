"""The project's one dtype table (`exitplan.api.dtypes`) and the checks built on it: request values
decoded by the router (`classify/decode.py`), the worker's warm-up inputs, the wire format and the
load generator's request bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import yaml

from exitplan.api import dtypes
from exitplan.api.bundle import BundleManifest, DType
from exitplan.api.dtypes import DTYPES, UnknownDType, by_numpy, by_onnx, by_v2
from exitplan.worker_image import wire
from exitplan.worker_image.classify.decode import BadRequest, decode_inputs

ALL = [e.numpy for e in DTYPES]
EXPECTED = {
    # numpy: (ONNX type, Open Inference Protocol datatype)
    "bool": ("tensor(bool)", "BOOL"),
    "uint8": ("tensor(uint8)", "UINT8"),
    "int8": ("tensor(int8)", "INT8"),
    "int16": ("tensor(int16)", "INT16"),
    "int32": ("tensor(int32)", "INT32"),
    "int64": ("tensor(int64)", "INT64"),
    "float16": ("tensor(float16)", "FP16"),
    "float32": ("tensor(float)", "FP32"),
    "float64": ("tensor(double)", "FP64"),
}


# ---------------------------------------------------------------- the table


def test_the_table_holds_the_supported_dtypes_and_the_manifest_literal_is_its_names():
    assert {e.numpy: (e.onnx, e.v2) for e in DTYPES} == EXPECTED
    assert tuple(ALL) == get_args(dtypes.DTypeName) == get_args(DType)


@pytest.mark.parametrize("name", ALL)
def test_each_entry_round_trips_and_matches_numpy_and_onnx(name):
    from onnx import helper

    entry = by_numpy(name)
    assert by_onnx(entry.onnx) is entry and by_v2(entry.v2) is entry
    assert by_numpy(np.dtype(entry.numpy)) is entry  # a numpy dtype object works as well as its name
    dt = np.dtype(entry.numpy)
    assert dt.name == name and dt.itemsize == entry.itemsize
    assert helper.tensor_dtype_to_np_dtype(entry.onnx_elem_type) == dt
    assert entry.is_float == (dt.kind == "f") and entry.is_bool == (dt.kind == "b")
    if entry.is_float:
        assert (entry.min, entry.max) == (-float(np.finfo(dt).max), float(np.finfo(dt).max))
    elif entry.is_bool:
        assert (entry.min, entry.max) == (0, 1)
    else:
        assert (entry.min, entry.max) == (int(np.iinfo(dt).min), int(np.iinfo(dt).max))


def test_onnx_runtime_reports_the_tables_type_strings(tmp_path):
    """The ONNX strings are what onnxruntime's NodeArg.type says for a model input of each dtype."""
    import onnxruntime as ort
    from onnx import helper

    inputs = [helper.make_tensor_value_info(f"in_{e.numpy}", e.onnx_elem_type, [1]) for e in DTYPES]
    outputs = [helper.make_tensor_value_info(f"out_{e.numpy}", e.onnx_elem_type, [1]) for e in DTYPES]
    nodes = [helper.make_node("Identity", [f"in_{e.numpy}"], [f"out_{e.numpy}"]) for e in DTYPES]
    model = helper.make_model(
        helper.make_graph(nodes, "identity", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert {i.name.removeprefix("in_"): i.type for i in session.get_inputs()} == {e.numpy: e.onnx for e in DTYPES}


@pytest.mark.parametrize(
    "lookup, name, listed",
    [
        (by_numpy, "complex64", "float32"),
        (by_numpy, "uint16", "uint8"),
        (by_onnx, "tensor(string)", "tensor(float)"),
        (by_onnx, "tensor(bfloat16)", "tensor(bool)"),
        (by_v2, "BF16", "FP32"),
        (by_v2, "BYTES", "UINT8"),
        (by_v2, ["FP32"], "INT64"),
    ],
)
def test_unknown_names_raise_listing_the_supported_ones(lookup, name, listed):
    with pytest.raises(UnknownDType) as err:
        lookup(name)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert repr(str(name) if lookup is by_numpy else name) in message and listed in message
    supported = [e.numpy for e in DTYPES] if lookup is by_numpy else [e.onnx for e in DTYPES]
    if lookup is by_v2:
        supported = [e.v2 for e in DTYPES]
    assert all(s in message for s in supported)


def test_manifest_accepts_every_table_dtype_and_rejects_others():
    for name in ALL:
        assert _manifest(name).inputs[0].dtype == name
    with pytest.raises(ValueError, match="complex64"):
        _manifest("complex64")


@pytest.mark.parametrize("name", ALL)
def test_every_table_dtype_crosses_the_wire(name):
    array = np.arange(6).reshape(2, 3).astype(name)
    _, tensors = wire.decode(wire.encode({}, {"t": array}))
    assert tensors["t"].dtype == array.dtype and np.array_equal(tensors["t"], array)


# ---------------------------------------------------------------- request values (router decoding)


def _manifest(dtype: str, shape: list[int | str] | None = None, name: str = "x") -> BundleManifest:
    return BundleManifest.model_validate(
        {
            "name": "tiny",
            "task": "image-classification",
            "labels": ["a", "b"],
            "inputs": [{"name": name, "dtype": dtype, "shape": shape or ["batch", 2]}],
            "blocks": [{"name": "b0", "file": "b0.onnx", "inputs": [name], "outputs": ["h"]}],
            "ramps": [{"name": "head", "after": 0, "file": "head.onnx", "inputs": ["h"], "final": True}],
        }
    )


def _decode(manifest: BundleManifest, *inputs: dict):
    return decode_inputs({"inputs": list(inputs)}, manifest, None, [1], False)


def _input(datatype: str, data: list, name: str = "x", shape: list[int] | None = None) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape or [1, len(data)], "data": data}


BAD_VALUES = [
    # (model dtype, datatype sent, data, position of the bad value, text of the allowed range)
    ("uint8", "UINT8", [7, 300], 1, "[0, 255]"),
    ("uint8", "UINT8", [-1, 0], 0, "[0, 255]"),
    ("int32", "INT32", [1, 2, 2**40], 2, f"[{-(2**31)}, {2**31 - 1}]"),
    ("int64", "INT64", [0, 2**64 - 1], 1, f"[{-(2**63)}, {2**63 - 1}]"),
    ("int64", "INT64", [-1, 2**63 - 1, 2**63], 2, f"{2**63 - 1}]"),  # mixed signs: numpy parses floats
    ("int64", "INT64", [1, 2**70], 1, f"{2**63 - 1}]"),  # past 64 bits: numpy parses objects
    ("int64", "INT64", [1.0, 2.5], 1, "integers"),
    ("int8", "INT8", [1, 128], 1, "[-128, 127]"),
    ("int16", "INT16", [-32769, 1], 0, "[-32768, 32767]"),
    ("float32", "FP32", [1.0, 1e39], 1, "3.4028234663852886e+38"),
    ("float32", "FP32", [float("nan"), 1.0], 0, "finite"),
    ("float32", "FP32", [1.0, -float("inf")], 1, "finite"),
    ("float16", "FP16", [1.0, 70000.0], 1, "65504.0"),
    ("float32", "FP64", [0.5, 1e39], 1, "3.4028234663852886e+38"),  # wider datatype sent: the input's range
    ("float64", "FP32", [0.5, 1e39], 1, "3.4028234663852886e+38"),  # narrower datatype sent: its own range
    ("int32", "INT64", [1, 2**31], 1, f"[{-(2**31)}, {2**31 - 1}]"),
    ("float32", "UINT8", [1, 256], 1, "[0, 255]"),
    ("bool", "BOOL", [True, 2], 1, "true or false"),
    ("bool", "BOOL", [0, 0.5], 1, "true or false"),
    ("uint8", "UINT8", [1, "2"], 1, "[0, 255]"),
    ("float32", "FP32", [1.0, None], 1, "finite"),
]


@pytest.mark.parametrize("dtype, datatype, data, position, allowed", BAD_VALUES)
def test_bad_values_are_bad_requests_naming_input_position_and_range(dtype, datatype, data, position, allowed):
    with pytest.raises(BadRequest) as err:
        _decode(_manifest(dtype, name="pixels", shape=["batch", len(data)]), _input(datatype, data, name="pixels"))
    message = str(err.value)
    assert "'pixels'" in message and f"at position {position} " in message and allowed in message, message
    assert f"value {data[position]!r} at" in message, message


def test_positions_are_flat_row_major_indices():
    data = [[1, 2, 3], [4, 500, 6]]
    with pytest.raises(BadRequest, match="value 500 at position 4 "):
        _decode(
            _manifest("uint8", shape=["batch", 3]), {"name": "x", "datatype": "UINT8", "shape": [2, 3], "data": data}
        )


@pytest.mark.parametrize("name", ALL)
def test_values_at_the_range_edges_are_accepted(name):
    entry = by_numpy(name)
    edges = [entry.min, entry.max]
    if entry.is_bool:
        edges = [False, True]
    batch = _decode(_manifest(name), _input(entry.v2, edges))
    got = batch.fixed["x"]
    assert got.dtype == np.dtype(name) and got.shape == (1, 2)
    assert got.ravel().tolist() == [type(got.ravel()[0].item())(e) for e in edges]


def test_integral_json_floats_and_narrower_or_wider_datatypes_are_converted_exactly():
    assert _decode(_manifest("int64"), _input("INT64", [3.0, -2.0])).fixed["x"].tolist() == [[3, -2]]
    assert _decode(_manifest("int64"), _input("UINT8", [0, 255])).fixed["x"].tolist() == [[0, 255]]
    assert _decode(_manifest("int8"), _input("INT64", [-128, 127])).fixed["x"].dtype == np.int8
    big = [2**62 + 1, 1.0]  # past 2**53 mixed with a float: converted exactly, not through float64
    assert _decode(_manifest("int64"), _input("INT64", big)).fixed["x"].tolist() == [[2**62 + 1, 1]]
    assert _decode(_manifest("float32"), _input("INT64", [1, 2])).fixed["x"].dtype == np.float32
    assert _decode(_manifest("bool"), _input("BOOL", [True, 0])).fixed["x"].tolist() == [[True, False]]
    assert _decode(_manifest("float32"), _input("FP32", [3.4028235e38, 1.0])).fixed["x"].dtype == np.float32


def test_float_values_cannot_go_to_an_integer_input():
    with pytest.raises(BadRequest, match="'x' takes UINT8 values; FP32 cannot be sent"):
        _decode(_manifest("uint8"), _input("FP32", [1.0, 2.0]))


def test_an_input_the_model_does_not_take_is_named_with_the_models_inputs():
    with pytest.raises(BadRequest) as err:
        _decode(_manifest("uint8"), _input("UINT8", [1, 2]), _input("FP32", [1.0], name="extra"))
    message = str(err.value)
    assert "no input named 'extra'" in message and "'x' (UINT8, shape ['batch', 2])" in message


def test_an_unknown_input_of_a_text_model_lists_what_it_takes():
    manifest = _manifest("int64", shape=["batch", "seq"], name="input_ids").model_copy(
        update={"seq_axis": 1, "max_length": 8}
    )
    ids = {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [101, 102]}
    with pytest.raises(BadRequest, match="no input named 'token_type_ids'.*'text'.*'input_ids'"):
        decode_inputs({"inputs": [ids, {**ids, "name": "token_type_ids"}]}, manifest, None, [8], False)
    with pytest.raises(BadRequest, match=r"'input_ids' \(INT64\): value 18446744073709551615 at position 1"):
        decode_inputs({"inputs": [{**ids, "data": [101, 2**64 - 1]}]}, manifest, None, [8], False)


def test_missing_and_repeated_inputs_are_bad_requests():
    two = _manifest("uint8").model_copy(
        update={"inputs": [*_manifest("uint8").inputs, *_manifest("int8", name="y").inputs]}
    )
    with pytest.raises(BadRequest, match="send an input named 'x'.*'x' \\(UINT8.*'y' \\(INT8"):
        _decode(two, _input("INT8", [1, 2], name="y"))
    with pytest.raises(BadRequest, match="'x' is sent twice"):
        _decode(_manifest("uint8"), _input("UINT8", [1, 2]), _input("UINT8", [1, 2]))


# ---------------------------------------------------------------- the load generator's request bodies


@pytest.mark.parametrize("name", ALL)
def test_load_generator_bodies_use_the_tables_datatype_and_decode_back(name):
    from exitplan.client.texts import tensor_body

    array = np.ones((2,), dtype=name)
    body = json.loads(tensor_body("x", array))
    assert body["inputs"][0]["datatype"] == by_numpy(name).v2
    assert np.array_equal(_decode(_manifest(name), *body["inputs"]).fixed["x"][0], array)


def test_load_generator_refuses_held_out_values_the_input_dtype_cannot_hold():
    from exitplan.client.texts import InputError, as_input_dtype

    assert as_input_dtype(np.array([[0.0, 255.0]]), "x", "uint8").dtype == np.uint8
    with pytest.raises(InputError, match=r"'x': value 300 \(flat position 1\).*uint8.*\[0, 255\]"):
        as_input_dtype(np.array([[0, 300]]), "x", "uint8")
    with pytest.raises(InputError, match="1e\\+39"):
        as_input_dtype(np.array([1e39]), "x", "float32")


# ---------------------------------------------------------------- warm-up inputs for every dtype


def _tiny_bundle(root: Path) -> Path:
    """A one-block bundle whose inputs are `x` (uint8) and `keep_mask` (bool): the block casts both to
    float and multiplies them; the head is a ReduceMean and a MatMul to two labels."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def save(path: Path, nodes, inputs, outputs, weights=()) -> None:
        graph = helper.make_graph(nodes, path.stem, inputs, outputs, initializer=list(weights))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))

    x = helper.make_tensor_value_info("x", by_numpy("uint8").onnx_elem_type, ["batch", 4])
    keep = helper.make_tensor_value_info("keep_mask", by_numpy("bool").onnx_elem_type, ["batch", 4])
    hidden = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 4])
    save(
        root / "blocks" / "b0.onnx",
        [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["keep_mask"], ["kf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["xf", "kf"], ["h"]),
        ],
        [x, keep],
        [hidden],
    )
    weight = numpy_helper.from_array(np.array([[1.0, -1.0]], np.float32), "w")
    save(
        root / "ramps" / "head.onnx",
        [
            helper.make_node("ReduceMean", ["h"], ["m"], axes=[1], keepdims=1),  # opset 17: axes is an attribute
            helper.make_node("MatMul", ["m", "w"], ["logits"]),
        ],
        [hidden],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [weight],
    )
    manifest = {
        "name": "tiny-uint8",
        "task": "image-classification",
        "labels": ["low", "high"],
        "inputs": [
            {"name": "x", "dtype": "uint8", "shape": ["batch", 4]},
            {"name": "keep_mask", "dtype": "bool", "shape": ["batch", 4]},
        ],
        "blocks": [{"name": "b0", "file": "blocks/b0.onnx", "inputs": ["x", "keep_mask"], "outputs": ["h"]}],
        "ramps": [{"name": "head", "after": 0, "file": "ramps/head.onnx", "inputs": ["h"], "final": True}],
    }
    (root / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return root


def test_warm_up_builds_dummy_inputs_for_uint8_and_bool_and_runs_them(tmp_path):
    from exitplan.api.plan import Cell, Plan, SplitPlan
    from exitplan.worker_image.classify.warmup import dummy_state
    from exitplan.worker_image.classify.worker import SplitWorker

    bundle = _tiny_bundle(tmp_path / "bundle")
    plan = Plan(
        service="test",
        model="tiny-uint8",
        splits=[SplitPlan(index=0, first_block=0, last_block=0)],
        buckets=[1],
        cells=[Cell(split=0, bucket=1, pool="cpu", replicas=1, batch_size=4)],
    )
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    worker = SplitWorker(bundle, plan_path, split=0, bucket=1)
    try:
        state = dummy_state(worker.runtime, 3, worker.bucket)
        assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
            "x": (np.dtype(np.uint8), (3, 4)),
            "keep_mask": (np.dtype(bool), (3, 4)),
        }
        assert not state["x"].any() and state["keep_mask"].all()  # masks stay ones
        worker.warm_up()  # used to die with KeyError: 'tensor(uint8)'
        assert worker.times.fits[worker.bucket].b > 0
    finally:
        worker.pool_exec.shutdown(wait=False)
    # and a request for it decodes to exactly what the block takes
    manifest = worker.runtime.manifest
    batch = _decode(
        manifest,
        _input("UINT8", [0, 1, 2, 255], shape=[1, 4]),
        _input("BOOL", [True, False, True, True], name="keep_mask", shape=[1, 4]),
    )
    result = worker.runtime.run_range(batch.state_for([0], 1), 1, thresholds=None)
    assert [ex.ramp for ex in result.exits] == ["head"]
    with pytest.raises(BadRequest, match="'x' \\(UINT8\\): value 300 at position 3"):
        _decode(manifest, _input("UINT8", [0, 1, 2, 300], shape=[1, 4]), _input("BOOL", [1, 1, 1, 1], name="keep_mask"))
