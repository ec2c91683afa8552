"""Shared by the generation tests: the tiny decoder bundle (built once, cached like the other test bundles)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_BUNDLES = Path(os.environ.get("EXITPLAN_TEST_BUNDLES", REPO / "artifacts" / "test-bundles"))
PROMPTS = ["self driving cars", "I would never ride in", "Google's car is"]


def tiny_decoder_bundle() -> Path:
    """3 blocks, hidden 32, context 512: trained for a few seconds on 2,000 tweets."""
    from exitplan.prepare.decoder import DecoderOptions, build_decoder_bundle, tqdm_bar

    options = DecoderOptions(
        layers=3, hidden=32, heads=2, context=512, steps=80, batch=16, heldout=20, train_tweets=2000
    )
    return build_decoder_bundle(options, TEST_BUNDLES / "decoder-tiny", bar=tqdm_bar(False), threads=1).path


def post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST JSON; (status, decoded JSON body) for 2xx and HTTP errors alike."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
