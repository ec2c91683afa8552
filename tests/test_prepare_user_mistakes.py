"""`exitplan prepare --onnx` on what users really bring (issue 27): models with several outputs (the served
one chosen, the others named), text models with their tokenizer, a model where no ramp pays, and the
mistakes users make: a static batch axis, NaN or inf in the data, another model's bundle in --out. Each
mistake ends in one line, after the progress bar, exit code 2, no traceback and nothing written.

Models are small graphs written with onnx.helper, or tiny transformers (tests/hf_exports.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from hf_exports import build, export, wrapper
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app

ROWS = 120


def _model(tmp_path, nodes, inputs, outputs, inits=(), name="m.onnx"):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _dense(name: str, n_in: int, n_out: int, seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.normal(size=(n_in, n_out)).astype(np.float32), name)


def _chain(tmp_path, batch="n", outputs=("logits",), name="m.onnx", log=False):
    """x [batch, 8] -> 3 dense layers -> logits [batch, 4]; `outputs` beyond the first: the hidden
    features [batch, 64] under those names (as a second served candidate). `log`: logits = log(...) of x's
    first column as well (NaN on a negative value)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Relu", ["h0"], ["r0"]),
        helper.make_node("MatMul", ["r0", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["raw" if log else outputs[0]]),
    ]
    inits = [_dense("w0", 8, 64, 0), _dense("w1", 64, 64, 1), _dense("w2", 64, 4, 2)]
    if log:
        nodes += [helper.make_node("Log", ["x"], ["logx"]), helper.make_node("Add", ["raw", "logx4"], [outputs[0]])]
        nodes.insert(-1, helper.make_node("Slice", ["logx", "zero", "four", "one"], ["logx4"]))
        inits += [
            numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("four", 4), ("one", 1))
        ]
    values = [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, [batch, 4])]
    for extra in outputs[1:]:
        nodes.append(helper.make_node("Identity", ["r1"], [extra]))
        values.append(helper.make_tensor_value_info(extra, TensorProto.FLOAT, [batch, 64]))
    return _model(tmp_path, nodes, [x], values, inits, name)


def _data(path, rows: int = ROWS, seed: int = 0, **edits):
    x = np.abs(np.random.default_rng(seed).normal(size=(rows, 8))).astype(np.float32) + 0.1
    for row, value in edits.get("at", {}).items():
        x[row, 3] = value
    np.savez(path, x=x)
    return path


def _run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _fails(result, out, *words: str) -> str:
    text = result.output.split("\r")[-1].strip()  # after the closed progress bar
    assert result.exit_code == 2, text
    assert text.startswith("error:") and "\n" not in text and "Traceback" not in text, text
    assert all(w in text for w in words), text
    assert not out.exists() or not (out / ".complete.json").exists() or "another model" in text
    return text


# ------------------------------------------------------------------------------ several outputs


