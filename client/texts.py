"""Inputs for a load run: held-out texts matched to a trace's input lengths, with reference answers.

Each request of the trace gets the held-out text whose token length (the bundle's tokenizer, special
tokens included, no truncation) is closest to the trace's (scaled or clipped) length; among texts of
that length one is drawn with a seeded generator, so a run is deterministic given its seed. When the
trace asks for a longer input than any single text, several texts are concatenated (joined by a
space; the bundle's BERT pre-tokenizer splits on whitespace, so the pieces' tokens add up) until the
length is reached, never beyond the router's largest bucket.

The reference answer of a request is the full model's answer for exactly that text: the bundle's
`full_pred` for a single held-out text, and for a concatenation the final head computed once before
the run with `BundleRuntime` (no thresholds: every row runs to the end). Accuracy against the true
label is known only for single texts.

Fixed-size models (no sequence axis, e.g. the digits CNN) ignore the trace's lengths: held-out
inputs are drawn in a seeded order.

With `binary`, bodies use the Open Inference Protocol's binary tensor extension: the JSON request
first, each input declaring `"parameters": {"binary_data_size": bytes}` instead of `data`, then the
raw tensors (little-endian, row-major; a BYTES element as its 4-byte little-endian length and its
UTF-8 bytes); the request's `Inference-Header-Content-Length` header (in `RequestInputs.headers`)
gives the JSON's length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.api.bundle import BundleError, BundleManifest, read_manifest
from exitplan.api.dtypes import by_numpy

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from exitplan.worker_image.bundle_runtime import BundleRuntime

Lengths = Sequence[int] | np.ndarray
"""Token lengths: a list, or an int array."""

BINARY_HEADER = "Inference-Header-Content-Length"
"""The binary tensor extension's request header: the length in bytes of the JSON that starts the body."""
SPECIAL_TOKENS = 2
"""[CLS] and [SEP]: what every separately tokenized text carries once."""
JOINER = " "


class InputError(ValueError):
    """Held-out data that cannot feed a load run; the message names the file and what is missing."""


# ---------------------------------------------------------------------------- pure matching


def closest_choice(target: int, sorted_lengths: np.ndarray, order: np.ndarray, rng: np.random.Generator) -> int:
    """Index (into the unsorted pool) of a text whose length is closest to `target`.

    `sorted_lengths` = lengths[order] ascending. Ties between a shorter and a longer length go to the
    shorter one (it stays inside the bucket the trace asked for); among texts of the chosen length
    one is drawn from `rng`.
    """
    if sorted_lengths.size == 0:
        raise InputError("no held-out text to choose from")
    pos = int(np.searchsorted(sorted_lengths, target))
    candidates = []
    if pos < sorted_lengths.size:
        candidates.append(int(sorted_lengths[pos]))
    if pos > 0:
        candidates.append(int(sorted_lengths[pos - 1]))
    best = min(candidates, key=lambda length: (abs(length - target), length))
    lo = int(np.searchsorted(sorted_lengths, best, side="left"))
    hi = int(np.searchsorted(sorted_lengths, best, side="right"))
    return int(order[lo + int(rng.integers(hi - lo))])


