"""A tiny fixed-size bundle whose model fails in ONNX Runtime for some inputs the router must accept.

Inputs: `x` (float32, [batch, 4]) and `code` (uint8, [batch, 1]). The block adds the code to x, then
adds zeros of width 4 plus one when the batch's largest code is GOOD_CODES or more: [batch, 4] and [5]
do not broadcast, so the batch fails in ONNX Runtime (on any execution provider) when it holds such a
code, while every uint8 value is valid for the router. The final head is a MatMul to two labels.
This is a user's model that refuses values no request check can know of: what a worker's batch
isolation (bisecting a failed batch) is for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

GOOD_CODES = 200
"""Codes below this run; codes from here to 255 make the batch fail in ONNX Runtime."""


def fragile_bundle(root: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def save(path: Path, nodes, inputs, outputs, weights=()) -> None:
        graph = helper.make_graph(nodes, path.stem, inputs, outputs, initializer=list(weights))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    code = helper.make_tensor_value_info("code", TensorProto.UINT8, ["batch", 1])
    hidden = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 4])
    consts = [
        numpy_helper.from_array(np.array(GOOD_CODES - 1, np.int64), "last_good"),
        numpy_helper.from_array(np.array([4], np.int64), "width"),
    ]
    save(
        root / "blocks" / "b0.onnx",
        [
            helper.make_node("Cast", ["code"], ["code_f"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["x", "code_f"], ["sum"]),
            helper.make_node("Cast", ["code"], ["code_i"], to=TensorProto.INT64),
            helper.make_node("ReduceMax", ["code_i"], ["top"], keepdims=0),
            helper.make_node("Greater", ["top", "last_good"], ["bad"]),
            helper.make_node("Cast", ["bad"], ["extra"], to=TensorProto.INT64),
            helper.make_node("Add", ["width", "extra"], ["wide"]),
            helper.make_node("ConstantOfShape", ["wide"], ["zeros"]),  # float zeros [4] or [5]
            helper.make_node("Add", ["sum", "zeros"], ["h"]),  # [batch, 4] + [5] does not broadcast
        ],
        [x, code],
        [hidden],
        consts,
    )
    weight = numpy_helper.from_array(np.array([[1, -1]] * 2 + [[-1, 1]] * 2, np.float32), "w")
    save(
        root / "ramps" / "head.onnx",
        [helper.make_node("MatMul", ["h", "w"], ["logits"])],
        [hidden],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [weight],
    )
    manifest = {
        "name": "fragile",
        "task": "image-classification",
        "labels": ["left", "right"],
        "inputs": [
            {"name": "x", "dtype": "float32", "shape": ["batch", 4]},
            {"name": "code", "dtype": "uint8", "shape": ["batch", 1]},
        ],
        "blocks": [{"name": "b0", "file": "blocks/b0.onnx", "inputs": ["x", "code"], "outputs": ["h"]}],
        "ramps": [{"name": "head", "after": 0, "file": "ramps/head.onnx", "inputs": ["h"], "final": True}],
    }
    (root / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return root


def fragile_request(x: list[float], code: int) -> dict:
    """An inference request of one input for the fragile bundle."""
    return {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x},
            {"name": "code", "datatype": "UINT8", "shape": [1, 1], "data": [code]},
        ]
    }
