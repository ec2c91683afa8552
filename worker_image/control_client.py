"""The one client of the control endpoints a router (and a split worker) serves.

Used by the operator's drift loop, by the threshold tuning loop of `exitplan up`, by the router
(pushing thresholds to split 0) and by the workers (forwarding them down the chain):

- ``GET  /v1/observations[?window=current|both]``: the last closed observation window, the one in progress,
  or both in one answer (a router that predates `both` answers its closed window: then a second request);
- ``GET  /v1/window.npz?last=N[&after=K&ring=R][&format=safetensors]``: the newest N shadow-sampled feedback samples
  (an npz, the `exitplan tune` format; asked for as safetensors here, which parses ~20x faster), or only those
  after sample K of the router's ring R;
- ``GET  /v1/thresholds`` / ``POST /v1/thresholds``: the exit thresholds in force / a hot update.

Every request carries ``Authorization: Bearer <token>`` when the client has the service's control
token (the endpoints answer 401 without it, 403 with another one).

Every call raises :class:`ControlError` (with the URL and the HTTP status, when there was one) on a
failed request, a non-2xx answer or a body that does not parse, so callers handle one error type.
"""

from __future__ import annotations

from types import TracebackType
from urllib.parse import quote

import aiohttp
import orjson
from pydantic import ValidationError

from exitplan.api.observations import Observations
from exitplan.worker_image.control_bodies import FeedbackArrays, ThresholdUpdate
from exitplan.worker_image.threshold_set import ThresholdSet

__all__ = ["ControlClient", "ControlError", "FeedbackArrays"]


class ControlError(RuntimeError):
    """A control request failed; `url` names the endpoint, `status` the HTTP status (None: no answer)."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url, self.status = url, status


class ControlClient:
    """Async client of one pod's control endpoints (``base_url`` like ``http://10.0.0.7:8080``).

    Pass a shared ``session`` to reuse its connections (it is not closed here); without one, the
    client opens its own, closed by :meth:`close` or ``async with``. ``token``: the service's control
    token (a shared session may carry it in its default headers instead)."""

    def __init__(
        self,
        base_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 5.0,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owned = session is None

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _request(self, method: str, route: str, json: object = None) -> bytes:
        url = f"{self.base_url}{route}"
        try:
            async with self._client().request(
                method, url, json=json, timeout=self.timeout, headers=self.headers
            ) as resp:
                body = await resp.read()
                if resp.status // 100 != 2:
                    raise ControlError(url, f"HTTP {resp.status}: {body[:200].decode(errors='replace')}", resp.status)
                return body
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise ControlError(url, f"{type(err).__name__}: {err}") from err

    async def observations(self, *, current: bool = False) -> Observations:
        """The last closed observation window (``current``: the one in progress)."""
        route = "/v1/observations" + ("?window=current" if current else "")
        body = await self._request("GET", route)
        try:
            return Observations.model_validate_json(body)
        except ValidationError as err:
            raise ControlError(
                f"{self.base_url}{route}", f"not an observation window: {err.errors()[0]['msg']}"
            ) from err

    async def recent_observations(self, known: Observations | None = None) -> tuple[Observations, Observations]:
        """(the last closed window, the one in progress) in one request where the router serves
        ``?window=both``; a router that predates it ignores the query and answers its closed window (or
        refuses it with 400/404), and the windows are asked for on their own. `known`: the closed window an
        earlier read of this router returned; a closed window no longer changes, so one with its bounds is
        returned as it is rather than parsed again (the drift loop reads each router several times per window)."""
        route = "/v1/observations?window=both"
        try:
            body = await self._request("GET", route)
        except ControlError as err:
            if err.status not in (400, 404):
                raise
            return await self.observations(), await self.observations(current=True)  # a server that refuses `both`
        try:
            doc = orjson.loads(body)
            if isinstance(doc, dict) and set(doc) == {"closed", "current"}:
                current = Observations.model_validate(doc["current"])
                bounds = _bounds(doc["closed"])
                # the same closed window as `known` (and not the window in progress, as before the first roll)
                if known is not None and bounds == (known.since, known.until) and bounds != _bounds(doc["current"]):
                    return known, current
                return Observations.model_validate(doc["closed"]), current
            closed = Observations.model_validate(doc)
        except (orjson.JSONDecodeError, ValidationError) as err:
            msg = err.errors()[0]["msg"] if isinstance(err, ValidationError) else str(err)
            raise ControlError(f"{self.base_url}{route}", f"not an observation window: {msg}") from err
        return closed, await self.observations(current=True)

    async def feedback(self, last: int, after: tuple[str, int] | None = None) -> FeedbackArrays | None:
        """The newest ``last`` shadow-sampled feedback samples, or None while the router has none. ``after``
        (a ring and sample number of an earlier answer): only the samples since, possibly none (a router of
        another ring, or one that predates it, answers as without it: see FeedbackFollower)."""
        route = f"/v1/window.npz?last={int(last)}&format=safetensors"  # an older router ignores it: an npz
        if after is not None:
            route += f"&after={int(after[1])}&ring={quote(after[0])}"
        body = await self._request("GET", route)
        try:
            arrays = FeedbackArrays.from_body(body)
        except (ValueError, KeyError, OSError) as err:
            raise ControlError(f"{self.base_url}{route}", f"not a feedback window: {err}") from err
        return None if arrays.final.size == 0 and after is None else arrays

    async def thresholds(self) -> dict[str, float]:
        """The exit thresholds in force."""
        return (await self.threshold_set()).values

    async def threshold_set(self) -> ThresholdSet:
        """The exit thresholds in force with their version."""
        return self._threshold_answer("/v1/thresholds", await self._request("GET", "/v1/thresholds"))

    def _threshold_answer(self, route: str, body: bytes) -> ThresholdSet:
        try:
            return ThresholdSet.from_answer(orjson.loads(body))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ControlError(f"{self.base_url}{route}", f"not a thresholds answer: {err}") from err

    async def push_thresholds(
        self, thresholds: dict[str, float], reason: str, *, replace: bool = False, version: int | None = None
    ) -> ThresholdSet:
        """A hot threshold update (a router forwards it to the other routers and every split-0 pod, which
        forward it down): merged into the set in force unless `replace`; `version`: the version this set
        is (taken only when newer). The set in force after it."""
        update = ThresholdUpdate(thresholds, reason, replace, version)
        return self._threshold_answer("/v1/thresholds", await self._request("POST", "/v1/thresholds", update.to_json()))

    async def push_set(self, new: ThresholdSet, reason: str) -> ThresholdSet:
        """Push a whole versioned set (replacing, at its version)."""
        return await self.push_thresholds(new.values, reason, replace=True, version=new.version)


def _bounds(doc: object) -> tuple[object, object] | None:
    """(since, until) of a window as the router answered it (None: not a window)."""
    return (doc.get("since"), doc.get("until")) if isinstance(doc, dict) else None