def match_lengths(targets: Lengths, lengths: Lengths, max_length: int, seed: int = 0) -> list[tuple[int, ...]]:
    """For each target length, the pool indices whose texts (concatenated if more than one) match it.

    `lengths` are token lengths of separately tokenized texts (special tokens included). Only texts
    of at most `max_length` tokens are used. A target longer than every usable text is met by
    concatenating texts: a concatenation of texts with lengths l_i has sum(l_i - 2) + 2 tokens.
    Pieces are chosen one at a time, each the closest fit to what remains, and a piece that would
    go over `max_length` is not added. Deterministic given `seed`.
    """
    pool = np.asarray(lengths, dtype=np.int64)
    if max_length < 1:
        raise InputError(f"max_length must be >= 1, got {max_length}")
    usable = np.flatnonzero(pool <= max_length)
    if usable.size == 0:
        raise InputError(f"every held-out text is longer than {max_length} tokens (the largest bucket)")
    order = usable[np.argsort(pool[usable], kind="stable")]
    sorted_lengths = pool[order]
    longest = int(sorted_lengths[-1])
    content = pool - SPECIAL_TOKENS
    pieces_ok = order[content[order] > 0]  # texts with content tokens can be pieces of a concatenation
    piece_sorted = content[pieces_ok]
    rng = np.random.default_rng(seed)
    out: list[tuple[int, ...]] = []
    for raw in targets:
        target = min(int(raw), max_length)
        if target <= longest or pieces_ok.size == 0:
            out.append((closest_choice(target, sorted_lengths, order, rng),))
            continue
        parts: list[int] = []
        remaining = target - SPECIAL_TOKENS
        total = SPECIAL_TOKENS
        while remaining > 0:
            pick = closest_choice(remaining, piece_sorted, pieces_ok, rng)
            size = int(content[pick])
            if total + size > max_length:
                fits = pieces_ok[piece_sorted <= max_length - total]
                if fits.size == 0:
                    break
                pick = closest_choice(max_length - total, content[fits], fits, rng)
                size = int(content[pick])
            # stop when adding this piece lands further from the target than stopping here
            if parts and abs(remaining - size) >= remaining:
                break
            parts.append(pick)
            total += size
            remaining -= size
        out.append(tuple(parts))
    return out


def concatenated_length(parts: Sequence[int], lengths: Lengths) -> int:
    """Token length of the texts `parts` joined (see `match_lengths`)."""
    if len(parts) == 1:
        return int(lengths[parts[0]])
    return sum(int(lengths[p]) - SPECIAL_TOKENS for p in parts) + SPECIAL_TOKENS


# ---------------------------------------------------------------------------- held-out data


@dataclass
class HeldoutPool:
    """A bundle's held-out inputs: texts (or fixed-size arrays), labels and the full model's answers."""

    manifest: BundleManifest
    directory: Path
    labels: np.ndarray
    full_pred: np.ndarray
    texts: list[str] | None = None
    lengths: np.ndarray | None = None
    """Token length of each text (special tokens included, no truncation)."""
    tokenizer: Tokenizer | None = None
    arrays: dict[str, np.ndarray] | None = None
    """One array per bundle input, keyed by its name (models without a tokenizer)."""

    def __len__(self) -> int:
        return int(self.labels.size)

    @property
    def is_text(self) -> bool:
        return self.texts is not None


def load_pool(bundle: str | Path) -> HeldoutPool:
    """Read `<bundle>/data/heldout.npz` (`text`, or one array per bundle input keyed by its name -- `x` for a
    single input -- with `label` and `full_pred`) and tokenize the texts."""
    directory = Path(bundle)
    manifest = read_manifest(directory)
    path = directory / manifest.data.heldout
    if not path.is_file():
        raise InputError(f"{path}: the bundle has no held-out data; rebuild it with `exitplan prepare --force`")
    with np.load(path, allow_pickle=False) as data:
        files = set(data.files)
        names = [spec.name for spec in manifest.inputs]
        if len(names) == 1 and names[0] not in files and "x" in files:  # one input, stored as `x`
            files = (files - {"x"}) | {names[0]}
        named = "text" not in files and all(name in files for name in names)
        missing = {"label", "full_pred"} - files
        if missing or not ("text" in files or named):
            raise InputError(
                f"{path}: held-out data needs arrays `text` (or `x`, or one per bundle input {names}), `label` and "
                f"`full_pred`; it has {sorted(files)}"
            )
        labels = np.asarray(data["label"], dtype=np.int64)
        full_pred = np.asarray(data["full_pred"], dtype=np.int64)
        texts = [str(t) for t in data["text"]] if "text" in files else None
        stored = {name: name if name in data.files else "x" for name in names}
        arrays = {name: np.asarray(data[stored[name]]) for name in names} if named else None
    n = labels.size
    counts = [
        full_pred.size,
        *([len(texts)] if texts is not None else []),
        *(a.shape[0] for a in (arrays or {}).values()),
    ]
    if any(c != n for c in counts):
        raise InputError(f"{path}: arrays disagree on the number of held-out inputs")
    if n == 0:
        raise InputError(f"{path}: the held-out data is empty")
    if texts is None:
        return HeldoutPool(manifest, directory, labels, full_pred, arrays=arrays)
    if not manifest.tokenizer:
        raise InputError(f"{directory / 'bundle.yaml'}: held-out texts but the manifest names no tokenizer")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / manifest.tokenizer))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    lengths = np.asarray([len(e.ids) for e in tokenizer.encode_batch(texts)], dtype=np.int64)
    return HeldoutPool(manifest, directory, labels, full_pred, texts=texts, lengths=lengths, tokenizer=tokenizer)


