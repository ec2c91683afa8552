"""The model bundle manifest (`bundle.yaml`): blocks in order, the ramps, the tensors between them.

A bundle is a directory holding `bundle.yaml` and ONNX files. Execution keeps a *state*: a dict of
named tensors. It starts with the bundle's `inputs`; each block reads its `inputs` names from the
state and writes its `outputs` names into it; each ramp reads its `inputs` from the state right
after the block it follows and produces logits over `labels`. The ramp after the last block with
`final: true` is the model's own head: its answer is the full model's answer.

A worker runs any contiguous range of blocks with the ramps inside it; what it forwards to the next
split is the part of the state that later blocks and ramps read (see `live_after`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from exitplan.api import validation_problems, yaml_problem
from exitplan.api.dtypes import DTypeName
from exitplan.api.resources import Model, Task

DType = DTypeName
"""A tensor dtype by its numpy name (the table is `exitplan.api.dtypes`)."""


class TensorSpec(Model):
    name: str
    dtype: DType
    shape: list[int | str]
    """Dimensions; strings name free axes: "batch", and "seq" for the sequence axis."""


class BlockSpec(Model):
    name: str
    file: str
    """ONNX file, relative to the bundle directory."""
    inputs: Annotated[list[str], Field(min_length=1)]
    outputs: Annotated[list[str], Field(min_length=1)]


class RampSpec(Model):
    name: str
    after: Annotated[int, Field(ge=0)]
    """Index of the block this ramp follows."""
    file: str
    inputs: Annotated[list[str], Field(min_length=1)]
    output: str = "logits"
    final: bool = False
    """True for the model's own head after the last block (never a candidate for early exit)."""


class BundleData(Model):
    heldout: str = "data/heldout.npz"
    """Held-out labelled inputs for accuracy checks: arrays `text` (or `x`) and `label`."""


class KVCacheSpec(Model):
    """The KV cache tensors of one decoder block (layout [batch, heads, positions, head_dim])."""

    block: Annotated[int, Field(ge=0)]
    past_key: str
    """Block input: the keys of the positions already cached."""
    past_value: str
    present_key: str
    """Block output: past keys followed by the keys of the positions just computed."""
    present_value: str


class DecoderSpec(Model):
    """Autoregressive decoding (task text-generation): each block is one or more decoder layers with
    an explicit KV cache; ramps (exit heads) read a block's hidden output and give next-token logits
    [batch, seq, vocab_size] over `labels` (the vocabulary)."""

    vocab_size: Annotated[int, Field(ge=2)]
    num_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    hidden_size: Annotated[int, Field(ge=1)]
    max_context: Annotated[int, Field(ge=2)]
    """Most positions (prompt + generated tokens) a sequence may hold."""
    token_input: str = "input_ids"
    """First block's input of token ids [batch, seq] (int64)."""
    position_input: str = "position_ids"
    """First block's input of absolute positions [batch, seq] (int64)."""
    cache: Annotated[list[KVCacheSpec], Field(min_length=1)]
    """One entry per block, in block order."""
    tokenizer: Literal["bytes", "tokenizers"] = "bytes"
    """`bytes`: ids 0-255 are UTF-8 bytes, special ids above; `tokenizers`: the manifest's tokenizer file."""
    bos_token_id: int | None = None
    eos_token_id: int | None = None


class PrecisionRecord(Model):
    """How a bundle converted from its fp32 source to the precision it is served in agrees with that source
    on its held-out data (`exitplan prepare --precision`; re-checked by `exitplan check`)."""

    name: Literal["fp32", "fp16", "bf16"]
    source_dtype: DType = "float32"
    final_agreement: Annotated[float, Field(ge=0.0, le=1.0)]
    """Share of held-out inputs whose final answer is the fp32 chain's."""
    max_score_diff: Annotated[float, Field(ge=0.0)]
    """Largest difference of a final softmax score from the fp32 chain's."""
    ramp_agreement: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=dict)
    """Per exit ramp: share of held-out inputs whose ramp answer is the fp32 ramp's."""
    heldout_rows: Annotated[int, Field(ge=1)]
    checked_with: str = ""
    """The ONNX Runtime providers the converted chain ran on for the check."""


