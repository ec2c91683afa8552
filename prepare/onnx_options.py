"""The options of `exitplan prepare --onnx` (and of --torch and --hf, which end there), checked, with
the digest that decides whether a finished bundle can be reused and the model identity that decides
whether `--out` may be overwritten without `--force`."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exitplan.prepare.build import PrepareError

__all__ = ["FORMAT_VERSION", "OnnxOptions", "bundle_name", "tokenizer_file"]

FORMAT_VERSION = 3
"""Bump when the pipeline's output changes, so bundles built before are rebuilt."""


@dataclass(frozen=True)
class OnnxOptions:
    model: str
    """Path of the ONNX classifier."""
    data: str
    """Path of DATA.npz."""
    labels: str | None = None
    """File with one class name a line (default: 0..C-1)."""
    name: str | None = None
    """Model name (default: the model file's stem, lower-cased)."""
    output: str | None = None
    """The model output to serve (default: the one named like logits, else the only one of rank 2)."""
    max_ramps: int = 3
    candidates: int = 8
    """Cut vertices tried as ramp locations (spread by cumulative compute)."""
    cuts: tuple[str, ...] = ()
    """Tensor names to place ramps at, instead of the automatic choice."""
    seq_axis: int | None = -1
    """Sequence axis of the inputs; -1: detect (integer [N, L] inputs are token sequences); None: none."""
    budget: float = 0.01
    """Accuracy budget the placement tunes thresholds to (agreement with the model's own answers)."""
    ramp_hidden: int = 0
    """0: linear ramps; > 0: an MLP with one hidden layer of this width."""
    overhead_frac: float = 0.05
    """The kept ramps together cost at most this fraction of a whole-model pass (in FLOPs)."""
    heldout_fraction: float = 0.25
    heldout_last: int = 0
    """> 0: the data's last `heldout_last` rows are the held-out rows (split beforehand, e.g. stratified),
    instead of a random `heldout_fraction` of them."""
    tolerance: float = 1e-4
    seed: int = 0
    tokenizer: str | None = None
    """A `tokenizers` JSON file (or a directory holding tokenizer.json), copied into the bundle (no padding,
    no truncation) so the router takes texts."""
    pad_token_id: int | None = None
    """The token id that pads token sequences (default: the tokenizer's pad token, else 0)."""
    texts: str | None = None
    """A JSON file with a list of texts, the text of each data row (with `tokenizer`): held-out rows keep theirs."""
    source: str | None = None
    """What reports call the model (default: the model file)."""
    extras: tuple[str, ...] = ()
    """Files copied into the bundle's data/ folder as they are (e.g. a head trained by --hf, for references)."""
    fingerprint: str = field(default="", compare=False)
    """sha256 of the model and data files (set by `resolved`), so a changed file rebuilds."""

    def files(self) -> tuple[str | None, ...]:
        return (self.model, self.data, self.labels, self.tokenizer, self.texts)

    def resolved(self) -> OnnxOptions:
        tokenizer = tokenizer_file(self.tokenizer) if self.tokenizer is not None else None
        checked = OnnxOptions(**{**asdict(self), "tokenizer": tokenizer})
        for what, path in zip(("onnx", "data", "labels", "tokenizer", "texts"), checked.files(), strict=True):
            if path is not None and not Path(path).is_file():
                raise PrepareError(f"--{what} {path}: no such file")
        missing = [path for path in self.extras if not Path(path).is_file()]
        if missing:
            raise PrepareError(f"extra bundle files {missing}: no such file")
        if self.max_ramps < 0 or self.candidates < 1:
            raise PrepareError(f"--max-ramps ({self.max_ramps}) must be >= 0 and candidates ({self.candidates}) >= 1")
        if not 0.0 < self.heldout_fraction < 1.0 or not 0.0 <= self.budget < 1.0:
            raise PrepareError("the held-out fraction must be in (0, 1) and the accuracy budget in [0, 1)")
        digest = hashlib.sha256()
        for path in (*checked.files(), *self.extras):
            digest.update(b"-" if path is None else Path(path).read_bytes())
        resolved = {**asdict(checked), "cuts": tuple(self.cuts), "extras": tuple(self.extras)}
        return OnnxOptions(**{**resolved, "fingerprint": digest.hexdigest()[:16]})

    def digest(self) -> str:
        """The files by content (`fingerprint`), not by path: a model exported again to another temporary
        directory (--torch, --hf) reuses the bundle; the name, which may come from the path, counts."""
        paths = {"model", "data", "labels", "tokenizer", "texts"}
        options = {k: v for k, v in asdict(self).items() if k not in paths}
        options["extras"] = [Path(path).name for path in self.extras]
        payload = json.dumps(
            {"format": FORMAT_VERSION, **options, "name": bundle_name(self)}, sort_keys=True, default=str
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def identity(self) -> str:
        """The model a bundle holds, as `--out` checks it: its name and what reports call its source."""
        return f"{bundle_name(self)} ({self.source or Path(self.model).resolve()})"


def bundle_name(opts: OnnxOptions) -> str:
    """The bundle's name: --name, else the model file's stem, lower-cased, [a-z0-9-] only."""
    raw = opts.name or Path(opts.model).stem
    return re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")[:63] or "model"


def tokenizer_file(path: str) -> str:
    """--tokenizer: a `tokenizers` JSON file, or a directory holding tokenizer.json (what save_pretrained writes)."""
    where = Path(path)
    if where.is_dir():
        inside = where / "tokenizer.json"
        if not inside.is_file():
            held = sorted(p.name for p in where.iterdir())[:12]
            raise PrepareError(
                f"--tokenizer {path}: a directory without tokenizer.json (it holds {held}); pass the Hugging Face "
                "`tokenizers` file, e.g. what tokenizer.save('tokenizer.json') or save_pretrained writes"
            )
        return str(inside)
    if not where.is_file():
        raise PrepareError(f"--tokenizer {path}: no such file or directory")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(where))
    except Exception as err:  # tokenizers raises a bare Exception for any file it cannot read
        first = " ".join(str(err).split())[:200]
        raise PrepareError(
            f"--tokenizer {path}: not a Hugging Face `tokenizers` file ({first}); pass the tokenizer.json that "
            "tokenizer.save() or save_pretrained writes (a fast tokenizer)"
        ) from err
    return str(where)