# ---------------------------------------------------------------------------- request inputs


@dataclass
class RequestInputs:
    """What each request of a run sends, and the answers it is checked against."""

    bodies: list[bytes]
    """Serialized Open Inference Protocol bodies, one per request."""
    target_lengths: np.ndarray
    lengths: np.ndarray
    """Token length of what is sent (1 for fixed-size models)."""
    parts: list[tuple[int, ...]]
    """Held-out indices behind each request (more than one: a concatenation)."""
    reference: list[str]
    """The full model's label for exactly that input."""
    truth: list[str | None]
    """The true label where known (single held-out inputs), else None."""
    meta: dict[str, Any] = field(default_factory=dict)
    headers: list[dict[str, str]] = field(default_factory=list)
    """Per request, the HTTP headers its body needs (binary bodies: Content-Type and the JSON header's
    length); empty when every body is plain JSON."""

    def __len__(self) -> int:
        return len(self.bodies)

    @property
    def concatenated(self) -> int:
        return sum(1 for p in self.parts if len(p) > 1)


def text_body(text: str) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}).encode()


def tensor_body(name: str, array: np.ndarray) -> bytes:
    datatype = by_numpy(array.dtype.name).v2
    return json.dumps(
        {"inputs": [{"name": name, "datatype": datatype, "shape": [1, *array.shape], "data": array.ravel().tolist()}]}
    ).encode()


def tensors_body(arrays: dict[str, np.ndarray]) -> bytes:
    """One request holding one input row per array (each [1, ...]), keyed by input name."""
    inputs = [
        {"name": name, "datatype": by_numpy(a.dtype.name).v2, "shape": [1, *a.shape], "data": a.ravel().tolist()}
        for name, a in arrays.items()
    ]
    return json.dumps({"inputs": inputs}).encode()


def binary_body(inputs: list[tuple[str, str, list[int], bytes]]) -> tuple[bytes, dict[str, str]]:
    """A binary-extension body of (name, datatype, shape, raw bytes) inputs, and the headers it needs."""
    specs = [
        {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}}
        for name, datatype, shape, raw in inputs
    ]
    header = json.dumps({"inputs": specs}).encode()
    headers = {"Content-Type": "application/octet-stream", BINARY_HEADER: str(len(header))}
    return header + b"".join(raw for *_, raw in inputs), headers


def _raw(array: np.ndarray) -> bytes:
    """An array's values, row-major, little-endian (bool as one byte each)."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def binary_text_body(text: str) -> tuple[bytes, dict[str, str]]:
    """`text_body` in binary form."""
    raw = text.encode()
    return binary_body([("text", "BYTES", [1], len(raw).to_bytes(4, "little") + raw)])


def binary_tensors_body(arrays: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """`tensors_body` in binary form."""
    return binary_body([(name, by_numpy(a.dtype.name).v2, [1, *a.shape], _raw(a)) for name, a in arrays.items()])


def _request(arrays: dict[str, np.ndarray] | None, text: str | None, binary: bool) -> tuple[bytes, dict[str, str]]:
    """One request's body (a text, or arrays by input name) and the headers it needs."""
    if text is not None:
        return binary_text_body(text) if binary else (text_body(text), {})
    assert arrays is not None
    return binary_tensors_body(arrays) if binary else (tensors_body(arrays), {})