class BundleManifest(Model):
    name: str
    task: Task
    labels: Annotated[list[str], Field(min_length=2)]
    dtype: DType = "float32"
    """Dtype of activations between blocks (float16 in a bundle served in fp16)."""
    precision: PrecisionRecord | None = None
    """Set in a bundle converted from fp32 (`exitplan prepare --precision`): its agreement with the source."""
    inputs: Annotated[list[TensorSpec], Field(min_length=1)]
    blocks: Annotated[list[BlockSpec], Field(min_length=1)]
    ramps: list[RampSpec] = Field(default_factory=list)
    seq_axis: int | None = None
    """Axis of the sequence dimension in the inputs (1 for [batch, seq]); None for fixed-size inputs."""
    max_length: Annotated[int, Field(ge=1)] | None = None
    """Longest sequence the model accepts (position embeddings); required when seq_axis is set."""
    tokenizer: str | None = None
    """tokenizers JSON file for text tasks, relative to the bundle directory."""
    pad_token_id: int = 0
    source_output: str | None = None
    """The source model's output that the final ramp serves (its other outputs are not served):
    `exitplan check --source` compares the chained answer with this one."""
    data: BundleData = Field(default_factory=BundleData)
    decoder: DecoderSpec | None = None
    """Set for generative (decoder-only) bundles, for early-exit generation: the KV cache layout and tokenizer."""
    digests: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(default_factory=dict)
    """sha256 of every file of the bundle but bundle.yaml, by path relative to the bundle directory
    (`exitplan prepare` records them last; `exitplan storage-init` checks a fetched bundle against
    them). Empty in bundles prepared before digests were recorded: they load, unverified."""

    @model_validator(mode="after")
    def _consistent(self) -> BundleManifest:
        n = len(self.blocks)
        for ramp in self.ramps:
            if ramp.after >= n:
                raise ValueError(f"ramp {ramp.name!r} follows block {ramp.after} but the bundle has {n} blocks")
        finals = [r for r in self.ramps if r.final]
        if len(finals) != 1 or finals[0].after != n - 1:
            raise ValueError("exactly one ramp must be final: true, and it must follow the last block")
        if self.seq_axis is not None and self.max_length is None:
            raise ValueError("max_length is required when seq_axis is set")
        return self

    # ------------------------------------------------------------ derived views

    def exit_ramps(self) -> list[RampSpec]:
        """The early-exit ramps (not the final head), in block order."""
        return sorted((r for r in self.ramps if not r.final), key=lambda r: r.after)

    def final_ramp(self) -> RampSpec:
        return next(r for r in self.ramps if r.final)

    def ramps_in(self, first: int, last: int) -> list[RampSpec]:
        """All ramps (final included) following a block in [first, last], in block order."""
        return sorted((r for r in self.ramps if first <= r.after <= last), key=lambda r: (r.after, r.final))

    def live_after(self, block: int) -> list[str]:
        """State names that blocks/ramps after `block` read and that exist once `block` has run."""
        produced: set[str] = {t.name for t in self.inputs}
        for b in self.blocks[: block + 1]:
            produced.update(b.outputs)
        needed: list[str] = []
        for b in self.blocks[block + 1 :]:
            needed.extend(b.inputs)
        for r in self.ramps:
            if r.after > block:
                needed.extend(r.inputs)
        return [name for name in dict.fromkeys(needed) if name in produced]


class BundleError(ValueError):
    """A bundle that cannot be loaded; the message names the file or tensor at fault."""


def read_manifest(directory: str | Path) -> BundleManifest:
    """Read and validate `bundle.yaml`; every referenced file must exist."""
    root = Path(directory)
    path = root / "bundle.yaml"
    if not path.is_file():
        raise BundleError(f"{path}: no bundle.yaml here; run `exitplan prepare` or point at a bundle directory")
    try:
        manifest = BundleManifest.model_validate(yaml.safe_load(path.read_text()))
    except yaml.YAMLError as err:
        raise BundleError(f"{path}: not valid YAML: {yaml_problem(err)}") from err
    except ValidationError as err:
        raise BundleError(f"{path}: invalid manifest: {validation_problems(err)}") from err
    files = [b.file for b in manifest.blocks] + [r.file for r in manifest.ramps]
    if manifest.tokenizer:
        files.append(manifest.tokenizer)
    for rel in files:
        if not (root / rel).is_file():
            raise BundleError(f"{root / rel}: file named in {path} is missing")
    return manifest


MANIFEST = "bundle.yaml"
CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in chunks (bundles hold files of gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def bundle_files(directory: str | Path) -> list[str]:
    """Every regular file under a bundle directory but bundle.yaml, as sorted relative POSIX paths
    (symbolic links are not followed: a bundle is plain files)."""
    root = Path(directory)
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in files:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                rel = path.relative_to(root).as_posix()
                if rel != MANIFEST:
                    found.append(rel)
    return sorted(found)


def compute_digests(directory: str | Path) -> dict[str, str]:
    """{relative path: sha256} of every file of the bundle but bundle.yaml."""
    root = Path(directory)
    return {rel: file_sha256(root / rel) for rel in bundle_files(root)}


def write_manifest(directory: str | Path, manifest: BundleManifest) -> None:
    """Write `bundle.yaml` (snake_case keys, unset optionals left out), replacing it atomically."""
    path = Path(directory) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(yaml.safe_dump(manifest.model_dump(mode="json", exclude_none=True), sort_keys=False))
    os.replace(tmp, path)


def record_digests(directory: str | Path) -> BundleManifest:
    """Record the sha256 of every file of the bundle in its bundle.yaml (`digests`): the last step of
    every `exitplan prepare` path, and `exitplan bundle digest` for bundles prepared before."""
    manifest = read_manifest(directory)
    manifest = manifest.model_copy(update={"digests": compute_digests(directory)})
    write_manifest(directory, manifest)
    return manifest


def resolve_bundle_uri(uri: str) -> Path:
    """A bundle URI (a path or file:// URI) as a local directory."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    if "://" in uri:
        raise BundleError(
            f"bundle URI {uri!r}: only local paths and file:// URIs are supported here; fetch a remote bundle "
            f"into a directory first (`exitplan storage-init {uri} DIR`) and name the directory"
        )
    return Path(uri).expanduser()
