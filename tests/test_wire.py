"""Wire frames: round trip, zero-copy decode, and clear errors on malformed frames."""

import numpy as np
import pytest

from exitplan.worker import wire


def test_round_trip_keeps_dtype_shape_and_values():
    rng = np.random.default_rng(0)
    tensors = {
        "hidden": rng.standard_normal((3, 16, 384)).astype(np.float32),
        "attention_mask": rng.integers(0, 2, (3, 16)).astype(np.int64),
        "odd": np.arange(3, dtype=np.uint8),  # 3 bytes: exercises alignment padding
        "after": np.arange(5, dtype=np.int32),
    }
    meta = {"items": [{"id": "a"}, {"id": "b"}, {"id": "c"}], "bucket": 16}
    out_meta, out = wire.decode(wire.encode(meta, tensors))
    assert out_meta == meta
    assert list(out) == list(tensors)
    for name, array in tensors.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        np.testing.assert_array_equal(out[name], array)


def test_payload_is_raw_bytes_not_json():
    hidden = np.full((2, 8, 384), 0.1234567, dtype=np.float32)
    frame = wire.encode({}, {"hidden": hidden})
    assert len(frame) < hidden.nbytes + 512  # JSON floats would need ~4x the bytes
    assert b"0.1234567" not in frame


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"EX", "shorter"),
        (b"NOPE\x00\x00\x00\x00", "expected"),
        (b"EXP1\xff\x00\x00\x00{}", "runs past"),
        (b"EXP1\x02\x00\x00\x00{}", "meta and tensors"),
    ],
)
def test_malformed_frames_are_named(frame, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode(frame)


def test_truncated_tensor_is_rejected():
    frame = wire.encode({}, {"x": np.zeros((4, 4), np.float32)})
    with pytest.raises(wire.WireError, match="'x'"):
        wire.decode(frame[:-8])


def test_unsendable_dtype_is_rejected():
    with pytest.raises(wire.WireError, match="complex"):
        wire.encode({}, {"z": np.zeros(2, np.complex64)})