def _named_inputs(pool: HeldoutPool, targets: np.ndarray, seed: int, binary: bool = False) -> RequestInputs:
    """Requests from held-out inputs keyed by input name, in seeded order; with a sequence axis each
    row is cut to its length (the attention mask's sum), so the router buckets it as it would a client's."""
    assert pool.arrays is not None
    manifest = pool.manifest
    arrays = {s.name: as_input_dtype(pool.arrays[s.name], s.name, s.dtype) for s in manifest.inputs}
    order = np.random.default_rng(seed).permutation(len(pool))
    picks = [int(order[i % len(pool)]) for i in range(targets.size)]
    axis = manifest.seq_axis
    masks = [s.name for s in manifest.inputs if "mask" in s.name.lower()]
    bodies, headers, lengths = [], [], []
    for p in picks:
        row = {name: a[p] for name, a in arrays.items()}
        length = 1
        if axis is not None:
            full = next(iter(row.values())).shape[axis - 1]
            length = int((row[masks[0]] != 0).sum()) if masks else full
            row = {name: np.take(a, np.arange(max(length, 1)), axis=axis - 1) for name, a in row.items()}
        body, extra = _request(row, None, binary)
        bodies.append(body)
        headers.append(extra)
        lengths.append(length)
    labels = manifest.labels
    return RequestInputs(
        bodies=bodies,
        target_lengths=targets,
        lengths=np.asarray(lengths, dtype=np.int64),
        parts=[(p,) for p in picks],
        reference=[labels[int(pool.full_pred[p])] for p in picks],
        truth=[labels[int(pool.labels[p])] for p in picks],
        meta={"inputs": "held-out rows keyed by input name, seeded order (trace lengths not matched)"},
        headers=headers if binary else [],
    )


def as_input_dtype(x: np.ndarray, name: str, dtype: str) -> np.ndarray:
    """Held-out inputs `x` as the bundle input's dtype (a name of `exitplan.api.dtypes`); values that
    dtype cannot hold (they would wrap around or become infinite) are an InputError."""
    want = np.dtype(by_numpy(dtype).numpy)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = x.astype(want)
    bad = ~np.isfinite(cast) if want.kind == "f" else cast != x  # the router refuses NaN and infinities too
    if bad.any():
        index = int(np.flatnonzero(bad.ravel())[0])
        raise InputError(
            f"held-out input {name!r}: value {x.ravel()[index].item()!r} (flat position {index}) does not fit the "
            f"bundle's dtype {dtype}, which holds {by_numpy(dtype).describe_values()}"
        )
    return cast


