"""No message stops a stream: whatever bytes come, `EventReader.events` gives each an `Event` or
a `BadEvent` with its reason (a dead letter), and never raises. Arbitrary bytes, nesting deeper
than any parser's stack, integers too large for a float, non-finite numbers, invalid UTF-8, every
field of a job given a value of every type, duplicate keys, and msgpack of every type, for JSON
and msgpack jobs, impressions and label events alike.

The reason is never the catch-all `UNREADABLE` one: an error the reader did not anticipate is
found here, not by a job in production."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillium.data.sources.events import UNREADABLE, BadEvent, Event, EventReader
from trillium.job import JobConfig

# The fields a job below maps: a slot, a multi-valued slot, a dense column, the label, the event
# time and the key.
FIELDS = ("id", "user.recent", "price", "click", "ts")


def _job(fmt: str = "json", *, joined: bool = False) -> JobConfig:
    data: dict = {"source": "kafka", "event_time": "ts", "format": fmt}
    if joined:
        data["join"] = {"impressions": "imps", "labels": "clicks", "key": "id", "window_seconds": 5}
    else:
        data |= {"topics": ["events"], "key": "id"}
    return JobConfig.model_validate(
        {
            "name": "poison",
            "data": data,
            "slots": [{"name": "id", "column": "id"}, {"name": "recent", "column": "user.recent"}],
            "tables": {"id": {"dim": 4}, "recent": {"dim": 4}},
            "dense": [{"column": "price", "normalization": "standard"}],
            "label": {"column": "click", "positive": "1", "negative": "0"},
            "model": {"cls": "trillium.models:DNN", "kwargs": {"num_dense": 1, "embedding_dims": [4, 4]}},
            "training": {"batch_size": 8, "epochs": None, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
        }
    )


READERS = {
    "json": EventReader(_job()),
    "msgpack": EventReader(_job("msgpack")),
    "joined-json": EventReader(_job(joined=True)),
}


def _nested(depth: int, inner: str = "1", kind: str = "[") -> str:
    if kind == "[":
        return "[" * depth + inner + "]" * depth
    return '{"a":' * depth + inner + "}" * depth


def _decided(reader: EventReader, raws: list[bytes | None]) -> None:
    """Each message an Event or a BadEvent with a reason that is not the catch-all, for both
    roles a join reads a message in, in one batch and one at a time."""
    for impression in (True, False):
        batch = reader.events(raws, impression=impression)
        assert len(batch) == len(raws)
        singles = [reader.events([raw], impression=impression)[0] for raw in raws]
        for got, single in zip(batch, singles, strict=True):
            assert isinstance(got, (Event, BadEvent)), got
            if isinstance(got, BadEvent):
                assert str(got) and not str(got).startswith(UNREADABLE), str(got)
                assert isinstance(single, BadEvent) and str(single) == str(got)
            else:
                assert single == got


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)  # json.dumps writes NaN and Infinity
    | st.text(max_size=8)
    | st.sampled_from([10**400 - 1, -(10**4000), 2**64, "\ud800", "a\x1eb", "x" * 70000]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def json_messages(draw) -> bytes | None:
    """An event whose every mapped field may be any JSON value (huge and non-finite numbers, lone
    surrogates among them), with duplicate keys, written deep, with invalid UTF-8, cut short, or
    not JSON at all."""
    members = []
    for field in ("id", "price", "click", "ts", "user", "x"):
        if draw(st.integers(0, 5)) == 0:
            continue
        value = draw(json_values)
        if field == "user" and draw(st.booleans()):
            value = {"recent": value}
        members.append(f'"{field}":{json.dumps(value)}')
        if draw(st.integers(0, 7)) == 0:  # the same key again: the last one wins (or it is refused)
            members.append(f'"{field}":{json.dumps(draw(json_values))}')
    raw = ("{" + ",".join(members) + "}").encode("utf-8", "surrogatepass")
    how = draw(
        st.sampled_from(["plain", "deep", "deep_value", "digits", "utf8", "cut", "bytes", "tombstone", "scalar"])
    )
    if how == "deep":  # deeper than Python's recursion limit and the native parser's
        return _nested(draw(st.integers(100, 5000)), kind=draw(st.sampled_from(["[", "{"]))).encode()
    if how == "deep_value":
        return ('{"id": "a", "ts": ' + _nested(draw(st.integers(100, 3000))) + "}").encode()
    if how == "digits":  # an integer past Python's 4,300-digit limit on int(str)
        field = draw(st.sampled_from(["ts", "price", "id", "click"]))
        return b'{"id": "a", "ts": 1.0, "price": 1, "click": 1, "' + field.encode() + b'": ' + b"9" * 5000 + b"}"
    if how == "utf8" and raw:
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + raw[at:]
    if how == "cut" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "tombstone":
        return None
    if how == "scalar":
        return json.dumps(draw(json_values)).encode("utf-8", "surrogatepass")
    return raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_messages(), min_size=1, max_size=6))
def test_any_json_message_is_an_event_or_a_dead_letter(raws) -> None:
    for name in ("json", "joined-json"):
        _decided(READERS[name], raws)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(width=32, allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**33), st.integers(0, 999_999_999)),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3) | st.binary(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def msgpack_messages(draw) -> bytes | None:
    """A map of the job's fields (or any other value) of every msgpack type, keys of any type,
    nesting beyond the unpacker's stack, strings that are not UTF-8, or random bytes."""
    how = draw(st.sampled_from(["map", "map", "any", "deep", "raw_str", "int_keys", "bytes"]))
    if how == "deep":
        depth = draw(st.integers(100, 5000))
        return b"\x91" * depth + b"\xc0"  # arrays of one, nested `depth` deep
    if how == "raw_str":  # a str whose bytes are not UTF-8
        return b"\x82\xa2id\xa2\xff\xfe\xa2ts\xcb" + b"\x3f\xf0" + b"\x00" * 6
    if how == "int_keys":
        return msgpack.packb({1: "a", 2.5: 4})
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "any":
        return msgpack.packb(draw(msgpack_values), use_bin_type=draw(st.booleans()))
    event = {}
    for field in ("id", "price", "click", "ts", "user"):
        if draw(st.integers(0, 5)) > 0:
            event[field] = draw(msgpack_values)
    return msgpack.packb(event, use_bin_type=draw(st.booleans()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(msgpack_messages(), min_size=1, max_size=6))
def test_any_msgpack_message_is_an_event_or_a_dead_letter(raws) -> None:
    _decided(READERS["msgpack"], raws)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        # An integer event time no float holds: `math.isfinite` raised OverflowError out of the loader.
        (b'{"id": "a", "ts": ' + b"9" * 400 + b"}", "field 'ts' (event time): expected seconds"),
        (
            b'{"id": "a", "ts": 1, "click": 1, "user": {"recent": []}, "price": ' + b"9" * 400 + b"}",
            "field 'price' (dense): expected a finite number",
        ),
        # Nested past the interpreter's recursion limit: json.loads raised RecursionError.
        (_nested(2000).encode(), "not valid json: nested too deep"),
        (_nested(2000, kind="{").encode(), "not valid json: nested too deep"),
    ],
)
def test_the_poison_pills_that_stopped_a_stream_are_dead_letters_with_their_reason(raw, reason) -> None:
    for name in ("json", "joined-json"):
        [got] = READERS[name].events([raw])
        assert isinstance(got, BadEvent) and str(got).startswith(reason), got


def test_a_reason_shows_a_bounded_part_of_a_huge_value() -> None:
    [got] = READERS["json"].events([b'{"id": "a", "ts": "' + b"y" * 60000 + b'"}'])
    assert isinstance(got, BadEvent) and len(str(got)) < 200, len(str(got))
