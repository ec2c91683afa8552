"""EE-LLM's pipeline-based early-exit generation across split stages.

The blocks are split into contiguous stages, each a `StageWorker` with its own ONNX sessions, its own
slice of every sequence's KV cache and its own thread with a FIFO queue. A token enters the first
stage and goes stage by stage. When a head inside a stage is confident, the token is answered at once
(the coordinator hands the next token to the first stage), while this stage and the later ones keep
running the exited token's forward without heads, only to write its cache entries. The FIFO order of
every stage guarantees that a stage writes a token's entries before it runs the next token, so every
block's cache is always complete: no recomputation is ever needed, and a threshold of 1.0 gives plain
greedy decoding.

In-process stages (threads; ONNX Runtime releases the GIL, so stages overlap on separate cores).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exitplan.api.plan import even_ranges
from exitplan.worker_image.generate.decoder import (
    NEVER_EXIT,
    DecoderModel,
    EngineBase,
    GenerationError,
    GenerationHandle,
    StreamDecoder,
    TokenEvent,
    check_request,
    forward_stage,
)


@dataclass
class _Decision:
    token: int
    block: int
    head: str
    confidence: float
    final: bool


class _Sequence:
    """Coordinator-side state of one sequence: replies, work in flight, cancellation."""

    def __init__(self, handle: GenerationHandle, decoder: StreamDecoder) -> None:
        self.handle = handle
        self.decoder = decoder
        self.replies: queue.Queue[_Decision | BaseException] = queue.Queue()
        self.inflight = 0
        self.idle = threading.Condition()
        self.cancelled = False

    def add_work(self) -> None:
        with self.idle:
            self.inflight += 1

    def done_work(self) -> None:
        with self.idle:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.inflight == 0, timeout)


@dataclass
class _Work:
    seq: _Sequence
    start: int
    x: np.ndarray
    decide: bool
    threshold: float


class StageWorker:
    """Blocks [first, last] with their heads, a cache slice per sequence and a worker thread."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.next: StageWorker | None = None
        self.caches: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._loop, name=f"stage-{model.first_block}-{model.last_block}", daemon=True
        )
        self._thread.start()

    def submit(self, work: _Work) -> None:
        work.seq.add_work()
        self._queue.put(work)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def add(self, seq_id: int) -> None:
        n = self.model.last_block - self.model.first_block + 1
        with self._lock:
            self.caches[seq_id] = ([self.model.empty_cache()] * n, [self.model.empty_cache()] * n)

    def drop(self, seq_id: int) -> None:
        with self._lock:
            self.caches.pop(seq_id, None)

    def _loop(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                if not work.seq.cancelled:
                    self._run(work)
            except BaseException as err:  # answered to the waiting coordinator, never lost in the thread
                work.seq.cancelled = True
                work.seq.replies.put(err)
            finally:
                work.seq.done_work()

    def _run(self, work: _Work) -> None:
        model = self.model
        keys, values = self.caches[work.seq.handle.id]
        x, decision = forward_stage(
            model,
            keys,
            values,
            work.x,
            work.start,
            work.threshold,
            work.decide,
            f"stage {model.first_block}-{model.last_block}",
        )
        if decision is not None:
            work.seq.replies.put(_Decision(*decision))
        if self.next is not None:
            self.next.submit(_Work(work.seq, work.start, x, work.decide and decision is None, work.threshold))


def even_stages(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges of near-equal size (the first stages take the extra blocks)."""
    if not 1 <= stages <= n_blocks:
        raise GenerationError(f"stages must be within 1..{n_blocks} (the bundle's blocks), got {stages}")
    return even_ranges(n_blocks, stages)


class PipelineEngine(EngineBase):
    """Pipeline-based early-exit generation over in-process stages (see the module docstring)."""

    mode = "pipeline"

    def __init__(self, directory: str | Path, splits: Sequence[tuple[int, int]] | int = 2, *, threads: int = 1) -> None:
        full = DecoderModel(directory, threads=threads)
        super().__init__(full)
        ranges = even_stages(full.n_blocks, splits) if isinstance(splits, int) else [tuple(r) for r in splits]
        if (
            not ranges
            or ranges[0][0] != 0
            or ranges[-1][1] != full.n_blocks - 1
            or any(a[1] + 1 != b[0] for a, b in zip(ranges, ranges[1:]))
        ):
            raise GenerationError(f"splits {ranges} must cover blocks 0..{full.n_blocks - 1} contiguously, in order")
        self.splits = ranges
        self.stages = [
            StageWorker(DecoderModel(directory, first_block=a, last_block=b, threads=threads)) for a, b in ranges
        ]
        for stage, nxt in zip(self.stages, self.stages[1:]):
            stage.next = nxt
        self._sequences: dict[int, _Sequence] = {}

    @property
    def active_caches(self) -> int:
        ids: set[int] = set()
        for stage in self.stages:
            with stage._lock:
                ids.update(stage.caches)
        return len(ids | set(self._sequences))

    def close(self) -> None:
        for stage in self.stages:
            if stage._thread.is_alive():
                stage.stop()

    def open(self, prompt: str, max_tokens: int, threshold: float, ignore_eos: bool = False) -> GenerationHandle:
        ids = check_request(self.model, prompt, max_tokens, threshold)
        handle = GenerationHandle(ids, max_tokens, threshold, ignore_eos)
        with self._lock:
            self._sequences[handle.id] = _Sequence(handle, self.model.codec.stream())
        for stage in self.stages:
            stage.add(handle.id)
        return handle

    def release(self, handle: GenerationHandle) -> None:
        with self._lock:
            seq = self._sequences.pop(handle.id, None)
        if seq is not None:
            seq.cancelled = True  # queued work for it is skipped
            seq.replies.put(GenerationError("the sequence was released"))  # wakes a step waiting for a reply
            seq.wait_idle()
        for stage in self.stages:
            stage.drop(handle.id)

    def snapshot(self, handle: GenerationHandle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        self._sequences[handle.id].wait_idle()
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for stage in self.stages:
            k, v = stage.caches[handle.id]
            keys += k
            values += v
        return keys, values

    def step(self, handle: GenerationHandle) -> TokenEvent:
        seq = self._sequences.get(handle.id)
        if seq is None or seq.cancelled:
            raise GenerationError("this sequence's cache was released")
        if handle.finished:
            raise GenerationError("this sequence has finished")
        started = time.perf_counter()
        prompt = not handle.generated
        new = handle.ids if prompt else handle.ids[-1:]
        start = len(handle.ids) - len(new)
        threshold = NEVER_EXIT if prompt else handle.threshold  # the prompt fills every block's cache
        self.stages[0].submit(_Work(seq, start, np.asarray([new], dtype=np.int64), True, threshold))
        reply = seq.replies.get()
        if isinstance(reply, BaseException):
            raise reply
        self._finish(handle, reply.token)
        return TokenEvent(
            index=len(handle.generated) - 1,
            token_id=reply.token,
            text=seq.decoder.feed(reply.token),
            exit=reply.head,
            block=reply.block,
            confidence=reply.confidence,
            full_pass=reply.final,
            seconds=time.perf_counter() - started,
        )
