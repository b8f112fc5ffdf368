"""The one wire codec of Trillium: a msgpack header followed by raw numpy buffers.

Frame layout (all integers little-endian):

    b"TRLM"  u8 format version  u32 header length  msgpack header  padding  buffer 0  buffer 1 ...

The header is `{"kind": str, "meta": {...}, "arrays": [[dtype, shape, offset], ...]}`, `offset`
counting from the start of the frame. Buffers start on 64-byte boundaries of the frame so decoded
arrays stay aligned.

Decoding is zero-copy: each array is `np.frombuffer` over a read-only memoryview of the message,
so **decoded arrays are read-only views that keep the whole message alive**; copy one
(`arr.copy()`) to modify it or to let the message go. Anything that is not a well-formed frame of
the expected kind and version raises `CodecError` (a `ValueError`) naming the problem.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

import trillium_native
from trillium.wire.batch import Batch, GradientUpdate, KeyedIds

__all__ = [
    "FORMAT_VERSION",
    "CodecError",
    "decode_batch",
    "decode_gradients",
    "encode_batch",
    "encode_gradients",
    "from_fp16",
    "gradients_meta",
    "pack_array",
    "to_fp16",
    "unpack_array",
]

FORMAT_VERSION = 1
_MAGIC = b"TRLM"
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
_ALIGN = 64
_PAD = bytes(_ALIGN)
# Plain numeric dtypes only: object or structured dtypes must never come off the wire.
_DTYPE_KINDS = frozenset("biuf")


BytesLike = bytes | bytearray | memoryview


class CodecError(ValueError):
    """Input is not a valid Trillium message of the expected kind and format version."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _encode(kind: str, meta: dict[str, Any], arrays: Sequence[np.ndarray]) -> bytes:
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    arrays = [a if a.flags.c_contiguous else a.copy(order="C") for a in arrays]
    for a in arrays:
        if a.dtype.kind not in _DTYPE_KINDS or a.dtype.fields is not None:
            raise CodecError(f"cannot encode an array of dtype {a.dtype} (plain numeric only)")

    def header_with(first_offset: int) -> bytes:
        descriptors, offset = [], first_offset
        for a in arrays:
            descriptors.append([a.dtype.str, list(a.shape), offset])
            offset = _aligned(offset + a.nbytes)
        return msgpack.packb({"kind": kind, "meta": meta, "arrays": descriptors})

    # Offsets are stored in the header, whose length depends on them: iterate to a fixed point
    # (msgpack ints only grow, so this settles in two or three rounds).
    start = _aligned(_PREFIX.size)
    while True:
        header = header_with(start)
        needed = _aligned(_PREFIX.size + len(header))
        if needed <= start:
            break
        start = needed
    parts: list[BytesLike] = [
        _PREFIX.pack(_MAGIC, FORMAT_VERSION, len(header)),
        header,
        _PAD[: start - _PREFIX.size - len(header)],
    ]
    for i, a in enumerate(arrays):
        if i:  # pad the previous buffer to the next boundary; nothing trails the last one
            parts.append(_PAD[: _aligned(arrays[i - 1].nbytes) - arrays[i - 1].nbytes])
        parts.append(a.data if a.nbytes else b"")
    return b"".join(parts)


def _decode(data: BytesLike, kind: str) -> tuple[dict[str, Any], list[np.ndarray]]:
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise CodecError(f"expected a contiguous bytes-like message: {e}") from None
    view = view.toreadonly()
    if len(view) < _PREFIX.size:
        raise CodecError(f"message too short ({len(view)} bytes) to be a Trillium message")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != _MAGIC:
        raise CodecError(f"not a Trillium message: bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported codec format version {version} (this build reads {FORMAT_VERSION})")
    header_end = _PREFIX.size + header_len
    if header_end > len(view):
        raise CodecError(f"truncated message: header needs {header_end} bytes, got {len(view)}")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : header_end])
    except Exception as e:  # msgpack raises a family of unrelated types on garbage
        raise CodecError(f"corrupt message header: {e}") from None
    if not isinstance(header, dict) or set(header) != {"kind", "meta", "arrays"}:
        raise CodecError("corrupt message header: expected keys kind, meta, arrays")
    if header["kind"] != kind:
        raise CodecError(f"expected a {kind!r} message, got {header['kind']!r}")
    if not isinstance(header["meta"], dict) or not isinstance(header["arrays"], list):
        raise CodecError("corrupt message header: meta must be a map and arrays a list")
    return header["meta"], [_array_at(view, d, header_end) for d in header["arrays"]]


