"""The batch decoder (`EventReader.events`, the native JSON fast path) against the reference
(`EventReader.event`, one message at a time): the same events, and for a message that cannot be a
sample the same reason, for random messages, malformed ones included."""

from __future__ import annotations

import json
import math
import time

import msgpack
import pytest
from event_jobs import events_job
from hypothesis import given, settings
from hypothesis import strategies as st

import trillium_native
from trillium.data.sources.events import BadEvent, Event, EventReader
from trillium.data.sources.joiner import PartitionJoin
from trillium.job import JobConfig


def _job(*, joined: bool = False, **data) -> JobConfig:
    job = events_job(dense=("price", "n"), **data)
    if not joined:
        return job
    raw = job.model_dump(mode="json")
    raw["data"] = {
        "source": "kafka",
        "event_time": "ts",
        "join": {"impressions": "imps", "labels": "clicks", "key": "id", "window_seconds": 5},
    }
    return JobConfig.model_validate(raw)


def _reference(reader: EventReader, raw: bytes | None, impression: bool):
    try:
        return reader.event(raw, impression=impression)
    except BadEvent as err:
        return ("bad", str(err))


def _same(reader: EventReader, raws: list[bytes | None], impression: bool = True) -> None:
    got = [("bad", str(e)) if isinstance(e, BadEvent) else e for e in reader.events(raws, impression=impression)]
    want = [_reference(reader, raw, impression) for raw in raws]
    assert got == want
    for g in got:  # the same types too (an Event of a float's time, not only equal values)
        if not isinstance(g, tuple) or g[0] != "bad":
            assert type(g) is Event and isinstance(g.time, float)


texts = st.text(max_size=6) | st.sampled_from(["", "a\x1fb", "a\x1eb", "\ud800", "é", "x" * 70000, '"', "\\"])
numbers = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 1e16, 1e15, 1e-5, 1e-4, 1.7e9, 2**63, -(2**63), 2**63 - 1])
)
scalars = st.none() | st.booleans() | numbers | texts
values = scalars | st.lists(scalars, max_size=4) | st.dictionaries(st.sampled_from(["id", "x"]), scalars, max_size=2)


@st.composite
def messages(draw) -> bytes | None:
    event: dict = {}
    members = [("id", scalars), ("ts", numbers | scalars), ("price", values), ("n", values), ("click", values)]
    for key, field in members + [("unread", values)]:  # no field maps "unread": only checked
        if draw(st.integers(0, 9)) > 0:
            event[key] = draw(field)
    if draw(st.integers(0, 9)) > 0:
        event["user"] = draw(st.fixed_dictionaries({}, optional={"id": values, "recent": values}) | values)
    text = json.dumps(event, indent=draw(st.sampled_from([None, 1])))
    raw = text.encode("utf-8", "surrogatepass")
    cut = draw(st.sampled_from(["none", "none", "none", "truncate", "garbage", "tombstone", "dup", "raw"]))
    if cut == "truncate" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if cut == "garbage":
        return raw + draw(st.sampled_from([b"x", b" ", b",", b"\xff", b"}"]))
    if cut == "tombstone":
        return None
    if cut == "dup":  # a duplicate key: the last one wins
        return raw[:-1] + b', "price": ' + json.dumps(draw(numbers)).encode() + b"}" if len(event) else raw
    if cut == "raw":  # hand-written JSON forms: escapes, exponents, BOM, NaN, deep nesting
        return draw(
            st.sampled_from(
                [
                    b'{"id": "\\u00e9\\ud83d\\ude00", "ts": 1E3, "user": {"id": -0, "recent": [1e-7, 2.50]},'
                    b' "price": 1.0e+2, "n": null, "click": true}',
                    b'\xef\xbb\xbf{"id": "a", "ts": 1, "user": {"id": 1, "recent": []}, "price": 1, "n": 1, "click": 1}',
                    b'{"id": "a", "ts": NaN, "user": {"id": 1, "recent": []}, "price": 1, "n": 1, "click": 1}',
                    b'{"id": "a", "ts": 1, "user": {"id": 1, "recent": [' + b"[" * 100 + b"]" * 100 + b"]}}",
                    b'{"id": "\\ud800", "ts": 1}',
                    b'{"id": "a\tb", "ts": 1}',
                    b'{"id": 1, "ts": 1.}',
                    b'{"id": 1, "ts": -}',
                    b'{"id": 01, "ts": 1}',
                    b'{"id": 1, "ts": 1e999, "user": {"id": 1, "recent": 1}, "price": 1, "n": 1, "click": 1}',
                ]
            )
        )
    return raw


