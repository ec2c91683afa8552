"""Wire frames: round trip, zero-copy decode, and clear errors on malformed frames; the typed meta of
/v1/run frames (HopItem, HopResult, ...) encodes exactly as the untyped code did."""

import json

import numpy as np
import pytest

from exitplan.worker_image import wire
from exitplan.worker_image.wire import HopAnswer, HopItem, HopRequest, HopResult, ShadowRecord


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


# ---------------------------------------------------------------- typed hop meta (HopItem, HopResult, ...)


def _old_router_items(ids, deadline, timeout_at, records, advertise):
    """The router's frame meta as the untyped code built it."""
    items = []
    for k, record in enumerate(records):
        item = {"id": ids[k], "deadline": deadline, "timeout": timeout_at, "record": record}
        if record and advertise:
            item["reply_to"] = advertise
        items.append(item)
    return items


def _old_worker_onward(item, rec, answered):
    """What the untyped worker forwarded for a received item (rec: conf, pred, final_pred added by this split)."""
    item = dict(item)
    if rec is not None:
        item_rec = item.setdefault("rec", {"conf": {}, "pred": {}})
        item_rec["conf"].update(rec[0])
        item_rec["pred"].update(rec[1])
        if rec[2] is not None:
            item_rec["final"] = rec[2]
    out = dict(item)
    out["answered"] = answered
    return out


def test_router_frame_meta_is_byte_identical_to_the_dict_code():
    x = np.zeros((3, 4), np.int64)
    deadline, timeout_at = 1712345678.123456, 1712345679.5
    ids, records = ["ab-1", "ab-2", "ab-3"], [False, True, False]
    old = {"items": _old_router_items(ids, deadline, timeout_at, records, "10.0.0.7:8080"), "bucket": 32}
    items = [HopItem(i, deadline, timeout_at, r, "10.0.0.7:8080" if r else None) for i, r in zip(ids, records)]
    frame = wire.encode(HopRequest(items, 32).to_meta(), {"input_ids": x})
    assert frame == wire.encode(old, {"input_ids": x})
    meta, _ = wire.decode(frame)
    parsed = HopRequest.from_meta(meta)
    assert list(parsed.items) == items and parsed.bucket == 32
    assert HopRequest(parsed.items, parsed.bucket).to_meta() == old


def test_forwarded_items_carry_the_shadow_record_and_answered_flag_as_before():
    received = _old_router_items(["r-1", "r-2"], 10.5, 12.0, [True, False], "router:80")
    split0 = {"r0": 0.91}, {"r0": 2}, None
    split1 = {"r1": 0.95, "r0": 0.5}, {"r1": 1}, 1  # r0 seen again keeps its place, as dict.update
    # split 0 -> split 1
    old = [_old_worker_onward(received[0], split0, True), _old_worker_onward(received[1], None, False)]
    items = [HopItem.from_meta(m) for m in received]
    rec = ShadowRecord({}, {}).merged(*split0)
    new = [items[0].onward(rec, True).to_meta(), items[1].onward(None, False).to_meta()]
    assert wire.encode({"items": new}) == wire.encode({"items": old})
    # split 1 adds its ramps and the final answer (what the last split posts as feedback)
    at1 = HopItem.from_meta(json.loads(json.dumps(new[0])))
    assert at1.rec == rec and at1.answered is True and at1.reply_to == "router:80"
    old1 = _old_worker_onward(old[0], split1, True)
    assert json.dumps(at1.onward(at1.rec.merged(*split1), True).to_meta()) == json.dumps(old1)  # key order too
    assert list(old1["rec"]["conf"]) == ["r0", "r1"]


def test_results_and_answer_meta_round_trip_as_the_dict_code_built_them():
    old_results = [
        {"id": "a", "ramp": "ramp_2", "final": False},
        {"id": "b", "shadow": True},
        {"id": "c", "error": "split 1 cannot run this input"},
        {"id": "d", "ramp": "head", "final": True},
    ]
    old = {"results": old_results, "service_ms": 3.25, "expected_ms": 2.5, "compute_ms": 1.75}
    results = [
        HopResult.answer("a", "ramp_2", False),
        HopResult.shadow_of("b"),
        HopResult.failure("c", "split 1 cannot run this input"),
        HopResult.answer("d", "head", True),
    ]
    answer = HopAnswer(results, 3.25, 2.5, 1.75)
    logits = np.ones((4, 3), np.float32)
    assert wire.encode(answer.to_meta(), {"logits": logits}) == wire.encode(old, {"logits": logits})
    assert HopAnswer.from_meta(wire.decode(wire.encode(old))[0]) == answer
    # what an older pod may leave out
    bare = HopAnswer.from_meta({"results": old_results[:1], "service_ms": 3.0})
    assert (bare.service_ms, bare.expected_ms, bare.compute_ms) == (3.0, 0.0, 0.0)
    assert HopAnswer.from_meta({}).results == []


@pytest.mark.parametrize(
    "parse, meta, named",
    [
        (HopRequest.from_meta, {"bucket": 16}, "'items'"),
        (HopRequest.from_meta, {"items": []}, "'items'"),
        (
            HopRequest.from_meta,
            {"items": [{"id": "a"}, {"id": "b", "deadline": "soon"}]},
            r"items\[1\]: field 'deadline'",
        ),
        (HopRequest.from_meta, {"items": [{"deadline": 1.0}]}, r"items\[0\]: field 'id' is missing"),
        (HopRequest.from_meta, {"items": [{"id": 7}]}, "field 'id' must be a string"),
        (HopRequest.from_meta, {"items": [{"id": "a", "record": "yes"}]}, "field 'record'"),
        (HopRequest.from_meta, {"items": [{"id": "a", "answered": 1}]}, "field 'answered'"),
        (
            HopRequest.from_meta,
            {"items": [{"id": "a", "rec": {"conf": {"r0": "high"}, "pred": {}}}]},
            "field 'rec': field 'conf'",
        ),
        (HopRequest.from_meta, {"items": ["a"]}, r"items\[0\] must be a JSON object"),
        (HopRequest.from_meta, {"items": [{"id": "a"}], "bucket": 1.5}, "field 'bucket'"),
        (HopAnswer.from_meta, {"results": {"id": "a"}}, "'results'"),
        (HopAnswer.from_meta, {"results": [{"id": "a", "final": True}]}, r"results\[0\]: field 'ramp' is missing"),
        (HopAnswer.from_meta, {"results": [None]}, r"results\[0\] must be a JSON object"),
        (HopAnswer.from_meta, {"results": [], "service_ms": "3"}, "field 'service_ms'"),
        (HopItem.from_meta, {"id": "a", "timeout": [1.0]}, "field 'timeout'"),
        (HopResult.from_meta, {"id": "a", "error": 500}, "field 'error'"),
    ],
)
def test_bad_meta_names_the_field(parse, meta, named):
    with pytest.raises(wire.WireError, match=named):
        parse(meta)


def test_null_optional_fields_read_as_not_given():
    assert HopItem.from_meta({"id": "a", "deadline": None, "reply_to": None, "answered": None}) == HopItem("a")
    assert HopResult.from_meta({"id": "a", "ramp": "r0", "final": None, "error": None}) == HopResult.answer(
        "a", "r0", False
    )