def _array_at(view: memoryview, descriptor: object, data_start: int) -> np.ndarray:
    if not (isinstance(descriptor, list) and len(descriptor) == 3):
        raise CodecError(f"corrupt array descriptor {descriptor!r}")
    dtype_str, shape, offset = descriptor
    try:
        dtype = np.dtype(dtype_str) if isinstance(dtype_str, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _DTYPE_KINDS or dtype.fields is not None:
        raise CodecError(f"unsupported array dtype {dtype_str!r}")
    if not (
        isinstance(shape, list)
        and all(isinstance(n, int) and n >= 0 for n in shape)
        and isinstance(offset, int)
        and offset >= data_start
    ):
        raise CodecError(f"corrupt array descriptor {descriptor!r}")
    count = math.prod(shape)  # Python ints: a hostile shape cannot overflow
    end = offset + count * dtype.itemsize
    if end > len(view):
        raise CodecError(f"truncated message: an array needs bytes up to {end}, got {len(view)}")
    return np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape)


def _meta_fields(meta: dict[str, Any], *names: str, optional: tuple[str, ...] = ()) -> list[Any]:
    missing = [n for n in names if n not in meta]
    if missing or set(meta) - set(names) - set(optional):
        raise CodecError(
            f"corrupt message: meta has {sorted(meta)}, expected {sorted(names)}"
            + (f" (and maybe {sorted(optional)})" if optional else "")
        )
    return [meta[n] for n in names]


# A batch's optional arrays, in their order after the four it always has.
_BATCH_EXTRAS = ("sample_ids", "event_times")


def encode_batch(batch: Batch) -> bytes:
    extras = [name for name in _BATCH_EXTRAS if getattr(batch, name) is not None]
    meta = {
        "batch_id": int(batch.batch_id),
        "epoch": int(batch.epoch),
        "rank": int(batch.rank),
        "keys": list(batch.ids.keys),
    }
    if extras:
        meta["extras"] = extras
    if batch.complete_through is not None:
        meta["complete_through"] = float(batch.complete_through)
    arrays = [batch.ids.values, batch.ids.lengths, batch.dense, batch.labels]
    return _encode("batch", meta, arrays + [getattr(batch, name) for name in extras])


def decode_batch(data: BytesLike) -> Batch:
    """Decode `encode_batch`'s output; the arrays are read-only views into `data`."""
    meta, arrays = _decode(data, "batch")
    batch_id, epoch, rank, keys = _meta_fields(
        meta, "batch_id", "epoch", "rank", "keys", optional=("extras", "complete_through")
    )
    extras = meta.get("extras", [])
    complete_through = meta.get("complete_through")
    if complete_through is not None and not isinstance(complete_through, float):
        raise CodecError(f"corrupt batch message: complete_through must be a float, got {complete_through!r}")
    if not isinstance(extras, list) or not set(extras) <= set(_BATCH_EXTRAS) or len(set(extras)) != len(extras):
        raise CodecError(f"corrupt batch message: extras must be some of {list(_BATCH_EXTRAS)}, got {extras!r}")
    if len(arrays) != 4 + len(extras) or not isinstance(keys, list):
        raise CodecError(f"corrupt batch message: expected {4 + len(extras)} arrays and a list of keys")
    values, lengths, dense, labels = arrays[:4]
    try:
        ids = KeyedIds(keys=tuple(keys), values=values, lengths=lengths)
        return Batch(
            batch_id=batch_id,
            epoch=epoch,
            rank=rank,
            ids=ids,
            dense=dense,
            labels=labels,
            complete_through=complete_through,
            **dict(zip(extras, arrays[4:], strict=True)),
        )
    except ValueError as e:
        raise CodecError(f"invalid batch message: {e}") from None


def encode_gradients(update: GradientUpdate, *, fp16: bool = False) -> bytes:
    """All tables in two arrays (their IDs, their gradient rows flattened) and each table's row
    count and dim in the header: a message costs the same few buffers however many tables.
    `fp16` halves the gradient bytes (`to_fp16`: scaled so that none underflows)."""
    tables = list(update.tables.values())
    meta = {
        "ranks": [int(rank) for rank in update.ranks],
        "step": int(update.step),
        "epoch": int(update.epoch),
        "shard": int(update.shard),
        "tables": list(update.tables),
        "counts": [len(ids) for ids, _ in tables],
        "dims": [int(grads.shape[1]) for _, grads in tables],
    }
    ids = np.concatenate([ids for ids, _ in tables]) if tables else np.zeros(0, np.uint64)
    grads = np.concatenate([grads.ravel() for _, grads in tables]) if tables else np.zeros(0, np.float32)
    if fp16:
        grads, meta["scale"] = to_fp16(grads)
    return _encode("gradients", meta, [ids, grads])


