"""The bodies of the control plane, typed: each is built and parsed here, and nowhere else.

| route | body | built by | read by |
|---|---|---|---|
| `GET /v1/info` (a split worker) | `WorkerInfo` | `classify/worker.py:SplitWorker.info` | `peer_choice.py:PeerSet.refresh` |
| `POST /v1/thresholds` | `ThresholdUpdate` | `control_client.py:ControlClient.push_thresholds` | `classify/control.py`, `classify/worker_routes.py` |
| `POST /v1/feedback` (a router) | `FeedbackSample`s | `classify/feedback.py:send_feedback` | `classify/control.py:RouterControl.handle_feedback` |
| `GET /v1/window.npz[?format=safetensors]` (a router) | `FeedbackArrays` | `classify/observe.py:FeedbackRing.window` | `control_client.py:ControlClient.feedback` |

What a post may carry is bounded and checked before anything changes (`BadControl`, a 400 naming the
field): a threshold is a number in [0, 1] or "disabled" (stored as DISABLED, as the tuner writes it), for an
exit ramp of the bundle (the final head answers whatever reaches it and takes none); feedback holds at most
MAX_FEEDBACK_SAMPLES samples of the bundle's shape and ranges. The JSON is the one the untyped code wrote
(camelCase keys in /v1/info), so pods of either version read each other.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import safetensors
import safetensors.numpy
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from exitplan.worker_image.wire import ShadowRecord

DISABLED = 2.0
"""The threshold of a disabled ramp (exitplan.planner.tuning.feedback.DISABLED: any value above 1 disables)."""
MAX_THRESHOLDS_BODY = 64 << 10
MAX_FEEDBACK_BODY = 1 << 20
MAX_FEEDBACK_SAMPLES = 1024
"""Samples one feedback post may carry (a last split posts one batch's shadow-sampled rows)."""
MAX_ID_CHARS = 128
MAX_REASON_CHARS = 200


class BadControl(ValueError):
    """A control request whose content is refused (400); the message says what is wrong."""


# ---------------------------------------------------------------- GET /v1/info


class StageInfo(BaseModel):
    """One fusion queue of a split worker (one per block of the split; `classify/fusion.py`)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    first_block: int
    queued: int = 0
    batches: int = 0
    rows: int = 0
    mean_batch: float = 0.0
    survival: float = 1.0


class WorkerInfo(BaseModel):
    """What a split worker is and how it is doing: the answer of its GET /v1/info. The senders of its
    hop read split, bucket, pool, batch size, capacity and readiness (a pod of another version may send
    more or fewer keys: only split and bucket are required)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    service: str = ""
    model: str = ""
    split: int
    bucket: int
    pool: str = ""
    batch_size: int = 1
    ready: bool = False
    """Warmed up and not draining."""
    first_block: int = -1
    last_block: int = -1
    queued: int = 0
    """Rows waiting in the fusion queues."""
    served: int = 0
    thresholds: dict[str, float] = {}
    thresholds_version: int = 0
    """The version of the thresholds in force (`threshold_set.ThresholdSet`)."""
    thresholds_digest: str = ""
    rebatch: bool = False
    stages: list[StageInfo] = []
    capacity: float = 0.0
    """Inputs per second the pod (with the splits after it) can take."""
    survival: float = 1.0
    """Estimated share of the inputs entering this split that go on to the next one."""
    plan_hash: str = ""
    expected_ms: dict[str, dict[str, float]] = {}
    """Per fitted length, the service-time fit (a + b x batch, ms)."""
    mean_length: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The JSON-able body (camelCase keys, as every version wrote them)."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def parse(cls, body: bytes) -> WorkerInfo:
        """The info in a /v1/info answer; pydantic's ValidationError (a ValueError) when it is not one."""
        return cls.model_validate_json(body)


# ---------------------------------------------------------------- POST /v1/thresholds


def threshold_value(ramp: str, value: Any) -> float:
    if value == "disabled":
        return DISABLED
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadControl(f'threshold of {ramp!r} must be a number in [0, 1] or "disabled", got {value!r}'[:300])
    v = float(value)
    if not (0.0 <= v <= 1.0 or v == DISABLED):
        raise BadControl(f'threshold of {ramp!r} must be within [0, 1] (or "disabled"), got {value!r}'[:300])
    return v


@dataclass(frozen=True, slots=True)
class ThresholdUpdate:
    """A hot threshold update: `{"thresholds": {ramp: value}, "reason": ..., "replace": false,
    "version": n}`. Without `replace` the ramps named are merged into the set in force; without a
    version the change is the next version of the set in force (`threshold_set.ThresholdSet.changed`)."""

    thresholds: dict[str, float]
    reason: str = "api"
    """Free text for the log (a metric label takes one of `metrics.UPDATE_REASONS` or "other")."""
    replace: bool = False
    version: int | None = None
    """The version this set is (the tuner's, a peer router's forward); taken only when newer."""

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"thresholds": self.thresholds, "reason": self.reason, "replace": self.replace}
        if self.version is not None:
            body["version"] = self.version
        return body

    @classmethod
    def parse(cls, body: Any, exit_ramps: Sequence[str], final: str) -> ThresholdUpdate:
        """The update a post carries; BadControl when a name is not an exit ramp of the bundle or a
        value is out of range."""
        if not isinstance(body, dict) or not isinstance(body.get("thresholds"), dict):
            raise BadControl('send {"thresholds": {ramp: value in [0, 1] or "disabled"}, "reason": "..."}')
        given: dict[Any, Any] = body["thresholds"]
        if final in given:
            raise BadControl(
                f"{final!r} is the final head: it answers every input that reaches it and takes no threshold"
            )
        unknown = sorted(str(k) for k in given if k not in exit_ramps)
        if unknown:
            raise BadControl(f"unknown ramps {unknown[:8]}; the bundle's exit ramps are {list(exit_ramps)}"[:400])
        reason = body.get("reason", "api")
        if not isinstance(reason, str):
            raise BadControl(f"reason must be a string, got {type(reason).__name__}")
        replace, version = body.get("replace", False), body.get("version")
        if not isinstance(replace, bool):
            raise BadControl(f"replace must be true or false, got {replace!r}"[:200])
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise BadControl(f"version must be a positive integer (or left out), got {version!r}"[:200])
        values = {str(k): threshold_value(str(k), v) for k, v in given.items()}
        return cls(values, reason[:MAX_REASON_CHARS], replace, version)


