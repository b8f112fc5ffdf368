"""Cells of an Arrow column read as text or as numbers, one column at a time (no Python per cell
unless a column holds a bad number).

An empty cell is a missing value, like a null. Text is what a categorical value is hashed from:
string columns as they are, other types as their canonical text (`15706` -> `"15706"`), so a
Parquet integer ID and the same ID in a CSV file hash alike. Numbers follow Python's `float()`:
pyarrow's parser takes the common forms at C speed, and a column it refuses is parsed again cell by
cell with `float()`, which accepts what it accepts (`" 5"`, `"1_000"`) and finds the culprits.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["as_numbers", "as_text", "present", "text_buffers"]


def _one(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def as_text(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The column as one string (or large string) array."""
    arr = _one(column)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr
    if pa.types.is_binary(arr.type):
        return arr.view(pa.string())
    if pa.types.is_large_binary(arr.type):
        return arr.view(pa.large_string())
    return pc.cast(arr, pa.string())


def text_buffers(text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """`(data uint8, offsets int32|int64)` of a string array, zero-copy: value `i` is
    `data[offsets[i]:offsets[i + 1]]` (the layout `trillium_native.hash_strings` takes)."""
    _, offsets, data = text.buffers()
    width = np.int64 if pa.types.is_large_string(text.type) else np.int32
    offsets = np.frombuffer(offsets, width)[text.offset : text.offset + len(text) + 1]
    return (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)), offsets


def present(text: pa.Array) -> np.ndarray:
    """bool[len]: the cells that hold a value (not null, not empty)."""
    _, offsets = text_buffers(text)
    mask = np.diff(offsets) > 0
    if text.null_count:
        mask &= text.is_valid().to_numpy(zero_copy_only=False)
    return mask


def as_numbers(column: pa.Array | pa.ChunkedArray, name: str) -> tuple[np.ndarray, dict[int, str]]:
    """float64 values, NaN where missing, and `{row: reason}` for the cells that hold no finite
    number (`"<name>: non-numeric value 'x'"`, `"<name>: non-finite value 'inf'"`)."""
    arr = _one(column)
    bad: dict[int, str] = {}
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        missing = ~arr.is_valid().to_numpy(zero_copy_only=False)
        values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)

        def cell(i: int) -> str:
            return str(values[i])

    else:
        text = as_text(arr)
        missing = ~present(text)
        if missing.any():  # an empty cell is missing, not a parse error
            text = pc.if_else(pa.array(missing), pa.scalar(None, text.type), text)
        raw = text.view(pa.large_binary() if pa.types.is_large_string(text.type) else pa.binary())
        try:
            values = pc.cast(text, pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:  # rare: parse cell by cell to find the culprits
            values = np.full(len(text), np.nan)
            for i, value in enumerate(raw.to_pylist()):
                try:
                    values[i] = float(value) if value is not None else np.nan
                except ValueError:
                    bad[i] = f"{name}: non-numeric value {value.decode('utf-8', 'replace')!r}"

        def cell(i: int) -> str:
            return raw[i].as_py().decode("utf-8", "replace")

    for i in np.flatnonzero(~np.isfinite(values) & ~missing):
        bad.setdefault(int(i), f"{name}: non-finite value {cell(int(i))!r}")
    return values, bad
