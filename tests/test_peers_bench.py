"""bench/peers.py without the peers' own virtual environments: the one-file ONNX model every peer serves
equals the bundle's chain, answers as exitplan's router does, and the peers' requirement files are pinned."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers():
    return _module(REPO / "bench" / "peers.py", "exitplan_bench_peers")


@pytest.mark.slow
def test_the_composed_model_equals_the_bundle_chain_and_answers_like_the_router(peers, minilm_bundle, tmp_path):
    from exitplan.client.loadgen import parse_answer
    from exitplan.client.texts import load_pool

    onnx_full = peers.load_onnx_full()
    model = onnx_full.compose(minilm_bundle, tmp_path / "minilm-full.onnx")
    pool = load_pool(minilm_bundle)
    order = np.argsort(pool.lengths)
    texts = [pool.texts[i] for i in order[:: max(1, len(order) // 6)]][:6]
    assert peers.check_composed(minilm_bundle, model, texts) < 1e-4

    full = onnx_full.FullModel(model, threads=1)
    picks = order[:: max(1, len(order) // 24)][:24]
    labels, scores, ramps = full.predict([pool.texts[i] for i in picks])
    assert labels == [pool.manifest.labels[int(pool.full_pred[i])] for i in picks]
    assert np.allclose(scores.sum(axis=1), 1.0, atol=1e-5)
    assert set(ramps) == {"head"}
    one = {"outputs": onnx_full.v2_outputs(labels[:1], scores[:1], ramps[:1])}
    assert parse_answer(json.dumps(one).encode()) == (labels[0], "head")
    assert onnx_full.v2_texts({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}) == [
        "hi"
    ]


def test_every_peer_has_its_server_and_exactly_pinned_requirements(peers, tmp_path):
    opts = peers.PeerOptions(tmp_path / "m.onnx", "minilm", 2, 1, 8, 2.0, tmp_path)
    for peer in peers.PEERS:
        command = peers.peer_command(peer, opts, 18000)
        assert Path(command[2]).is_file(), command
        lines = [
            line.split("#")[0].strip()
            for line in (REPO / "bench" / "peers" / f"{peer}.txt").read_text().splitlines()
            if line.split("#")[0].strip()
        ]
        assert lines and all("==" in line for line in lines), peer
        assert any(line.startswith(("onnxruntime==", "numpy==", "tokenizers==")) for line in lines)
    assert peers.missing_venvs(["no-such-peer"]) == ["no-such-peer"]
