"""`exitplan prepare --hf` on encoder families other than BERT: DistilBERT (no token types, its own layer
names), RoBERTa (positions after the padding index), ELECTRA and DeBERTa-v2 (relative positions), each as a small randomly initialised
checkpoint written here with save_pretrained (nothing downloaded; the tokenizer is MiniLM's WordPiece file),
both as an encoder (a head trained on the labels) and as a sequence classifier. The chained bundle must
reproduce the exported model, the ramps sit at cut vertices found automatically, and the bundle loads
and answers texts through the runtime the workers use.
"""

from __future__ import annotations

import csv
import shutil

import numpy as np
import pytest

from exitplan.api.bundle import read_manifest

pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=30522, max_position_embeddings=80, pad_token_id=0)
FAMILIES = {
    "distilbert": ("DistilBertConfig", dict(dim=64, hidden_dim=128, n_layers=4, n_heads=4)),
    "roberta": (
        "RobertaConfig",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
    ),
    "electra": (
        "ElectraConfig",
        dict(hidden_size=64, embedding_size=32, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
    ),
    # relative positions from a shape read of the hidden state, used in every layer (issue 27)
    "deberta-v2": (
        "DebertaV2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=16,
        ),
    ),  # fmt: skip
}


def _checkpoint(directory, family: str, classifier: bool):
    import torch
    import transformers

    from exitplan.prepare.minilm import model_path

    name, sizes = FAMILIES[family]
    config = getattr(transformers, name)(**SMALL, **sizes, num_labels=3)
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModel
    model = auto.from_config(config).eval()
    model.save_pretrained(directory)
    shutil.copy(model_path() / "tokenizer.json", directory / "tokenizer.json")


def _texts(path, per_class: int = 60) -> None:
    from exitplan.prepare.datasets import TWEET_LABELS, load_tweets

    texts, labels = load_tweets()
    rng = np.random.default_rng(1)
    rows = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(3)])
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows([texts[r], TWEET_LABELS[labels[r]]] for r in rows)


@pytest.mark.parametrize("classifier", [False, True], ids=["encoder", "classifier"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_families_become_bundles(tmp_path, family, classifier):
    from tokenizers import Tokenizer

    from exitplan.prepare.check import check_bundle
    from exitplan.prepare.from_hf import from_hf
    from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch

    checkpoint = tmp_path / family
    _checkpoint(checkpoint, family, classifier)
    _texts(tmp_path / "texts.csv")
    result = from_hf(checkpoint, tmp_path / "texts.csv", tmp_path / "bundle", text_column="text",
                     label_column="label", max_length=32, max_ramps=2)  # fmt: skip
    report = result.report
    assert report["chain_max_abs_diff"] <= 1e-4, report
    assert report["head"] == ("the checkpoint's own" if classifier else "linear, trained here")
    assert len(report["candidates"]) >= 3 and all(c["kind"] == "sequence" for c in report["candidates"])  # 4 layers
    manifest = read_manifest(result.path)
    assert [t.name for t in manifest.inputs] == ["input_ids", "attention_mask"] and manifest.max_length == 32
    assert len(manifest.blocks) == len(manifest.exit_ramps()) + 1
    check = check_bundle(result.path)
    assert check.ok, check.failures

    tokenizer = Tokenizer.from_file(str(result.path / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(["what a lovely day", "this is awful, never again"])]
    runtime = BundleRuntime(result.path, buckets=[32])
    logits, _ = runtime.run_all_ramps(pad_batch(ids, 32), 32)
    final = logits[manifest.final_ramp().name]
    assert final.shape == (2, 3) and np.isfinite(final).all()
