from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trillium.wire import codec
from trillium.wire.batch import Batch, GradientUpdate, KeyedIds
from trillium.wire.codec import (
    CodecError,
    decode_batch,
    decode_gradients,
    encode_batch,
    encode_gradients,
    pack_array,
    unpack_array,
)

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    keys = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    size = draw(st.integers(0, 6))
    n = len(keys) * size
    lengths = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int32)
    values = draw(hnp.arrays(np.uint64, int(lengths.sum())))
    num_dense = draw(st.integers(0, 3))
    finite = st.floats(-1e6, 1e6, width=32)
    return Batch(
        batch_id=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 100)),
        rank=draw(st.integers(0, 64)),
        ids=KeyedIds(tuple(keys), values, lengths),
        dense=draw(hnp.arrays(np.float32, (size, num_dense), elements=finite)),
        labels=draw(hnp.arrays(np.float32, size, elements=st.sampled_from([0.0, 1.0]))),
    )


@st.composite
def gradient_updates(draw: st.DrawFn) -> GradientUpdate:
    tables = {}
    for name in draw(st.lists(names, max_size=3, unique=True)):
        ids = np.array(draw(st.lists(st.integers(0, 2**64 - 1), max_size=8, unique=True)), np.uint64)
        dim = draw(st.integers(1, 4))
        grads = draw(hnp.arrays(np.float32, (len(ids), dim), elements=st.floats(width=32, allow_nan=False)))
        tables[name] = (ids, grads)
    return GradientUpdate(
        ranks=tuple(draw(st.lists(st.integers(0, 8), min_size=1, max_size=4, unique=True).map(sorted))),
        step=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 9)),
        shard=draw(st.integers(0, 16)),
        tables=tables,
    )


@settings(max_examples=60, deadline=None)
@given(batches())
def test_batch_round_trip(batch: Batch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@settings(max_examples=60, deadline=None)
@given(gradient_updates())
def test_gradients_round_trip(update: GradientUpdate) -> None:
    decoded = decode_gradients(encode_gradients(update))
    assert decoded == update
    assert list(decoded.tables) == list(update.tables)


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(-(2.0**100), 2.0**100, width=32))
)  # not near float32's max
def test_fp16_wire_values_lose_only_fp16_rounding_whatever_their_magnitude(values: np.ndarray) -> None:
    """Scaled before the cast, a gradient of any magnitude keeps fp16's 11 bits relative to
    itself, down to fp16's smallest step below the message's largest value."""
    half, scale = codec.to_fp16(values)
    assert half.dtype == np.float16 and np.isfinite(half).all()
    back = codec.from_fp16(half, scale)
    assert back.dtype == np.float32
    error = np.abs(back.astype(np.float64) - values)
    assert (error <= np.maximum(np.abs(values.astype(np.float64)) * 2.0**-11, 2.0**-24 / scale)).all()


def _numpy_fp16(values: np.ndarray) -> tuple[np.ndarray, float]:
    """The scaled cast as numpy writes it (the codec's before the native core took it over)."""
    top = float(np.max(np.abs(values))) if values.size else 0.0
    with np.errstate(over="ignore"):  # a non-finite message is cast as it is: 1e10 becomes inf
        if not math.isfinite(top):
            return values.astype(np.float16), 1.0
        scale = 2.0 ** min(math.floor(math.log2(2.0**14 / top)), 100) if top > 0 else 1.0
        return (values * np.float32(scale)).astype(np.float16), scale


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.one_of(st.integers(0, 40), st.tuples(st.integers(0, 9), st.integers(0, 9))),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    )
)
def test_the_native_fp16_cast_is_numpys_bit_for_bit(values: np.ndarray) -> None:
    """Every value, shape, scale and rounding (ties to even, subnormals, NaN and infinities sent
    unscaled) as numpy's cast; and back, numpy's widening times 1/scale."""
    half, scale = codec.to_fp16(values)
    want, want_scale = _numpy_fp16(values)
    assert scale == want_scale and half.shape == values.shape and half.dtype == np.float16
    np.testing.assert_array_equal(half.view(np.uint16), want.view(np.uint16))
    back = codec.from_fp16(half, scale)
    with np.errstate(over="ignore"):  # fp16 rounded up past float32's largest: inf, as natively
        expected = half.astype(np.float32) * np.float32(1.0 / scale)
    assert back.flags.writeable and back.dtype == np.float32
    np.testing.assert_array_equal(back, expected)  # NaNs where NaNs are, every other value exactly


def test_fp16_gradients_round_trip_within_rounding() -> None:
    rng = np.random.default_rng(0)
    grads = (rng.standard_normal((50, 8)) * 1e-7).astype(np.float32)  # below fp16's normal range
    update = GradientUpdate(ranks=(1,), step=7, epoch=0, shard=0, tables={"t": (np.arange(50, dtype=np.uint64), grads)})
    message = encode_gradients(update, fp16=True)
    assert len(message) <= len(encode_gradients(update)) - 50 * 8 * 2 + 64
    decoded = decode_gradients(message).tables["t"][1]
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, grads, rtol=2.0**-10, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.int32, np.uint64, np.bool_]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    )
)
def test_array_round_trip(array: np.ndarray) -> None:
    out = unpack_array(pack_array(array))
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)


