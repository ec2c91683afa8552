"""Reading a request's body: its size limit, its Content-Encoding, and what a broken one is answered.

Every exitplan server runs with aiohttp's own decompression off (server_guard.GuardedRunner passes
`auto_decompress=False`): aiohttp would inflate a compressed body as it arrives, before any handler
could hold it to a limit, answer a corrupt stream with a 500 and a traceback, and after a 413 keep
inflating the rest of the body while it drains the connection. Here `read_body` reads the body chunk
by chunk and `Inflater` inflates it incrementally, never more than the limit + 1 bytes in all (zlib's
`max_length`), so a deflate bomb costs the CPU of the limit, not of the bomb:

| the body | the answer |
|---|---|
| over the limit, as sent or inflated | 413 with the limit; the connection is closed, the rest never read or inflated |
| a corrupt or truncated gzip / deflate stream, data after its end | 400 naming the coding |
| a coding other than gzip, x-gzip, deflate, identity (or several stacked) | 415 naming the ones taken |
| a malformed chunk (`Transfer-Encoding: chunked`) or a body cut short | 400; the connection is closed |

Each refusal is logged as one line, rate-limited (`CLIENT_ERRORS`: the 1st, 2nd, 4th, 8th ... of each
kind), never with a traceback: a client's mistake is not the server's error.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from exitplan.worker_image.protocol import error_response

log = logging.getLogger(__name__)

CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""The content codings a body may come in, and zlib's window bits for each (deflate: zlib-wrapped, or raw
as some clients send it; told apart by the first byte, as aiohttp and browsers do)."""


class BodyError(ValueError):
    """A request body that cannot be read as sent; `status` is its answer."""

    status = 400
    kind = "bad_body"


class BodyTooLarge(BodyError):
    status = 413
    kind = "body_too_large"


class UnsupportedEncoding(BodyError):
    status = 415
    kind = "unsupported_encoding"


def every_power_of_two(count: int) -> bool:
    """The 1st, 2nd, 4th, 8th, ... occurrence: a flood of bad clients does not flood the log."""
    return count & (count - 1) == 0


def one_line(text: str) -> str:
    """`text` with its runs of white space (newlines included) as one space."""
    return " ".join(text.split())


@dataclass
class ClientErrors:
    """Client errors of this process, counted per kind and logged as one line each, rate-limited."""

    counts: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str, message: str) -> None:
        self.counts[kind] = count = self.counts.get(kind, 0) + 1
        if every_power_of_two(count):
            log.warning("client error (%s): %s (%d so far)", kind, one_line(message)[:200], count)


CLIENT_ERRORS = ClientErrors()
"""The process's client-error log (one per process, as its logger is)."""


def coding_of(header: str | None) -> str:
    """The one content coding of a Content-Encoding header ("identity" for none)."""
    codings = [c.strip().lower() for c in (header or "").split(",") if c.strip().lower() not in ("", "identity")]
    if not codings:
        return "identity"
    if len(codings) > 1 or codings[0] not in CODINGS:
        raise UnsupportedEncoding(
            f"Content-Encoding {header!r} is not taken: send the body as it is, or in one of {', '.join(CODINGS)}"
        )
    return codings[0]


class Inflater:
    """Inflates one compressed body incrementally, never past `limit` + 1 bytes in all."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding, self.limit, self.size = coding, limit, 0
        self._zlib = zlib.decompressobj(CODINGS[coding])
        self._started = False

    def feed(self, chunk: bytes) -> bytes:
        """The inflated bytes of `chunk`; BodyTooLarge as soon as they pass the limit, BodyError for a
        corrupt stream."""
        if not self._started and chunk:
            self._started = True
            if self.coding == "deflate" and chunk[0] & 0x0F != 8:  # not zlib-wrapped: raw deflate
                self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
        parts, data = [], chunk
        while data:
            if self._zlib.eof:  # what follows a finished stream: another gzip member, else an error
                if self.coding == "deflate":
                    raise BodyError(f"the body holds {len(data)} bytes after the end of its deflate stream")
                self._zlib = zlib.decompressobj(CODINGS[self.coding])
            try:
                piece = self._zlib.decompress(data, self.limit + 1 - self.size)
            except zlib.error as err:
                raise BodyError(f"the body is not a valid {self.coding} stream ({err})") from None
            self.size += len(piece)
            if self.size > self.limit:
                raise BodyTooLarge(
                    f"request body is over the limit of {self.limit} bytes once inflated ({self.coding})"
                )
            parts.append(piece)
            data = self._zlib.unused_data if self._zlib.eof else self._zlib.unconsumed_tail
        return b"".join(parts)

    def finish(self) -> None:
        """At the end of the body: BodyError when its stream has not ended (a truncated body)."""
        if not self._zlib.eof:
            raise BodyError(f"the body ends before its {self.coding} stream does (truncated or not {self.coding})")


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The whole body, inflated per its Content-Encoding; BodyError (413, 400, 415) when it cannot be."""
    coding = coding_of(request.headers.get("Content-Encoding"))
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body of {request.content_length} bytes is over the limit of {limit}")
    inflater = Inflater(coding, limit) if coding != "identity" else None
    chunks, sent = [], 0
    try:
        while chunk := await request.content.readany():
            sent += len(chunk)
            if sent > limit:
                raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(inflater.feed(chunk) if inflater is not None else chunk)
    except HttpProcessingError as err:  # a malformed chunk, a body cut short
        raise BodyError(f"the body is malformed: {err.message or type(err).__name__}") from None
    if inflater is not None:
        inflater.finish()
    return b"".join(chunks)


def body_error_response(err: BodyError) -> web.Response:
    """The JSON answer to a body that could not be read, with `Connection: close` (what is left of the
    body is not read), noted in the client-error log."""
    CLIENT_ERRORS.note(err.kind, str(err))
    response = error_response(err.status, str(err))
    response.force_close()
    return response


async def json_body(request: web.Request, limit: int) -> object | web.Response:
    """The request's JSON body, or the 413/400/415 answer (a body over `limit` bytes, or not JSON)."""
    try:
        body: object = orjson.loads(await read_body(request, limit))
        return body
    except BodyError as err:
        return body_error_response(err)
    except orjson.JSONDecodeError as err:
        CLIENT_ERRORS.note("bad_json", str(err))
        return error_response(400, f"body is not valid JSON: {err}")
