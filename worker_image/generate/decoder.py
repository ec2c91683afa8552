"""Early-exit generation over an explicit KV cache (EE-LLM): the decoder runtime and KV recomputation.
(Not to be confused with `classify/decode.py`, which decodes classification request bodies.)

`DecoderModel` runs the blocks of a generative bundle (`bundle.yaml` with a `decoder` section) through
ONNX Runtime, one session per block and per head, every axis free: a block call takes the hidden states
(or token ids) of some new positions plus its layer's cache and returns their hidden states and the
cache extended by them.

`RecomputeEngine` is EE-LLM's KV recomputation in one worker. A token that exits after block k leaves
no cache entries in the blocks after k; its hidden state after block k is kept, and the next forward
pass batches every such position together with the new token from the first block that lacks them,
so the cache fills again in position order while the new token goes deeper. When `max_pending`
positions lack the last block's entries, the next token takes a full pass (no exit) that fills them
all. With a threshold of 1.0 no token exits and decoding is plain greedy decoding with a full cache.

Only numpy, onnxruntime and exitplan.api here: this module runs inside worker pods.
"""

from __future__ import annotations

import codecs
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exitplan.api.bundle import BundleError, BundleManifest, DecoderSpec, RampSpec, read_manifest
from exitplan.api.resources import Task

NEVER_EXIT = 1.0
"""A threshold of 1.0 or more disables early exits: every token runs the full model."""


class GenerationError(ValueError):
    """A generation request that cannot run (bad prompt, limits); the message says what to change."""


# ------------------------------------------------------------------------------------ tokenizer


class TextCodec:
    """Text <-> token ids as the bundle declares: `bytes` (UTF-8 bytes + specials) or a tokenizers file."""

    def __init__(self, directory: Path, manifest: BundleManifest) -> None:
        spec = manifest.decoder
        assert spec is not None
        self.bos, self.eos = spec.bos_token_id, spec.eos_token_id
        self.kind = spec.tokenizer
        self._tokenizer = None
        if self.kind == "tokenizers":
            if not manifest.tokenizer:
                raise BundleError(
                    f"{directory}/bundle.yaml: decoder.tokenizer is 'tokenizers' but no tokenizer file is named"
                )
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(directory / manifest.tokenizer))

    def encode(self, text: str) -> list[int]:
        ids = (
            list(text.encode("utf-8"))
            if self._tokenizer is None
            else self._tokenizer.encode(text, add_special_tokens=False).ids
        )
        return ([self.bos] if self.bos is not None else []) + ids

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns generated ids into text pieces as they come (multi-byte characters wait for their last byte)."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._text = ""

    def feed(self, token: int) -> str:
        if token == self.codec.eos or token == self.codec.bos:
            return ""
        if self.codec._tokenizer is None:
            return self._bytes.decode(bytes([token])) if 0 <= token < 256 else ""
        self._ids.append(token)
        text = self.codec._tokenizer.decode(self._ids)
        piece, self._text = text[len(self._text) :], text
        return piece


# ------------------------------------------------------------------------------------ the model


@dataclass
class FullForward:
    """One sequence through every block with an empty cache: what a full forward writes."""

    logits: dict[str, np.ndarray]
    """Per head name: [positions, vocab]."""
    keys: list[np.ndarray]
    values: list[np.ndarray]