# ---------------------------------------------------------------- POST /v1/feedback


def _index(value: Any, n: int) -> TypeGuard[int]:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < n


@dataclass(frozen=True, slots=True)
class FeedbackSample:
    """One shadow-sampled input's complete feedback: the full model's answer and, per exit ramp of the
    bundle (in block order), the confidence and answer there (None where no split ran the ramp on it)."""

    id: str
    final: int
    conf: list[float | None]
    pred: list[int | None]

    @classmethod
    def of(cls, id: str, rec: ShadowRecord, exit_ramps: Sequence[str]) -> FeedbackSample | None:
        """The sample of a row's shadow record; None until the final head ran on it."""
        if rec.final is None:
            return None
        return cls(id, rec.final, [rec.conf.get(r) for r in exit_ramps], [rec.pred.get(r) for r in exit_ramps])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "final": self.final, "conf": self.conf, "pred": self.pred}

    @classmethod
    def parse(cls, s: Any, n_ramps: int, n_labels: int) -> FeedbackSample:
        if not isinstance(s, dict):
            raise BadControl("a sample must be an object {id, final, conf, pred}")
        id_, final, conf, pred = s.get("id"), s.get("final"), s.get("conf"), s.get("pred")
        if not isinstance(id_, str) or not 0 < len(id_) <= MAX_ID_CHARS:
            raise BadControl(f"id must be a string of 1..{MAX_ID_CHARS} characters")
        if not _index(final, n_labels):
            raise BadControl(f"final must be a class index in [0, {n_labels})")
        if not isinstance(conf, list) or not isinstance(pred, list) or len(conf) != n_ramps or len(pred) != n_ramps:
            raise BadControl(f"conf and pred must be lists with one entry per exit ramp ({n_ramps})")
        for c in conf:
            if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0):
                raise BadControl("conf entries must be confidences in [0, 1] (or null)")
        if any(p is not None and not _index(p, n_labels) for p in pred):
            raise BadControl(f"pred entries must be class indices in [0, {n_labels}) (or null)")
        return cls(id_, final, conf, pred)


def feedback_post(samples: Sequence[FeedbackSample]) -> dict[str, Any]:
    """The body of a POST /v1/feedback."""
    return {"samples": [s.to_json() for s in samples]}