def test_the_output_named_like_logits_is_served_and_the_others_named(tmp_path):
    model = _chain(tmp_path, outputs=("logits", "features"))
    data, out = _data(tmp_path / "d.npz"), tmp_path / "b"
    result = _run("prepare", "--onnx", model, "--data", data, "--out", out, "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert "not served: features" in " ".join(result.output.split())
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["output"] == "logits" and report["outputs_not_served"] == ["features"]
    assert read_manifest(out).source_output == "logits"
    check = _run("check", out, "--source", model)  # the two-output source compared on the served output
    assert check.exit_code == 0 and "output 'logits'" in check.output, check.output


def test_without_a_logits_output_the_choice_is_asked_for(tmp_path):
    model = _chain(tmp_path, outputs=("scores", "features"))
    data, out = _data(tmp_path / "d.npz"), tmp_path / "b"
    text = _fails(_run("prepare", "--onnx", model, "--data", data, "--out", out), out, "'scores'", "'features'")
    assert "--output NAME" in text
    _fails(
        _run("prepare", "--onnx", model, "--data", data, "--out", out, "--output", "nope"), out, "'nope'", "'scores'"
    )
    chosen = _run("prepare", "--onnx", model, "--data", data, "--out", out, "--output", "scores", "--max-ramps", "0")
    assert chosen.exit_code == 0, chosen.output
    assert _run("check", out, "--source", model).exit_code == 0
    assert _run("check", out, "--source", model, "--output", "features").exit_code == 1  # 64 columns, not 4


# ------------------------------------------------------------------------------ mistakes


def test_a_static_batch_axis_is_named_with_the_way_out(tmp_path):
    model, out = _chain(tmp_path, batch=1), tmp_path / "b"
    text = _fails(_run("prepare", "--onnx", model, "--data", _data(tmp_path / "d.npz"), "--out", out), out, "'x'")
    assert "fixed batch axis" in text and "dynamic_axes" in text


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_or_inf_in_the_data_names_the_file_the_input_and_the_row(tmp_path, value):
    data, out = _data(tmp_path / "d.npz", at={17: value, 40: value}), tmp_path / "b"
    text = _fails(_run("prepare", "--onnx", _chain(tmp_path), "--data", data, "--out", out), out, str(data), "'x'")
    assert "2 row(s), the first row 17" in text and str(value) in text


def test_a_model_answering_nan_names_the_rows(tmp_path):
    data, out = _data(tmp_path / "d.npz", at={23: -1.0}), tmp_path / "b"  # log(-1): NaN in row 23 only
    text = _fails(_run("prepare", "--onnx", _chain(tmp_path, log=True), "--data", data, "--out", out), out, "row 23")
    assert "'logits'" in text and "NaN" in text


def test_the_error_has_a_line_of_its_own_after_the_progress_bar(tmp_path):
    data, out = _data(tmp_path / "d.npz", at={5: np.nan}), tmp_path / "b"
    command = "from exitplan.cli import app; app()"
    args = ["prepare", "--onnx", str(_chain(tmp_path)), "--data", str(data), "--out", str(out)]
    done = subprocess.run([sys.executable, "-P", "-c", command, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.split("\n") if "error:" in line]
    assert len(lines) == 1, done.stderr
    shown = lines[0].split("\r")  # the bar redraws with carriage returns; closed, it leaves only blanks
    assert shown[-1].startswith("error: ") and not "".join(shown[:-1]).strip(), repr(lines[0])


def test_another_models_bundle_in_out_is_kept_without_force(tmp_path):
    data, out = _data(tmp_path / "d.npz"), tmp_path / "b"
    first = _chain(tmp_path, name="first.onnx")
    assert _run("prepare", "--onnx", first, "--data", data, "--out", out, "--max-ramps", "1").exit_code == 0
    again = _run("prepare", "--onnx", first, "--data", data, "--out", out, "--max-ramps", "1")
    assert again.exit_code == 0 and "reused" in again.output
    other = _chain(tmp_path, name="second.onnx")
    text = _fails(_run("prepare", "--onnx", other, "--data", data, "--out", out), out, "another model", "--force")
    assert "first" in text and "second" in text and read_manifest(out).name == "first"
    forced = _run("prepare", "--onnx", other, "--data", data, "--out", out, "--force")
    assert forced.exit_code == 0 and read_manifest(out).name == "second"


def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path):
    (tmp_path / "vocab.json").write_text('{"hello": 1}')
    out = tmp_path / "b"
    args = ("prepare", "--onnx", _chain(tmp_path), "--data", _data(tmp_path / "d.npz"), "--out", out)
    _fails(_run(*args, "--tokenizer", tmp_path / "vocab.json"), out, "vocab.json", "not a Hugging Face")
    _fails(_run(*args, "--tokenizer", tmp_path), out, "without tokenizer.json")


# ------------------------------------------------------------------------------ text models through --onnx


@pytest.fixture(scope="module")
def bert_with_token_types(tmp_path_factory):
    """A BERT with MiniLM's vocabulary, exported optimum-style (input_ids, attention_mask, token_type_ids),
    data from tweets tokenized with MiniLM's tokenizer.json."""
    from tokenizers import Tokenizer

    from exitplan.prepare.datasets import load_tweets
    from exitplan.prepare.minilm import model_path

    where = tmp_path_factory.mktemp("bert")
    model = build("bert", vocab_size=30522)
    export("bert", model, where / "bert.onnx", "optimum")
    tokenizer = Tokenizer.from_file(str(model_path() / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=24)
    tokenizer.enable_padding(length=24, pad_id=0)
    texts, labels = load_tweets()
    encoded = tokenizer.encode_batch(list(texts[:ROWS]))
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    np.savez(where / "data.npz", input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    return where / "bert.onnx", where / "data.npz", model_path() / "tokenizer.json", model


def test_a_tokenizer_makes_an_onnx_text_model_take_texts(tmp_path, bert_with_token_types):
    import torch

    from exitplan.api.bundle import read_manifest
    from exitplan.worker_image.bundle_runtime import BundleRuntime
    from exitplan.worker_image.classify.decode import decode_inputs
    from exitplan.worker_image.protocol import classifier_metadata

    model, data, tokenizer, torch_model = bert_with_token_types
    out = tmp_path / "b"
    result = _run("prepare", "--onnx", model, "--data", data, "--out", out, "--tokenizer", tokenizer.parent)
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.tokenizer == "tokenizer.json" and "token_type_ids" in [t.name for t in manifest.inputs]
    meta = classifier_metadata(manifest, "bert", "1", {})
    assert [i["name"] for i in meta["inputs"]][0] == "text" and meta["parameters"]["accepts"].startswith("text")

    from tokenizers import Tokenizer

    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["what a day"]}]}
    batch = decode_inputs(body, manifest, Tokenizer.from_file(str(out / "tokenizer.json")), [24], False, 30522)
    state = batch.state_for([0], 24)
    assert not state["token_type_ids"].any() and state["token_type_ids"].shape == (1, 24)
    runtime = BundleRuntime(out, buckets=[24])
    logits, _ = runtime.run_all_ramps(state, 24)
    ids, mask = (torch.from_numpy(state[k]) for k in ("input_ids", "attention_mask"))
    with torch.no_grad():
        want = wrapper(torch_model, ["input_ids", "attention_mask"])(ids, mask).numpy()
    assert np.abs(logits[manifest.final_ramp().name] - want).max() <= 1e-4

    plain = tmp_path / "plain"
    assert _run("prepare", "--onnx", model, "--data", data, "--out", plain, "--max-ramps", "0").exit_code == 0
    meta = classifier_metadata(read_manifest(plain), "bert", "1", {})
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"]
    assert "input_ids only" in meta["parameters"]["accepts"] and "--tokenizer" in meta["parameters"]["accepts"]