def to_fp16(values: np.ndarray) -> tuple[np.ndarray, float]:
    """`values` (float32) scaled by a power of two and cast to float16, and that scale. fp16
    carries values up to 65504 and, below 2^-14, ever fewer bits down to 2^-24: embedding
    gradients (1e-4..1e-9) would lose most of theirs. The scale brings a message's largest value
    to about 2^14 before the cast (as mixed-precision training scales a loss); exact for every
    value the scaled fp16 holds. In the native core: numpy casts an element at a time."""
    return trillium_native.to_fp16_scaled(np.ascontiguousarray(values, dtype=np.float32))


def from_fp16(values: np.ndarray, scale: float) -> np.ndarray:
    """`to_fp16`'s values back as float32 (a new, writable array)."""
    return trillium_native.from_fp16_scaled(np.ascontiguousarray(values, dtype=np.float16), scale)


def decode_gradients(data: BytesLike) -> GradientUpdate:
    """Decode `encode_gradients`' output; the arrays are read-only views into `data`."""
    meta, arrays = _decode(data, "gradients")
    ranks, step, epoch, shard, tables, counts, dims = _meta_fields(
        meta, "ranks", "step", "epoch", "shard", "tables", "counts", "dims", optional=("scale",)
    )
    if not (
        isinstance(tables, list)
        and isinstance(counts, list)
        and isinstance(dims, list)
        and len(tables) == len(counts) == len(dims)
        and len(arrays) == 2
        and all(isinstance(n, int) and n >= 0 for n in counts + dims)
    ):
        raise CodecError("corrupt gradients message: expected tables, counts and dims of one length, and 2 arrays")
    ids, grads = arrays
    if grads.dtype == np.float16:
        scale = meta.get("scale", 1.0)
        if not (isinstance(scale, float) and scale > 0 and math.isfinite(scale)):
            raise CodecError(f"corrupt gradients message: fp16 scale {scale!r}")
        grads = from_fp16(grads, scale)
    if (
        ids.ndim != 1
        or grads.ndim != 1
        or len(ids) != sum(counts)
        or len(grads) != sum(n * d for n, d in zip(counts, dims, strict=True))
    ):
        raise CodecError(
            f"corrupt gradients message: {len(ids)} ids and {len(grads)} gradient values do not "
            f"fit row counts {counts} of dims {dims}"
        )
    per_table = {}
    row = value = 0
    try:
        for table, n, dim in zip(tables, counts, dims, strict=True):
            per_table[table] = (ids[row : row + n], grads[value : value + n * dim].reshape(n, dim))
            row, value = row + n, value + n * dim
        return GradientUpdate(ranks=ranks, step=step, epoch=epoch, shard=shard, tables=per_table)
    except (ValueError, TypeError) as e:  # TypeError: an unhashable table name
        raise CodecError(f"invalid gradients message: {e}") from None


def gradients_meta(data: BytesLike) -> tuple[tuple[int, ...], int]:
    """The ranks and the step of an `encode_gradients` message, from its header: a PS shard's
    bookkeeping reads no more of it (its native core applies the arrays as they are:
    `trillium_native.apply_gradients`, which checks them as `decode_gradients` does)."""
    meta, _ = _decode(data, "gradients")
    ranks, step = _meta_fields(
        meta, "ranks", "step", "epoch", "shard", "tables", "counts", "dims", optional=("scale",)
    )[:2]
    if not (isinstance(ranks, list) and ranks and all(isinstance(r, int) and r >= 0 for r in ranks)):
        raise CodecError(f"corrupt gradients message: ranks {ranks!r}")
    if not (isinstance(step, int) and step >= 0):
        raise CodecError(f"corrupt gradients message: step {step!r}")
    return tuple(ranks), step


def pack_array(array: np.ndarray) -> bytes:
    """One array (dtype, shape, data) as a self-describing frame, e.g. a gRPC `bytes` field."""
    return _encode("array", {}, [np.asarray(array)])


def unpack_array(data: BytesLike) -> np.ndarray:
    """Decode `pack_array`'s output: a read-only view into `data`."""
    _, arrays = _decode(data, "array")
    if len(arrays) != 1:
        raise CodecError(f"corrupt array message: expected 1 array, got {len(arrays)}")
    return arrays[0]