def parse_feedback(body: Any, n_ramps: int, n_labels: int) -> list[FeedbackSample]:
    """The samples of a ``{"samples": [...]}`` post; BadControl naming the first wrong one."""
    samples = body.get("samples") if isinstance(body, dict) else None
    if not isinstance(samples, list):
        raise BadControl('send {"samples": [{"id", "final", "conf", "pred"}, ...]}')
    if len(samples) > MAX_FEEDBACK_SAMPLES:
        raise BadControl(f"{len(samples)} samples in one post; at most {MAX_FEEDBACK_SAMPLES}")
    out = []
    for i, s in enumerate(samples):
        try:
            out.append(FeedbackSample.parse(s, n_ramps, n_labels))
        except BadControl as err:
            raise BadControl(f"samples[{i}]: {err}") from None
    return out


# ---------------------------------------------------------------- GET /v1/window.npz


@dataclass(frozen=True)
class FeedbackArrays:
    """A router's newest shadow-sampled feedback samples, in the window format of `exitplan tune`
    (`exitplan.planner.tuning.feedback.FeedbackWindow` takes these five arrays in this order)."""

    conf: np.ndarray
    """[N, R] float: each sample's confidence at each exit ramp."""
    pred: np.ndarray
    """[N, R] int: each sample's answer at each exit ramp."""
    final: np.ndarray
    """[N] int: the full model's answer."""
    saving_ms: np.ndarray
    """[R] float: latency saved by exiting at each ramp (the bundle's calibration window)."""
    cost_ms: np.ndarray
    """[R] float: each ramp's overhead."""
    added: int | None = None
    """The number of the newest sample: how many the router's ring stored since it started (a router's answer;
    None in a window file, or from a router that predates it)."""
    ring: str | None = None
    """The router ring's identity, new at each start: sample numbers count within one ring only."""

    def to_npz(self) -> bytes:
        buf = io.BytesIO()
        arrays: dict[str, np.ndarray] = {
            "conf": self.conf,
            "pred": self.pred,
            "final": self.final,
            "saving_ms": np.asarray(self.saving_ms, np.float64),
            "cost_ms": np.asarray(self.cost_ms, np.float64),
        }
        if self.added is not None and self.ring is not None:  # a router's answer: its ring's numbers
            arrays.update(added=np.asarray(self.added), ring=np.asarray(self.ring))
        np.savez(buf, allow_pickle=False, **arrays)  # (numpy >= 2.1: the pin)
        return buf.getvalue()

    def to_safetensors(self) -> bytes:
        """The arrays as a safetensors body (`?format=safetensors`): what the operator asks a router for, since
        its arrays parse in tens of microseconds where an npz's members cost about a millisecond a window (a zip
        directory and a Python-literal header per member; BENCHMARKS.md, issue 31). The ring's numbers as two
        more tensors: `added` ([1] int64) and `ring` (its identity's UTF-8 bytes)."""
        arrays: dict[str, np.ndarray] = {
            "conf": np.ascontiguousarray(self.conf),
            "pred": np.ascontiguousarray(self.pred),
            "final": np.ascontiguousarray(self.final),
            "saving_ms": np.asarray(self.saving_ms, np.float64),
            "cost_ms": np.asarray(self.cost_ms, np.float64),
        }
        if self.added is not None and self.ring is not None:
            arrays.update(added=np.asarray([self.added], np.int64), ring=np.frombuffer(self.ring.encode(), np.uint8))
        return bytes(safetensors.numpy.save(arrays))

    @classmethod
    def from_body(cls, body: bytes) -> FeedbackArrays:
        """A /v1/window.npz answer in either format: an npz (a zip: a router that predates `?format=`, or one
        asked for the default) or a safetensors body; ValueError, KeyError or OSError when it is neither."""
        if body[:4] == b"PK\x03\x04":
            return cls.from_npz(body)
        try:
            data = safetensors.numpy.load(body)
        except safetensors.SafetensorError as err:
            raise ValueError(f"neither an npz nor a safetensors body: {err}") from None
        cursor: tuple[int | None, str | None] = (None, None)
        if "added" in data and "ring" in data:
            cursor = (int(data["added"].reshape(-1)[0]), data["ring"].tobytes().decode())
        return cls(data["conf"], data["pred"], data["final"], data["saving_ms"], data["cost_ms"], *cursor)

    @classmethod
    def from_npz(cls, body: bytes) -> FeedbackArrays:
        """The arrays of a /v1/window.npz body; ValueError, KeyError or OSError when it is not one."""
        with np.load(io.BytesIO(body)) as data:
            cursor = (int(data["added"]), str(data["ring"])) if "added" in data and "ring" in data else (None, None)
            return cls(data["conf"], data["pred"], data["final"], data["saving_ms"], data["cost_ms"], *cursor)