def test_non_contiguous_array_is_packed_by_value() -> None:
    array = np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(unpack_array(pack_array(array)), array)


def _base_buffer(array: np.ndarray) -> object:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview)
    return base.obj


def test_decode_is_zero_copy_and_read_only() -> None:
    ids = KeyedIds(("a",), np.arange(5, dtype=np.uint64), np.ones(5, np.int32))
    batch = Batch(0, 0, 0, ids, np.ones((5, 3), np.float32), np.zeros(5, np.float32))
    message = encode_batch(batch)
    decoded = decode_batch(message)
    whole = np.frombuffer(message, np.uint8)
    for array in (decoded.ids.values, decoded.ids.lengths, decoded.dense, decoded.labels):
        assert _base_buffer(array) is message
        assert np.shares_memory(array, whole)
        assert not array.flags.writeable
        assert array.flags.aligned
    # A writable buffer still decodes to read-only views, aliasing it.
    buffer = bytearray(message)
    values = decode_batch(buffer).ids.values
    assert not values.flags.writeable
    assert np.shares_memory(values, np.frombuffer(buffer, np.uint8))


def _message(kind: str, meta: dict, descriptors: list, tail: bytes = b"") -> bytes:
    header = msgpack.packb({"kind": kind, "meta": meta, "arrays": descriptors})
    return struct.pack("<4sBI", b"TRLM", codec.FORMAT_VERSION, len(header)) + header + tail


@pytest.fixture
def message() -> bytes:
    ids = KeyedIds(("a", "b"), np.arange(4, dtype=np.uint64), np.array([1, 1, 2, 0], np.int32))
    return encode_batch(Batch(1, 0, 0, ids, np.ones((2, 1), np.float32), np.ones(2, np.float32)))


@pytest.mark.parametrize(
    ("mutate", "message_part"),
    [
        (lambda m: b"XXXX" + m[4:], "bad magic"),
        (lambda m: m[:4] + bytes([codec.FORMAT_VERSION + 1]) + m[5:], "format version 2"),
        (lambda m: m[:3], "too short"),
        (lambda m: m[:9] + b"\xc1" + m[10:], "corrupt message header"),
        (lambda m: m[:5] + struct.pack("<I", 10**6) + m[9:], "truncated"),
        (lambda m: b"\x00" * len(m), "bad magic"),
    ],
)
def test_corrupt_input_raises_codec_error(message: bytes, mutate, message_part: str) -> None:
    with pytest.raises(CodecError, match=message_part):
        decode_batch(mutate(message))


def test_a_batch_whose_low_watermark_is_no_number_is_refused(message: bytes) -> None:
    header_len = struct.unpack("<I", message[5:9])[0]  # after the magic and the format version
    header = msgpack.unpackb(message[9 : 9 + header_len])
    header["meta"]["complete_through"] = "yesterday"
    first = header["arrays"][0][2]  # the arrays move 64 bytes on, past the longer header
    head = _message("batch", header["meta"], [[dtype, shape, at + 64] for dtype, shape, at in header["arrays"]])
    with pytest.raises(CodecError, match="complete_through must be a float"):
        decode_batch(head + bytes(first + 64 - len(head)) + message[first:])


def test_every_truncation_raises_codec_error(message: bytes) -> None:
    for end in range(len(message)):
        with pytest.raises(CodecError):
            decode_batch(message[:end])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_raises_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_batch(data)
    with pytest.raises(CodecError):
        decode_batch(b"TRLM\x01" + data)


def test_wrong_kind_is_named(message: bytes) -> None:
    with pytest.raises(CodecError, match="expected a 'gradients' message, got 'batch'"):
        decode_gradients(message)
    with pytest.raises(CodecError, match="expected a 'array' message"):
        unpack_array(message)


def test_hostile_descriptors() -> None:
    with pytest.raises(CodecError, match="unsupported array dtype 'O'"):
        unpack_array(_message("array", {}, [["O", [1], 64]], bytes(128)))
    with pytest.raises(CodecError, match="unsupported array dtype"):
        unpack_array(_message("array", {}, [["not a dtype", [1], 64]], bytes(128)))
    with pytest.raises(CodecError, match="truncated"):
        unpack_array(_message("array", {}, [["<f8", [2**62, 2**62], 64]], bytes(128)))
    with pytest.raises(CodecError, match="corrupt array descriptor"):
        unpack_array(_message("array", {}, [["<f8", [-1], 64]], bytes(128)))
    with pytest.raises(CodecError, match="corrupt array descriptor"):
        unpack_array(_message("array", {}, [["<f8", [1], 0]], bytes(128)))  # overlaps the header


def test_structurally_invalid_batch_is_a_codec_error() -> None:
    # Well-formed frame, but the lengths do not add up to the values.
    meta = {"batch_id": 0, "epoch": 0, "rank": 0, "keys": ["a"]}
    arrays = [
        np.arange(3, dtype=np.uint64),
        np.array([1], np.int32),
        np.zeros((1, 0), np.float32),
        np.zeros(1, np.float32),
    ]
    bad = codec._encode("batch", meta, arrays)
    with pytest.raises(CodecError, match="invalid batch message: lengths sum to 1 but there are 3"):
        decode_batch(bad)


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)
