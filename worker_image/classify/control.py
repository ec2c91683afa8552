"""The router's control endpoints, and the checks on what control requests carry.

Every route here sits behind the service's control token (`exitplan.worker.auth`), on the router's
control port (``--control-port``) or, without one, on its inference port:

- ``GET  /v1/thresholds``, ``POST /v1/thresholds``: the exit thresholds in force / a hot update,
  pushed to every split-0 pod (which forward it down the chain);
- ``POST /v1/feedback``: shadow-sampled feedback samples from the last split;
- ``GET  /v1/observations[?window=current]``, ``GET /v1/window.npz?last=N``, ``GET /v1/peers``.

What a post may carry is bounded and checked before anything changes: a threshold is a number in
[0, 1] or "disabled" (stored as DISABLED, as the tuner writes it), for an exit ramp of the bundle (the
final head answers whatever reaches it and takes none); feedback holds at most MAX_FEEDBACK_SAMPLES
samples of the bundle's shape and ranges, and only samples of inputs this router shadow-sampled
count. The free-text `reason` of a threshold update goes to the log, never into a metric label.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from exitplan.worker.auth import json_body
from exitplan.worker.protocol import error_response

if TYPE_CHECKING:
    from exitplan.worker.classify.router import Router

log = logging.getLogger(__name__)

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


def threshold_value(ramp: str, value: Any) -> float:
    if value == "disabled":
        return DISABLED
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadControl(f'threshold of {ramp!r} must be a number in [0, 1] or "disabled", got {value!r}'[:300])
    v = float(value)
    if not (0.0 <= v <= 1.0 or v == DISABLED):
        raise BadControl(f'threshold of {ramp!r} must be within [0, 1] (or "disabled"), got {value!r}'[:300])
    return v


def parse_thresholds(body: Any, exit_ramps: list[str], final: str) -> tuple[dict[str, float], str]:
    """(thresholds, reason) of a ``{"thresholds": {ramp: value}, "reason": ...}`` post; BadControl
    when a name is not an exit ramp of the bundle or a value is out of range."""
    if not isinstance(body, dict) or not isinstance(body.get("thresholds"), dict):
        raise BadControl('send {"thresholds": {ramp: value in [0, 1] or "disabled"}, "reason": "..."}')
    given: dict[Any, Any] = body["thresholds"]
    if final in given:
        raise BadControl(f"{final!r} is the final head: it answers every input that reaches it and takes no threshold")
    unknown = sorted(str(k) for k in given if k not in exit_ramps)
    if unknown:
        raise BadControl(f"unknown ramps {unknown[:8]}; the bundle's exit ramps are {exit_ramps}"[:400])
    reason = body.get("reason", "api")
    if not isinstance(reason, str):
        raise BadControl(f"reason must be a string, got {type(reason).__name__}")
    return {str(k): threshold_value(str(k), v) for k, v in given.items()}, reason[:MAX_REASON_CHARS]


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    conf: list[float | None]
    pred: list[int | None]
    final: int


def _index(value: Any, n: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < n


def _sample(s: Any, n_ramps: int, n_labels: int) -> Sample:
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
    return Sample(id_, conf, pred, final)


def parse_feedback(body: Any, n_ramps: int, n_labels: int) -> list[Sample]:
    """The samples of a ``{"samples": [...]}`` post; BadControl naming the first wrong one."""
    samples = body.get("samples") if isinstance(body, dict) else None
    if not isinstance(samples, list):
        raise BadControl('send {"samples": [{"id", "final", "conf", "pred"}, ...]}')
    if len(samples) > MAX_FEEDBACK_SAMPLES:
        raise BadControl(f"{len(samples)} samples in one post; at most {MAX_FEEDBACK_SAMPLES}")
    out = []
    for i, s in enumerate(samples):
        try:
            out.append(_sample(s, n_ramps, n_labels))
        except BadControl as err:
            raise BadControl(f"samples[{i}]: {err}") from None
    return out


class RouterControl:
    """The control handlers of one Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/observations", self.handle_observations),
            web.get("/v1/window.npz", self.handle_window),
            web.get("/v1/thresholds", self.handle_thresholds_get),
            web.post("/v1/thresholds", self.handle_thresholds_post),
            web.get("/v1/peers", self.handle_peers),
            web.post("/v1/feedback", self.handle_feedback),
        ]

    async def handle_feedback(self, request: web.Request) -> web.Response:
        r = self.router
        body = await json_body(request, MAX_FEEDBACK_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            samples = parse_feedback(body, len(r.exit_ramps), len(r.manifest.labels))
        except BadControl as err:
            return error_response(400, f"bad feedback: {err}")
        accepted = 0
        for s in samples:
            if s.id not in r.pending_records:  # not an input this router shadow-sampled (or long forgotten)
                continue
            answered_by = r.pending_records.pop(s.id)
            if not r.feedback.add(s.conf, s.pred, s.final):
                continue
            accepted += 1
            if answered_by in r.ramp_index:
                i = r.ramp_index[answered_by]
                r.window.record_feedback(i, s.pred[i] == s.final)
        return web.json_response({"accepted": accepted, "ignored": len(samples) - accepted})

    async def handle_thresholds_get(self, _: web.Request) -> web.Response:
        return web.json_response({"thresholds": self.router.thresholds})

    async def handle_thresholds_post(self, request: web.Request) -> web.Response:
        r = self.router
        body = await json_body(request, MAX_THRESHOLDS_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            new, reason = parse_thresholds(body, r.exit_ramps, r.final_name)
        except BadControl as err:
            return error_response(400, f"bad thresholds: {err}")
        await r.push_thresholds(new, reason)
        return web.json_response({"thresholds": r.thresholds})

    async def handle_observations(self, request: web.Request) -> web.Response:
        r = self.router
        current = request.query.get("window") == "current"
        obs = r._snapshot(time.time()) if current or r.last_window is None else r.last_window
        return web.json_response(obs.dump())

    async def handle_window(self, request: web.Request) -> web.Response:
        r = self.router
        try:
            last = int(request.query.get("last", 0))
            if last < 0:
                raise ValueError
        except ValueError:
            return error_response(400, "last must be a non-negative integer (0 = every stored sample)")
        body = r.feedback.to_npz(r.saving_ms, r.cost_ms, last=last or None)
        return web.Response(body=body, content_type="application/octet-stream")

    async def handle_peers(self, _: web.Request) -> web.Response:
        return web.json_response(self.router.peers.snapshot())
