"""Bodies sent the other ways a client may send them, for the fuzz corpus (test_fuzz_requests.py):
compressed (gzip, zlib-wrapped and raw deflate), chunked (over a raw socket, so that a malformed chunk
can be written), and random damage to either framing. Every one is answered over a raw connection
and read back whole: a connection closed without an answer is a problem of its own."""

from __future__ import annotations

import asyncio
import functools
import gzip
import random
import zlib

HANG_GUARD_S = 60.0
"""Only against a server that never answers (far above anything it takes); no test times the server."""


def deflate(data: bytes, raw: bool = False) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def encode(data: bytes, coding: str) -> bytes:
    """`data` in a content coding: gzip, deflate (zlib-wrapped), raw-deflate (sent as deflate), identity."""
    if coding == "gzip":
        return gzip.compress(data)
    if coding in ("deflate", "raw-deflate"):
        return deflate(data, raw=coding == "raw-deflate")
    return data


def header_of(coding: str) -> dict[str, str]:
    return {} if coding == "identity" else {"Content-Encoding": "deflate" if coding == "raw-deflate" else coding}


@functools.lru_cache(maxsize=8)
def bomb(inflated: int, coding: str = "deflate") -> bytes:
    """`inflated` bytes of spaces, compressed (~1000:1; made once per size, ~23 ms per MiB)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS)
    block = b" " * (1 << 20)
    parts = [packer.compress(block) for _ in range(inflated >> 20)]
    return b"".join(parts) + packer.compress(b" " * (inflated & ((1 << 20) - 1))) + packer.flush()


def chunked(data: bytes, rng: random.Random) -> bytes:
    """`data` as chunks of random sizes, then the last chunk."""
    out, i = [], 0
    while i < len(data):
        n = min(rng.randint(1, max(1, len(data) // 3)), len(data) - i)
        out.append(b"%x\r\n%s\r\n" % (n, data[i : i + n]))
        i += n
    return b"".join(out) + b"0\r\n\r\n"


def damage(data: bytes, rng: random.Random) -> bytes:
    """One random injury: a byte flipped, the tail cut, bytes inserted, or a run zeroed."""
    if not data:
        return bytes([rng.randrange(256)])
    roll, at = rng.random(), rng.randrange(len(data))
    if roll < 0.4:
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
    if roll < 0.6:
        return data[:at]
    if roll < 0.8:
        return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    return data[:at] + bytes(min(16, len(data) - at)) + data[at + 16 :]


def request(path: str, body: bytes, headers: dict[str, str], *, chunks: bytes | None = None) -> bytes:
    """A whole HTTP/1.1 POST: with Content-Length, or (`chunks`) chunked with those bytes as its framing."""
    lines = [f"POST {path} HTTP/1.1", "Host: fuzz", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append("Transfer-Encoding: chunked" if chunks is not None else f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (chunks if chunks is not None else body)


async def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send `raw` on a new connection; the answer's status and body ((0, why) when none came)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(_response(reader), HANG_GUARD_S)
    except (ConnectionError, asyncio.IncompleteReadError) as err:
        return 0, f"no answer: {err!r}".encode()
    finally:
        writer.close()


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status_line = await reader.readline()
    if not status_line.startswith(b"HTTP/1."):
        return 0, b"no answer: the connection closed with " + status_line[:100]
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return int(status_line.split()[1]), body