class DecoderModel:
    """ONNX Runtime sessions for blocks [first_block, last_block] of a generative bundle and their heads."""

    def __init__(
        self,
        directory: str | Path,
        *,
        first_block: int = 0,
        last_block: int | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int = 1,
    ) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.spec: DecoderSpec = self._check_manifest()
        n = len(self.manifest.blocks)
        self.first_block = first_block
        self.last_block = n - 1 if last_block is None else last_block
        if not 0 <= first_block <= self.last_block < n:
            raise BundleError(
                f"{self.directory}: block range [{first_block}, {self.last_block}] is not inside 0..{n - 1}"
            )
        self.n_blocks = n
        self.providers = tuple(providers)
        self.codec = TextCodec(self.directory, self.manifest)
        self._ramp_after: dict[int, RampSpec] = {r.after: r for r in self.manifest.ramps}
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        if threads > 1:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._blocks: dict[int, ort.InferenceSession] = {}
        self._ramps: dict[int, ort.InferenceSession] = {}
        for i in range(first_block, self.last_block + 1):
            block = self.manifest.blocks[i]
            self._blocks[i] = self._session(block.file, block.inputs, block.outputs, options, f"block {block.name!r}")
            ramp = self._ramp_after.get(i)
            if ramp is not None:
                self._ramps[i] = self._session(ramp.file, ramp.inputs, [ramp.output], options, f"head {ramp.name!r}")

    def _check_manifest(self) -> DecoderSpec:
        m, where = self.manifest, self.directory / "bundle.yaml"
        if m.decoder is None or m.task != Task.text_generation:
            raise BundleError(f"{where}: not a generative bundle (needs task: text-generation and a decoder section)")
        spec = m.decoder
        if len(spec.cache) != len(m.blocks) or [c.block for c in spec.cache] != list(range(len(m.blocks))):
            raise BundleError(
                f"{where}: decoder.cache needs one entry per block, in block order (blocks 0..{len(m.blocks) - 1})"
            )
        if len(m.labels) != spec.vocab_size:
            raise BundleError(f"{where}: {len(m.labels)} labels but decoder.vocab_size is {spec.vocab_size}")
        for i, (block, kv) in enumerate(zip(m.blocks, spec.cache)):
            extra_in = [name for name in block.inputs if name not in (kv.past_key, kv.past_value)]
            expected = [spec.token_input, spec.position_input] if i == 0 else [m.blocks[i - 1].outputs[0]]
            if sorted(extra_in) != sorted(expected) or len(block.inputs) != len(expected) + 2:
                raise BundleError(
                    f"{where}: block {block.name!r} must read {expected} plus {kv.past_key!r}, {kv.past_value!r}; it reads {block.inputs}"
                )
            if block.outputs[1:] != [kv.present_key, kv.present_value]:
                raise BundleError(
                    f"{where}: block {block.name!r} must write [hidden, {kv.present_key!r}, {kv.present_value!r}]; it writes {block.outputs}"
                )
        for ramp in m.ramps:
            if ramp.inputs != [m.blocks[ramp.after].outputs[0]]:
                raise BundleError(f"{where}: head {ramp.name!r} must read only the hidden output of block {ramp.after}")
        return spec

    def _session(
        self, rel: str, inputs: list[str], outputs: list[str], options: ort.SessionOptions, what: str
    ) -> ort.InferenceSession:
        path = self.directory / rel
        try:
            session = ort.InferenceSession(str(path), options, providers=list(self.providers))
        except Exception as err:  # onnxruntime raises several unrelated types for a bad file
            raise BundleError(f"{path}: ONNX Runtime cannot load this file ({what}): {err}") from err
        got_in = sorted(i.name for i in session.get_inputs())
        got_out = sorted(o.name for o in session.get_outputs())
        if got_in != sorted(inputs) or got_out != sorted(outputs):
            raise BundleError(
                f"{path}: {what} has inputs {got_in} and outputs {got_out}; bundle.yaml names {inputs} -> {outputs}"
            )
        return session

    # -------------------------------------------------------------------------------- running

    @property
    def heads(self) -> list[RampSpec]:
        return [self._ramp_after[i] for i in sorted(self._ramps)]

    def ramp_after(self, block: int) -> RampSpec | None:
        return self._ramp_after.get(block)

    def empty_cache(self) -> np.ndarray:
        return np.zeros((1, self.spec.num_heads, 0, self.spec.head_dim), dtype=np.float32)

    def run_block(
        self, index: int, x: np.ndarray, start: int, past_key: np.ndarray, past_value: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block `index` on new positions start.. (`x`: ids [1, q] for block 0, hidden [1, q, d] after)."""
        block, kv = self.manifest.blocks[index], self.spec.cache[index]
        feeds = {kv.past_key: past_key, kv.past_value: past_value}
        if index == 0:
            feeds[self.spec.token_input] = x
            feeds[self.spec.position_input] = np.arange(start, start + x.shape[1], dtype=np.int64)[None, :]
        else:
            feeds[self.manifest.blocks[index - 1].outputs[0]] = x
        hidden, key, value = self._blocks[index].run(block.outputs, feeds)
        return hidden, key, value

    def head_logits(self, block: int, hidden: np.ndarray) -> np.ndarray:
        """Logits [1, q, vocab] of the head after `block`."""
        ramp = self._ramp_after[block]
        logits: np.ndarray
        (logits,) = self._ramps[block].run([ramp.output], {ramp.inputs[0]: hidden})
        return logits

    def full_forward(self, ids: Sequence[int]) -> FullForward:
        """Every block and head on the whole sequence from an empty cache (the reference for cache checks)."""
        if self.first_block != 0 or self.last_block != self.n_blocks - 1:
            raise GenerationError("full_forward needs a model holding every block")
        x: np.ndarray = np.asarray([list(ids)], dtype=np.int64)
        out = FullForward({}, [], [])
        for i in range(self.n_blocks):
            x, key, value = self.run_block(i, x, 0, self.empty_cache(), self.empty_cache())
            out.keys.append(key)
            out.values.append(value)
            if i in self._ramps:
                out.logits[self._ramp_after[i].name] = self.head_logits(i, x)[0]
        return out


def confidence(logits: np.ndarray) -> tuple[int, float]:
    """(argmax token, max softmax probability) of one logits row."""
    row = logits.astype(np.float64)
    shifted = np.exp(row - row.max())
    token = int(row.argmax())
    return token, float(shifted[token] / shifted.sum())


def forward_stage(
    model: DecoderModel,
    keys: list[np.ndarray],
    values: list[np.ndarray],
    x: np.ndarray,
    start: int,
    threshold: float,
    decide: bool,
    where: str,
) -> tuple[np.ndarray, tuple[int, int, str, float, bool] | None]:
    """Run a stage's blocks (model.first_block..last_block) on `x` at position `start`, appending to the
    stage's `keys`/`values` (one per block, in place). While `decide`, the first head that is final or
    confident enough gives the decision (token, block, head, confidence, final); the blocks after it still
    run, so that every block's cache holds this position (KV compatibility). `where` names the stage in
    errors."""
    first, decision = model.first_block, None
    for block in range(first, model.last_block + 1):
        slot = block - first
        if keys[slot].shape[2] != start:
            raise GenerationError(f"{where}: block {block} holds {keys[slot].shape[2]} positions, expected {start}")
        x, keys[slot], values[slot] = model.run_block(block, x, start, keys[slot], values[slot])
        head = model.ramp_after(block)
        if decide and head is not None and (head.final or threshold < NEVER_EXIT):
            token, conf = confidence(model.head_logits(block, x[:, -1:, :])[0, -1])
            if head.final or conf >= threshold:
                decision = (token, block, head.name, conf, head.final)
                decide = False  # exited: the rest of the forward only fills the cache
    return x, decision


# ------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class TokenEvent:
    """One generated token."""

    index: int
    token_id: int
    text: str
    """The text piece this token completes (empty while a multi-byte character is incomplete)."""
    exit: str
    """Name of the head that chose it (the final head's name when it ran the full model)."""
    block: int
    confidence: float
    recomputed: int = 0
    """Positions whose missing cache entries this forward pass filled (KV recomputation)."""
    full_pass: bool = False
    """True when this token was forced through every block (pending bound reached, or the prompt)."""
    seconds: float = 0.0


def check_request(model: DecoderModel, prompt: str, max_tokens: int, threshold: float) -> list[int]:
    """The prompt's ids, or a GenerationError naming what is wrong."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenerationError("the prompt is empty; send some text in text_input")
    ids = model.codec.encode(prompt)
    context = model.spec.max_context
    if len(ids) >= context:
        raise GenerationError(
            f"the prompt is {len(ids)} tokens but the context holds {context}; shorten it to at most {context - 1} tokens"
        )
    room = context - len(ids)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= room:
        raise GenerationError(
            f"max_tokens must be an integer in 1..{room} (context {context} minus the prompt's {len(ids)} tokens), got {max_tokens!r}"
        )
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not 0.0 <= float(threshold) <= NEVER_EXIT
        or np.isnan(threshold)
    ):
        raise GenerationError(f"threshold must be a number in 0..1 (1 never exits), got {threshold!r}")
    return ids


class GenerationHandle:
    """A sequence being generated: its ids and, in the engine, its cache."""

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], max_tokens: int, threshold: float, ignore_eos: bool = False) -> None:
        self.id = next(self._ids)
        self.ignore_eos = ignore_eos
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.threshold = float(threshold)
        self.generated: list[int] = []
        self.finished = False
        self.finish_reason = ""
        self.decoder: StreamDecoder | None = None
        """Turns this sequence's tokens into text (engines that keep no other per-sequence state use it)."""


class EngineBase(ABC):
    """What both modes share: open a sequence, step it token by token, release its cache."""

    mode = "base"

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self._lock = threading.Lock()

    @property
    @abstractmethod
    def active_caches(self) -> int:
        """Sequences whose cache is held."""

    @abstractmethod
    def open(self, prompt: str, max_tokens: int, threshold: float, ignore_eos: bool = False) -> GenerationHandle:
        """Check the request and allocate the sequence's cache (GenerationError on bad input)."""

    @abstractmethod
    def step(self, handle: GenerationHandle) -> TokenEvent:
        """Decode the sequence's next token."""

    @abstractmethod
    def release(self, handle: GenerationHandle) -> None:
        """Free the sequence's cache (idempotent)."""

    @abstractmethod
    def snapshot(self, handle: GenerationHandle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every block's cache (keys, values) [1, heads, filled positions, head_dim] once pending work is done."""

    def _finish(self, handle: GenerationHandle, token: int) -> None:
        handle.generated.append(token)
        handle.ids.append(token)
        if token == self.model.spec.eos_token_id and not handle.ignore_eos:
            handle.finished, handle.finish_reason = True, "eos"
        elif len(handle.generated) >= handle.max_tokens:
            handle.finished, handle.finish_reason = True, "length"

    def generate(
        self, prompt: str, max_tokens: int, threshold: float, ignore_eos: bool = False
    ) -> Iterator[TokenEvent]:
        """Tokens one by one; the cache is released when the generator ends or is closed."""
        handle = self.open(prompt, max_tokens, threshold, ignore_eos)
        try:
            while not handle.finished:
                yield self.step(handle)
        finally:
            self.release(handle)


# ------------------------------------------------------------------------------------ KV recomputation


@dataclass
class _Cache:
    keys: list[np.ndarray]
    values: list[np.ndarray]
    stored: dict[int, np.ndarray] = field(default_factory=dict)
    """block -> hidden outputs [1, n, d] of the positions whose deepest block is that one."""
    decoder: StreamDecoder | None = None

    def length(self, block: int) -> int:
        return int(self.keys[block].shape[2])


class RecomputeEngine(EngineBase):
    """EE-LLM's KV recomputation in one worker (see the module docstring)."""

    mode = "recompute"

    def __init__(self, model: DecoderModel, *, max_pending: int = 8) -> None:
        super().__init__(model)
        if model.first_block != 0 or model.last_block != model.n_blocks - 1:
            raise GenerationError("KV recomputation runs the whole model in one worker; load every block")
        if max_pending < 1:
            raise GenerationError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._caches: dict[int, _Cache] = {}

    @property
    def active_caches(self) -> int:
        return len(self._caches)

    def open(self, prompt: str, max_tokens: int, threshold: float, ignore_eos: bool = False) -> GenerationHandle:
        ids = check_request(self.model, prompt, max_tokens, threshold)
        return self.open_ids(ids, max_tokens, threshold, ignore_eos)

    def open_ids(self, ids: list[int], max_tokens: int, threshold: float, ignore_eos: bool = False) -> GenerationHandle:
        """A sequence from token ids already checked (a stage server: the coordinator checked the request)."""
        if not ids or len(ids) + max_tokens > self.model.spec.max_context:
            raise GenerationError(
                f"{len(ids)} prompt ids + {max_tokens} tokens do not fit the context of {self.model.spec.max_context}"
            )
        handle = GenerationHandle(list(ids), max_tokens, threshold, ignore_eos)
        empty = [self.model.empty_cache() for _ in range(self.model.n_blocks)]
        with self._lock:
            self._caches[handle.id] = _Cache(list(empty), list(empty), decoder=self.model.codec.stream())
        return handle

    def cache_lists(self, handle: GenerationHandle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The sequence's live per-block key and value lists (updated in place by each step)."""
        cache = self._caches[handle.id]
        return cache.keys, cache.values

    def release(self, handle: GenerationHandle) -> None:
        with self._lock:
            self._caches.pop(handle.id, None)

    def snapshot(self, handle: GenerationHandle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        cache = self._caches[handle.id]
        return list(cache.keys), list(cache.values)

    def pending(self, handle: GenerationHandle) -> int:
        """Positions that lack the last block's cache entries."""
        cache = self._caches[handle.id]
        return cache.length(0) - cache.length(self.model.n_blocks - 1)

    def step(self, handle: GenerationHandle) -> TokenEvent:
        if handle.finished:
            raise GenerationError("this sequence has finished")
        cache = self._caches.get(handle.id)
        if cache is None:
            raise GenerationError("this sequence's cache was released")
        started = time.perf_counter()
        if cache.length(0) == 0:  # the prompt: one full pass fills every block's cache
            new, full = handle.ids, True
        else:
            new, full = handle.ids[-1:], self.pending(handle) >= self.max_pending
        token, block, conf, recomputed = self._forward(cache, new, handle.threshold, full)
        self._finish(handle, token)
        head = self.model.ramp_after(block)
        assert head is not None and cache.decoder is not None
        return TokenEvent(
            index=len(handle.generated) - 1,
            token_id=token,
            text=cache.decoder.feed(token),
            exit=head.name,
            block=block,
            confidence=conf,
            recomputed=recomputed,
            full_pass=full or head.final,
            seconds=time.perf_counter() - started,
        )

    def _forward(self, cache: _Cache, new: list[int], threshold: float, full: bool) -> tuple[int, int, float, int]:
        model = self.model
        start = cache.length(0)
        end = start + len(new)
        x: np.ndarray = np.asarray([new], dtype=np.int64)
        recomputed = 0
        for block in range(model.n_blocks):
            first = cache.length(block)
            if block > 0:
                kept = cache.stored.pop(block - 1, None)  # positions whose deepest block is block - 1
                if kept is not None:
                    x = np.concatenate([kept, x], axis=1)
            assert x.shape[1] == end - first, "cache layout broken: positions out of order"
            x, cache.keys[block], cache.values[block] = model.run_block(
                block, x, first, cache.keys[block], cache.values[block]
            )
            recomputed = max(recomputed, end - first - len(new))
            head = model.ramp_after(block)
            if head is None or not (head.final or (not full and threshold < NEVER_EXIT)):
                continue  # exit heads cost time only when they may answer
            token, conf = confidence(model.head_logits(block, x[:, -1:, :])[0, -1])
            if head.final or conf >= threshold:
                if not head.final:
                    previous = cache.stored.get(block)
                    cache.stored[block] = x if previous is None else np.concatenate([previous, x], axis=1)
                return token, block, conf, recomputed
        raise AssertionError("the last block has no final head")  # the manifest validator guarantees one


def full_greedy(
    model: DecoderModel,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    step_seconds: list[float] | None = None,
) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """Plain greedy decoding with a full KV cache (every token through every block, final head only).

    Returns (generated ids, keys, values): the reference both early-exit modes must match at threshold 1.
    `step_seconds`, when given, receives each token's time (the first one includes the prompt).
    """
    final = model.manifest.final_ramp()
    keys = [model.empty_cache() for _ in range(model.n_blocks)]
    values = list(keys)
    generated: list[int] = []
    new = list(prompt_ids)
    start = 0
    while len(generated) < max_tokens:
        started = time.perf_counter()
        x: np.ndarray = np.asarray([new], dtype=np.int64)
        for block in range(model.n_blocks):
            x, keys[block], values[block] = model.run_block(block, x, start, keys[block], values[block])
        start += len(new)
        token = int(model.head_logits(final.after, x[:, -1:, :])[0, -1].argmax())
        generated.append(token)
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - started)
        if token == model.spec.eos_token_id and not ignore_eos:
            break
        new = [token]
    return generated, keys, values
