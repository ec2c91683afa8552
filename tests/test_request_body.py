"""Reading a request body (worker_image/request_body.py), without a server: the inflater stops at the limit.

Issue 28: a 611 KB deflate body that inflates to 600 MB got its 413, but the router then spent ~1.6 s of
CPU inflating all of it while other clients waited up to 3.2 s. Now inflation stops at the body limit + 1
byte, whatever the bomb, and a body over the limit as sent is never read: the work is that of the limit
(on a real router, tests/test_request_reading.py, 64 KiB limit: a 46 KB deflate body of 10 MiB and a
457 KB one of 100 MiB both 413 with under one 10 ms clock tick of the router's CPU, /proc/<pid>/stat;
the 413s and the other answers of a fuzz corpus are in tests/test_fuzz_requests.py).
"""

from __future__ import annotations

import gzip
import zlib

import pytest
from fuzz_encodings import bomb, deflate

from exitplan.worker_image.request_body import (
    BodyError,
    BodyTooLarge,
    Inflater,
    UnsupportedEncoding,
    coding_of,
)

LIMIT = 1 << 20


def feed_all(inflater: Inflater, data: bytes, chunk: int = 64 << 10) -> bytes:
    out = b"".join(inflater.feed(data[i : i + chunk]) for i in range(0, len(data), chunk))
    inflater.finish()
    return out


@pytest.mark.parametrize("coding", ["deflate", "gzip"])
def test_a_bomb_stops_inflating_at_the_limit(coding):
    data = bomb(100 << 20, coding)  # ~450 KB that inflate to 100 MB
    inflater = Inflater(coding, LIMIT)
    with pytest.raises(BodyTooLarge, match="over the limit of 1048576 bytes once inflated"):
        feed_all(inflater, data)
    assert inflater.size == LIMIT + 1  # not one byte more was inflated


def test_a_body_in_one_chunk_that_inflates_past_the_limit_stops_too():
    inflater = Inflater("deflate", 1000)
    with pytest.raises(BodyTooLarge):
        inflater.feed(deflate(b"x" * 10_000_000))
    assert inflater.size == 1001


@pytest.mark.parametrize(
    "coding, data",
    [
        ("gzip", gzip.compress(b'{"a": 1}', mtime=0)),
        ("deflate", deflate(b'{"a": 1}')),
        ("deflate", deflate(b'{"a": 1}', raw=True)),
        ("gzip", gzip.compress(b'{"a"', mtime=0) + gzip.compress(b": 1}", mtime=0)),
    ],
    # Readable ids that every xdist worker computes alike (a stream's bytes as an id differ by gzip's mtime).
    ids=["gzip", "zlib", "raw-deflate", "gzip-two-members"],
)
def test_valid_streams_inflate_whole_in_any_chunking(coding, data):
    for chunk in (1, 3, len(data)):
        assert feed_all(Inflater(coding, LIMIT), data, chunk) == b'{"a": 1}'


def test_exactly_the_limit_is_taken():
    assert len(feed_all(Inflater("gzip", 1000), gzip.compress(b"y" * 1000))) == 1000


@pytest.mark.parametrize(
    "coding, data, phrase",
    [
        ("gzip", b"\x1f\x8b\x08\x00" + b"garbage" * 5, "not a valid gzip stream"),
        ("gzip", gzip.compress(b"abc" * 100, mtime=0)[:-9], "ends before"),
        ("deflate", deflate(b"abc") + b"more", "after the end"),
        ("gzip", b"", "ends before"),
    ],
    ids=["gzip-garbage", "gzip-truncated", "deflate-trailing", "gzip-empty"],
)
def test_corrupt_truncated_or_trailing_streams_are_400(coding, data, phrase):
    with pytest.raises(BodyError, match=phrase) as err:
        feed_all(Inflater(coding, LIMIT), data)
    assert err.value.status == 400


def test_content_codings():
    assert coding_of(None) == coding_of("") == coding_of("identity") == "identity"
    assert coding_of("GZIP") == "gzip" and coding_of("identity, deflate") == "deflate"
    for header in ("br", "zstd", "gzip, gzip", "compress"):
        with pytest.raises(UnsupportedEncoding) as err:
            coding_of(header)
        assert err.value.status == 415


def test_zlib_itself_would_inflate_the_whole_bomb():
    """What the limit saves: without max_length one call inflates everything it is given."""
    assert len(zlib.decompressobj().decompress(bomb(20 << 20))) == 20 << 20