class ReferenceCache:
    """The full model's answers for concatenated texts, computed once (BundleRuntime, no exits)."""

    def __init__(self, pool: HeldoutPool) -> None:
        self.pool = pool
        self.answers: dict[tuple[int, ...], int] = {}
        self.lengths: dict[tuple[int, ...], int] = {}
        """Token length of each concatenation, as the tokenizer counts it."""
        self._runtime: BundleRuntime | None = None

    def _run(self, token_lists: list[list[int]], progress: bool) -> np.ndarray:
        from tqdm.auto import tqdm

        from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, pad_batch

        if self._runtime is None:
            self._runtime = BundleRuntime(self.pool.directory)
        runtime = self._runtime
        preds = np.zeros(len(token_lists), dtype=np.int64)
        buckets = np.array([bucket_for(len(t), runtime.buckets) for t in token_lists])
        final = self.pool.manifest.final_ramp().name
        bar = tqdm(
            total=len(token_lists), desc="full-model answers for concatenated texts", disable=not progress, leave=False
        )
        for bucket in np.unique(buckets):
            rows = np.flatnonzero(buckets == bucket)
            for start in range(0, rows.size, 32):
                chunk = rows[start : start + 32]
                manifest = self.pool.manifest
                state = pad_batch(
                    [token_lists[r] for r in chunk],
                    int(bucket),
                    manifest.pad_token_id,
                    [t.name for t in manifest.inputs],
                )
                result = runtime.run_range(state, int(bucket), thresholds=None)
                for ex in result.exits:
                    if ex.ramp == final:
                        preds[chunk[ex.row]] = int(np.argmax(ex.logits))
                bar.update(len(chunk))
        bar.close()
        return preds

    def resolve(self, combos: Sequence[tuple[int, ...]], max_length: int, progress: bool = False) -> None:
        """Tokenize the concatenations not cached yet and compute the full model's answer for each."""
        todo = sorted({c for c in combos if len(c) > 1 and c not in self.answers})
        if not todo:
            return
        assert self.pool.tokenizer is not None and self.pool.texts is not None
        texts = [JOINER.join(self.pool.texts[i] for i in c) for c in todo]
        ids = [e.ids for e in self.pool.tokenizer.encode_batch(texts)]
        for combo, tokens in zip(todo, ids):
            if len(tokens) > max_length:
                raise InputError(
                    f"held-out texts {list(combo)} joined tokenize to {len(tokens)} tokens, over the largest bucket "
                    f"({max_length}): this tokenizer does not split on the joiner {JOINER!r}, so texts cannot be "
                    f"concatenated into long inputs; bench with --length-mode scale"
                )
        preds = self._run(ids, progress)
        for combo, pred, tokens in zip(todo, preds, ids):
            self.answers[combo] = int(pred)
            self.lengths[combo] = len(tokens)


def build_inputs(
    pool: HeldoutPool,
    target_lengths: Lengths,
    *,
    max_length: int,
    seed: int = 0,
    references: ReferenceCache | None = None,
    progress: bool = False,
    binary: bool = False,
) -> RequestInputs:
    """Request bodies for the trace's lengths (text models) or held-out inputs in seeded order (fixed-size);
    with `binary`, in the binary tensor extension's form (see the module's docstring)."""
    targets = np.asarray(target_lengths, dtype=np.int64)
    labels = pool.manifest.labels
    if pool.arrays is not None:
        return _named_inputs(pool, targets, seed, binary)
    assert pool.texts is not None and pool.lengths is not None
    parts = match_lengths(targets, pool.lengths, max_length, seed)
    references = references or ReferenceCache(pool)
    references.resolve(parts, max_length, progress)
    requests: list[tuple[bytes, dict[str, str]]] = []
    lengths: list[int] = []
    reference: list[str] = []
    truth: list[str | None] = []
    for combo in parts:
        if len(combo) == 1:
            (p,) = combo
            requests.append(_request(None, pool.texts[p], binary))
            lengths.append(int(pool.lengths[p]))
            reference.append(labels[int(pool.full_pred[p])])
            truth.append(labels[int(pool.labels[p])])
        else:
            requests.append(_request(None, JOINER.join(pool.texts[i] for i in combo), binary))
            lengths.append(references.lengths[combo])
            reference.append(labels[references.answers[combo]])
            truth.append(None)
    return RequestInputs(
        [body for body, _ in requests],
        targets,
        np.asarray(lengths, dtype=np.int64),
        parts,
        reference,
        truth,
        headers=[extra for _, extra in requests] if binary else [],
    )


def check_labels(pool: HeldoutPool, served_labels: Sequence[str]) -> None:
    """The router must serve the bundle's labels, in order, or references would be compared wrongly."""
    if list(served_labels) != list(pool.manifest.labels):
        raise BundleError(
            f"{pool.directory}: the bundle's labels {pool.manifest.labels} differ from the router's {list(served_labels)}; "
            f"bench with the bundle the router serves"
        )
