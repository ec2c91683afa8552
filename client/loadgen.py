"""Open-loop load: send each request at its arrival time, never waiting for earlier answers.

Every request ends as exactly one `Outcome`:

| kind          | what happened                                                        |
|---------------|----------------------------------------------------------------------|
| `ok`          | 200 with a well-formed Open Inference Protocol answer                |
| `overload`    | 429 or 503 (the router shed it; it should say Retry-After)           |
| `bad_request` | another 4xx (400 malformed, 404 unknown model, 413 too large)        |
| `server_error`| another 5xx (502 worker failure, 504 hard timeout, 500)              |
| `invalid`     | 200 whose body is not a well-formed answer (a protocol bug)          |
| `transport`   | the connection failed or closed without an HTTP answer               |
| `lost`        | no answer within the client's timeout (the bug this load must expose)|

Times are seconds from the start of the run (the first arrival is at 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np

from exitplan.client.open_files import connection_ceiling

KINDS = ("ok", "overload", "bad_request", "server_error", "invalid", "transport", "lost")
ERROR_KINDS = ("overload", "bad_request", "server_error", "invalid", "transport")


@dataclass
class Outcome:
    index: int
    scheduled_s: float
    """When the trace says to send it."""
    sent_s: float
    """When it was sent (after `scheduled_s` by the generator's lag)."""
    kind: str
    status: int | None = None
    done_s: float | None = None
    """When its answer (or error) arrived; None when lost."""
    label: str | None = None
    ramp: str | None = None
    retry_after: str | None = None
    error: str = ""

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "latency_s": self.latency_s}


def classify(status: int) -> str:
    """The outcome kind of an HTTP status other than 200."""
    if status in (429, 503):
        return "overload"
    if 400 <= status < 500:
        return "bad_request"
    if status >= 500:
        return "server_error"
    return "invalid"  # 1xx/2xx/3xx other than 200: not an answer this protocol gives


def parse_answer(body: bytes) -> tuple[str, str]:
    """(label, exit ramp) of a one-input answer; ValueError when the body is not a well-formed answer."""
    try:
        doc = json.loads(body)
        outputs = {o["name"]: o for o in doc["outputs"]}
        labels = outputs["label"]["data"]
        ramps = outputs["exit_ramp"]["data"]
        scores = outputs["scores"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"answer is not an inference response with label/scores/exit_ramp outputs: {err}") from err
    if len(labels) != 1 or len(ramps) != 1:
        raise ValueError(f"answer holds {len(labels)} labels and {len(ramps)} ramps for one input")
    if not isinstance(scores.get("data"), list) or len(scores.get("shape") or []) != 2 or scores["shape"][0] != 1:
        raise ValueError(f"scores output has shape {scores.get('shape')}, expected [1, classes]")
    return str(labels[0]), str(ramps[0])


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", ""))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


async def _one(
    session: aiohttp.ClientSession,
    endpoint: str,
    index: int,
    body: bytes,
    scheduled: float,
    start: float,
    timeout_s: float,
    extra_headers: Mapping[str, str] | None = None,
) -> Outcome:
    loop = asyncio.get_running_loop()
    sent = loop.time() - start
    headers = {"Content-Type": "application/json", "X-Request-Id": f"bench-{index}", **(extra_headers or {})}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(endpoint, data=body, headers=headers) as resp:
                payload = await resp.read()
                done = loop.time() - start
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
    except TimeoutError:
        return Outcome(index, scheduled, sent, "lost", error=f"no answer within {timeout_s:g} s")
    except (aiohttp.ClientError, OSError) as err:
        return Outcome(
            index, scheduled, sent, "transport", done_s=loop.time() - start, error=f"{type(err).__name__}: {err}"
        )
    if status != 200:
        return Outcome(
            index, scheduled, sent, classify(status), status, done, retry_after=retry_after, error=_error_text(payload)
        )
    try:
        label, ramp = parse_answer(payload)
    except ValueError as err:
        return Outcome(index, scheduled, sent, "invalid", status, done, error=str(err))
    return Outcome(index, scheduled, sent, "ok", status, done, label=label, ramp=ramp)


async def replay(
    url: str,
    model: str,
    bodies: Sequence[bytes],
    arrivals: Sequence[float] | np.ndarray,
    *,
    timeout_s: float = 30.0,
    on_done: Callable[[Outcome], object] | None = None,
    headers: Sequence[Mapping[str, str]] | None = None,
) -> list[Outcome]:
    """Send `bodies[i]` at `arrivals[i]` seconds from now to the model's infer endpoint; one Outcome each.

    Open loop: a request is sent at its time whatever happened to the earlier ones, up to
    `connection_ceiling()` connections at once: past that (a service answering seconds late at thousands of
    requests per second) a request waits for a connection, its latency still counted from its scheduled
    time, instead of the process running out of descriptors and failing every later request, this step's
    and the next's. Each request waits at most `timeout_s` for its answer.
    `headers[i]`, when given, adds to (or replaces) request i's HTTP headers: a binary-extension body
    needs its Content-Type and Inference-Header-Content-Length.
    """
    if len(bodies) != len(arrivals):
        raise ValueError(f"{len(bodies)} bodies for {len(arrivals)} arrival times")
    if headers is not None and len(headers) != len(bodies):
        raise ValueError(f"{len(headers)} header sets for {len(bodies)} bodies")
    times = np.asarray(arrivals, dtype=np.float64)
    if times.size and (np.any(np.diff(times) < 0) or times[0] < 0):
        raise ValueError("arrival times must be non-negative and non-decreasing")
    endpoint = f"{url.rstrip('/')}/v2/models/{model}/infer"
    connector = aiohttp.TCPConnector(limit=connection_ceiling(), ttl_dns_cache=300)
    with young_collections_only():
        return await _send_all(connector, endpoint, bodies, times, timeout_s, on_done, headers)


@contextlib.contextmanager
def young_collections_only() -> Iterator[None]:
    """While a replay runs, the garbage collector only collects young objects: the heap as it was is frozen
    (`gc.freeze`) and full collections are put off until the replay ends. A full collection pauses the one
    event loop that sends and times every request for as long as it scans: 60-100 ms twice in a 10 s step
    at 1,500 req/s here, which made ~1 % of a step's answers late against a 100 ms SLO (p99 37-52 ms; 5.5-6.3
    ms without them) -- the load generator's pauses, counted as the service's. Young collections (about a
    millisecond) still reclaim the cycles a replay leaves; afterwards the thresholds are restored and one
    full collection runs."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], FULL_COLLECTIONS_PUT_OFF)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        gc.collect()


FULL_COLLECTIONS_PUT_OFF = 1_000_000
"""The oldest generation's threshold during a replay: that many collections of the middle one first."""


async def _send_all(
    connector: aiohttp.TCPConnector,
    endpoint: str,
    bodies: Sequence[bytes],
    times: np.ndarray,
    timeout_s: float,
    on_done: Callable[[Outcome], object] | None,
    headers: Sequence[Mapping[str, str]] | None,
) -> list[Outcome]:
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for index, (at, body) in enumerate(zip(times, bodies)):
            delay = start + float(at) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            extra = headers[index] if headers is not None else None
            task = asyncio.create_task(_one(session, endpoint, index, body, float(at), start, timeout_s, extra))
            if on_done is not None:
                task.add_done_callback(
                    lambda t: on_done(t.result()) if not t.cancelled() and t.exception() is None else None
                )
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