@settings(max_examples=400, deadline=None)
@given(st.lists(messages(), max_size=8))
def test_a_batch_decodes_to_what_the_reference_makes_of_each_message(raws) -> None:
    _same(EventReader(_job()), raws)


@settings(max_examples=200, deadline=None)
@given(st.lists(messages(), max_size=8), st.booleans())
def test_a_joined_batch_of_impressions_or_labels_decodes_as_the_reference(raws, impression) -> None:
    _same(EventReader(_job(joined=True)), raws, impression=impression)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(messages(), max_size=10),
    st.booleans(),
    st.sampled_from([(-math.inf, math.inf), (0.0, 1e6), (-1e300, 0.0), (1.0, 1.0)]),
)
def test_a_fetch_taken_into_the_join_joins_what_the_reference_would(raws, impression, bounds) -> None:
    """`EventJoin.take`, as the stream loader calls it: decoded and joined natively up to each
    message it leaves to the caller, which takes that one as the reference does. The joins end
    equal to one fed event by event, and every bad or out-of-bounds message was left to the caller."""
    job = _job(joined=True)
    reader, (earliest, newest) = EventReader(job), bounds

    def reference_take(join: PartitionJoin, event: Event | BadEvent) -> float:
        if isinstance(event, BadEvent) or not earliest <= event.time <= newest:
            return -math.inf
        if impression:
            join.impression(event)
        else:
            join.label(event.key, event.time)
        return event.time

    expected, want_latest = PartitionJoin(job.data.join), -math.inf
    must_leave = []
    for i, event in enumerate(reader.events(raws, impression=impression)):
        taken = reference_take(expected, event)
        want_latest = max(want_latest, taken)
        if taken == -math.inf:
            must_leave.append(i)
    join, latest, left, i = PartitionJoin(job.data.join), -math.inf, [], 0
    while i < len(raws):
        i, joined = join.take(reader.native, raws, i, impression, earliest, newest)
        latest = max(latest, joined)
        if i < len(raws):
            left.append(i)
            [event] = reader.events([raws[i]], impression=impression)
            latest = max(latest, reference_take(join, event))
            i += 1
    assert set(must_leave) <= set(left)
    assert latest == want_latest
    assert join.counts == expected.counts
    assert join.advance(math.inf) == expected.advance(math.inf)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_numbers_read_as_python_writes_them(x, i) -> None:
    raw = json.dumps({"id": i, "ts": x, "user": {"id": x, "recent": [i, x]}, "price": x, "n": i, "click": x})
    reader = EventReader(_job())
    assert reader.native.decode([raw.encode()], True)[1] == []  # the fast path took it
    (event,) = reader.events([raw.encode()])
    assert event == reader.event(raw.encode())
    assert reader.named(event)["price"] == repr(x)
    assert event.key == str(i)
    assert not math.isnan(event.time)


def test_msgpack_batches_decode_as_the_reference() -> None:
    good = {"id": "e1", "ts": 1.5, "user": {"id": 42, "recent": ["a", None]}, "price": 3, "n": 2.5, "click": 1}
    raws = [msgpack.packb(good), b"\xc1", None, msgpack.packb(good | {"price": "x"}), msgpack.packb([1])]
    _same(EventReader(_job(format="msgpack")), raws)


def test_the_native_decoder_makes_events_of_a_tuple_class_made_in_python_only() -> None:
    fields = [("id", "slot")]
    for wrong in (tuple, time.struct_time, list):
        with pytest.raises(TypeError, match="subclass of tuple made in Python"):
            trillium_native.EventDecoder(fields, "ts", "id", 1024, 64, wrong)
    (event,), undecided = trillium_native.EventDecoder(fields, "ts", "id", 1024, 64, Event).decode(
        [b'{"id": "a", "ts": 2}'], True
    )
    assert (type(event), event, undecided) == (Event, ("a", "a", 2.0), [])


def test_a_message_over_the_size_limit_is_refused_in_a_batch_too() -> None:
    reader = EventReader(_job(max_message_bytes=1024))
    raw = json.dumps({"id": "x" * 2000, "ts": 1}).encode()
    (event,) = reader.events([raw])
    assert isinstance(event, BadEvent)
    assert str(event).startswith("message of")