# ------------------------------------------------------------------------------ no ramp


def test_a_bundle_without_a_ramp_says_so(tmp_path):
    out = tmp_path / "b"
    result = _run("prepare", "--onnx", _chain(tmp_path), "--data", _data(tmp_path / "d.npz"), "--out", out,
                  "--max-ramps", "0", "--json", tmp_path / "r.json")  # fmt: skip
    assert result.exit_code == 0 and "serves the plain model (no exits)" in " ".join(result.output.split())
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kept"] == [] and report["exits"]["ramps"] == [] and report["exits"]["compute_saved"] == 0.0
    manifest = read_manifest(out)
    assert not manifest.exit_ramps() and len(manifest.blocks) == 1


def test_token_types_are_filled_in_as_zeros_where_one_type_exists(tmp_path):
    """RoBERTa has a single token type: an optimum-style export takes token_type_ids, and every run the
    bundle sees (check's warm-up, the held-out chain) must feed zeros there, as the router does."""
    from hf_exports import example

    export("roberta", build("roberta", type_vocab_size=1), tmp_path / "roberta.onnx", "optimum")  # as roberta-base
    np.savez(tmp_path / "d.npz", **example("roberta", rows=80, seq=12, seed=2, token_types=True))
    out = tmp_path / "b"
    built = _run("prepare", "--onnx", tmp_path / "roberta.onnx", "--data", tmp_path / "d.npz", "--out", out)
    assert built.exit_code == 0, built.output
    assert "token_type_ids" in [t.name for t in read_manifest(out).inputs]
    check = _run("check", out, "--source", tmp_path / "roberta.onnx")
    assert check.exit_code == 0, check.output


# ------------------------------------------------------------------------------ --precision


def test_precision_fp16_serves_a_converted_bundle_and_keeps_its_fp32_source(tmp_path):
    model, data, out = _chain(tmp_path), _data(tmp_path / "d.npz"), tmp_path / "b"
    result = _run("prepare", "--onnx", model, "--data", data, "--out", out, "--max-ramps", "1", "--precision", "fp16",
                  "--json", tmp_path / "r.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    served, source = read_manifest(out), read_manifest(tmp_path / "b-fp32")
    assert (served.dtype, source.dtype) == ("float16", "float32") and served.precision is not None
    assert served.precision.name == "fp16" and served.precision.final_agreement >= 0.995
    text = " ".join(result.output.split())
    assert f"fp16 bundle {out}" in text and "agree with fp32 on" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["path"] == str(out) and report["precision"]["final_agreement"] == served.precision.final_agreement
    again = _run("prepare", "--onnx", model, "--data", data, "--out", out, "--max-ramps", "1", "--precision", "fp16")
    assert again.exit_code == 0 and "reused" in again.output  # the fp32 build is reused, converted again
    check = _run("check", out)
    assert check.exit_code == 0 and "fp16: bundle.yaml records" in " ".join(check.output.split()), check.output


def test_a_precision_that_cannot_be_served_is_refused_before_building(tmp_path):
    model, data, out = _chain(tmp_path), _data(tmp_path / "d.npz"), tmp_path / "b"
    text = _fails(_run("prepare", "--onnx", model, "--data", data, "--out", out, "--precision", "bf16"), out, "bf16")
    assert "--precision fp16" in text and not out.exists() and not (tmp_path / "b-fp32").exists()
    _fails(_run("prepare", "--onnx", model, "--data", data, "--out", out, "--precision", "int8"), out, "int8")


def test_a_conversion_into_another_models_bundle_is_refused_without_force(tmp_path):
    data, out = _data(tmp_path / "d.npz"), tmp_path / "b"
    first = _chain(tmp_path, name="first.onnx")
    assert _run("prepare", "--onnx", first, "--data", data, "--out", out, "--max-ramps", "1").exit_code == 0
    other = _chain(tmp_path, name="second.onnx")
    text = _fails(_run("prepare", "--onnx", other, "--data", data, "--out", out, "--precision", "fp16"), out,
                  "another model", "--force")  # fmt: skip
    assert read_manifest(out).name == "first" and read_manifest(out).dtype == "float32", text
