"""`trillium replay`'s event encoding, column by column in Arrow, against the event each row
stands for, built one dict at a time as a reader would expect it."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pytest

from trillium.data.events_out import EventEncoder, nest


def expected_event(
    key_path: str, time_path: str, paths: list[str], dense: set[str], label: str | None, row: dict, key: str, at: float
) -> dict[str, Any]:
    """The event of a row: empty cells missing (null), dense cells as floats, others as text."""
    event: dict[str, Any] = {}
    nest(event, key_path, key)
    nest(event, time_path, at)
    for path in paths:
        cell = row[path.split(".")[-1]]
        nest(event, path, None if cell in (None, "") else float(cell) if path in dense else cell)
    if label:
        nest(event, label, row[label.split(".")[-1]])
    return event


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, an integral float equal to its int."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, (int, float)) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) in (type(b), int, float) and type(b) in (type(a), int, float)


ROWS = {
    "C1": ["a9b8", "", None, 'say "hi"', "back\\slash", "tab\there", "ünïcödé", "x"],
    "C2": ["1", "2", "3", "4", "5", "6", "7", "8"],
    "I1": ["12", "", None, "1e-7", "-3.25", "nan", "inf", "0"],
    "I2": [1.5, None, 2.0, 3e20, -0.0, 7.0, 8.0, 9.0],
    "label": ["1", "0", "", "1", None, "0", "1", "0"],
}


@pytest.mark.parametrize(
    ("key_path", "time_path", "paths", "label"),
    [
        ("request_id", "ts", ["C1", "C2", "I1", "I2"], None),
        ("meta.id", "meta.ts", ["user.C1", "C2", "ctx.num.I1", "ctx.I2"], "out.label"),
    ],
)
def test_json_events_are_the_rows_events(key_path, time_path, paths, label) -> None:
    dense = {p for p in paths if p.split(".")[-1].startswith("I")}
    table = pa.table(ROWS)
    encoder = EventEncoder(key_path, time_path, paths, dense, label, "json")
    keys = [f"r0-{i}".encode() for i in range(table.num_rows)]
    times = 1.7e9 + np.arange(table.num_rows) / 3000
    messages = encoder.events(table, keys, times)
    rows = table.to_pylist()
    for message, row, key, at in zip(messages, rows, keys, times, strict=True):
        want = expected_event(key_path, time_path, paths, dense, label, row, key.decode(), float(at))
        got = json.loads(message)
        assert same(got, want), (message, want)


def test_event_times_and_numbers_keep_every_digit() -> None:
    encoder = EventEncoder("k", "t", ["I1"], {"I1"}, None, "json")
    values = [0.1, 1 / 3, 1700000000.123456, 2.5e-300, 123456789012345680.0]
    times = np.array([1.7e9 + 1 / 7, 1.7e9, 0.1, 1e-9, 2e9])
    out = [json.loads(m) for m in encoder.events(pa.table({"I1": values}), [b"k"] * 5, times)]
    assert [e["I1"] for e in out] == values
    assert [e["t"] for e in out] == times.tolist()


def test_clicks_carry_the_key_and_their_own_time_at_their_paths() -> None:
    encoder = EventEncoder("meta.id", "meta.ts", ["C1"], set(), None, "json")
    times = np.array([1.7e9 + 0.5, 1.7e9 + 2.25])
    clicks = [json.loads(c) for c in encoder.clicks([b"r1-0", b'r1-"1"'], times)]
    assert clicks == [{"meta": {"id": "r1-0", "ts": 1.7e9 + 0.5}}, {"meta": {"id": 'r1-"1"', "ts": 1.7e9 + 2.25}}]


def test_msgpack_events_are_the_rows_events() -> None:
    paths, dense = ["user.C1", "I1", "I2"], {"I1", "I2"}
    table = pa.table(ROWS)
    encoder = EventEncoder("id", "ts", paths, dense, "label", "msgpack")
    keys = [f"k{i}".encode() for i in range(table.num_rows)]
    times = 1.7e9 + np.arange(table.num_rows, dtype=np.float64)
    for message, row, key, at in zip(encoder.events(table, keys, times), table.to_pylist(), keys, times, strict=True):
        want = expected_event("id", "ts", paths, dense, "label", row, key.decode(), float(at))
        assert same(msgpack.unpackb(message), want)
    assert msgpack.unpackb(encoder.clicks([b"k0"], times[:1])[0]) == {"id": "k0", "ts": float(times[0])}


def test_a_layout_that_cannot_be_one_event_is_refused() -> None:
    with pytest.raises(ValueError, match="nests inside 'C1'"):
        EventEncoder("id", "ts", ["C1", "C1.x"], set(), None, "json")
    with pytest.raises(ValueError, match="'id' is mapped twice"):
        EventEncoder("id", "ts", ["C1", "id"], set(), None, "json")


def test_slots_sharing_a_column_read_it_once() -> None:
    encoder = EventEncoder("id", "ts", ["user.C1", "C2", "user.C1"], set(), None, "json")
    [event] = encoder.events(pa.table({"C1": ["a|b"], "C2": ["c"]}), [b"k"], np.array([1.5]))
    assert json.loads(event) == {"id": "k", "ts": 1.5, "user": {"C1": "a|b"}, "C2": "c"}
