"""Events as samples: dotted paths, multi-valued fields, and every way a message is refused (with
the reason the dead-letter topic keeps)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from aiokafka import TopicPartition
from event_jobs import events_job

from trillium.data.features import TextCells
from trillium.data.sources.events import (
    FIELD_SEP,
    MULTI_SEP,
    BadEvent,
    Event,
    EventReader,
    EventRows,
    events_of,
    stream_encoder_config,
)
from trillium.data.sources.joiner import PartitionJoin
from trillium.job import JobConfig
from trillium.services.data_loader.stream import ahead, due_steps, upgrade_state
from trillium.wire import codec
from trillium.wire.batch import Batch, KeyedIds

GOOD = {"id": "e1", "ts": 1700000000.5, "user": {"id": 42, "recent": ["a", "b", None]}, "price": 3, "click": 1}


def test_a_good_event_gives_its_fields_as_text() -> None:
    reader = EventReader(events_job())
    event = reader.event(json.dumps(GOOD).encode())
    assert (event.key, event.time) == ("e1", 1700000000.5)
    assert reader.named(event) == {"user.id": "42", "user.recent": f"a{MULTI_SEP}b", "price": "3", "click": "1"}
    assert event.values == FIELD_SEP.join(["42", f"a{MULTI_SEP}b", "3", "1"])  # one text, the fields in order
    missing = reader.event(json.dumps(GOOD | {"price": None, "user": {"id": 42, "recent": None}}).encode())
    assert reader.named(missing) == {"user.id": "42", "user.recent": "", "price": "", "click": "1"}
    packed = EventReader(events_job(format="msgpack")).event(msgpack.packb(GOOD))
    assert packed == event


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not valid json"),
        (b"[1, 2]", "expected an object, got list"),
        (None, "empty message"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "price"}).encode(), "missing field 'price'"),
        (json.dumps(GOOD | {"user": {"recent": []}}).encode(), "missing field 'user.id'"),
        (json.dumps(GOOD | {"price": "cheap"}).encode(), "field 'price' (dense): expected a finite number"),
        (json.dumps(GOOD | {"price": math.nan}).encode(), "field 'price' (dense): expected a finite number"),
        (
            json.dumps(GOOD | {"user": {"id": {"nested": 1}, "recent": []}}).encode(),
            "field 'user.id': expected a string",
        ),
        (json.dumps(GOOD | {"user": {"id": "x" * (1 << 17), "recent": []}}).encode(), "a string of 131072 bytes"),
        (json.dumps(GOOD | {"ts": "yesterday"}).encode(), "field 'ts' (event time): expected seconds"),
    ],
)
def test_a_message_that_cannot_be_a_sample_says_why(raw, reason) -> None:
    with pytest.raises(BadEvent, match=reason.replace("(", r"\(").replace(")", r"\)")):
        EventReader(events_job()).event(raw)


def test_a_message_over_the_size_limit_is_refused_before_it_is_parsed() -> None:
    huge = json.dumps(GOOD | {"pad": "y" * 2000}).encode()
    with pytest.raises(BadEvent, match=f"message of {len(huge)} bytes"):
        EventReader(events_job(max_message_bytes=1024)).event(huge)


def test_a_stream_batch_carries_its_sample_ids_and_event_times_on_the_wire() -> None:
    ids = KeyedIds(keys=("user",), values=np.array([7, 8], np.uint64), lengths=np.array([1, 1], np.int32))
    batch = Batch(
        batch_id=3,
        epoch=0,
        rank=1,
        ids=ids,
        dense=np.zeros((2, 1), np.float32),
        labels=np.array([0, 1], np.float32),
        sample_ids=np.array([11, 12], np.uint64),
        event_times=np.array([1.5, 2.5]),
        complete_through=1.25,
    )
    assert codec.decode_batch(codec.encode_batch(batch)) == batch
    assert codec.decode_batch(codec.encode_batch(batch)).complete_through == 1.25
    plain = Batch(batch_id=3, epoch=0, rank=1, ids=ids, dense=batch.dense, labels=batch.labels)
    decoded = codec.decode_batch(codec.encode_batch(plain))
    assert decoded.sample_ids is None and decoded.complete_through is None


def _pooled(arrivals: list[tuple[int, float]]) -> EventRows:
    """Rows added in groups of (count, arrival time); each row's key is its arrival order."""
    rows, n = EventRows(events_job()), 0
    for count, at in arrivals:
        for _ in range(count):
            rows.add(Event(FIELD_SEP.join(["u", "r", "1.0"]), str(n), 0.0), "1")
            rows.arrived[-1] = at
            n += 1
    return rows


def _steps(rows: EventRows, now: float) -> list[list[int]]:
    return [
        sorted(int(e.key) for e in s.events)
        for s in due_steps(rows, np.random.default_rng(0), step=16, pool=64, timeout=1.0, now=now)
    ]


def test_picked_rows_come_in_the_order_asked_and_the_rest_keep_theirs() -> None:
    rows = _pooled([(10, 0.0)])
    for i in range(10):
        rows.arrived[i], rows.times[i], rows.labels[i] = float(i), 100.0 + i, str(i)
    for indices, left in (([7, 2, 9], [0, 1, 3, 4, 5, 6, 8]), ([4], [0, 1, 3, 4, 6, 8]), ([], [0, 1, 3, 4, 6, 8])):
        before = {int(e.key): (e, rows.labels[i], rows.times[i], rows.arrived[i]) for i, e in enumerate(rows.events)}
        want = [int(rows.events[i].key) for i in indices]
        picked = rows.pick(np.array(indices, np.int64))
        for part, keys in ((picked, want), (rows, left)):
            assert [int(e.key) for e in part.events] == keys
            assert list(zip(part.events, part.labels, part.times, part.arrived, strict=True)) == [
                before[k] for k in keys
            ]
    assert len(rows.pick(np.arange(len(rows))).events) == 6 and len(rows) == 0


def test_split_cuts_rows_in_consecutive_parts_of_a_size() -> None:
    rows = _pooled([(7, 0.0)])
    rows.times = [float(i) for i in range(7)]
    parts = rows.split(3)
    assert [[int(e.key) for e in p.events] for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p.times for p in parts] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0]]
    assert [len(p.labels) == len(p.arrived) == len(p) for p in parts] == [True] * 3
    assert rows.pick([]).split(3) == [] and len(rows) == 7


def test_the_cells_of_events_are_their_fields_and_an_event_of_other_fields_is_refused() -> None:
    job = stream_encoder_config(events_job())
    rows = EventRows(job)
    for i in range(3):
        rows.add(Event(FIELD_SEP.join([f"u{i}", MULTI_SEP.join(["a", "b"][:i]), str(i), "1"]), str(i), 0.0))
    cells = TextCells.of_rows(job, [e.values for e in rows.events], FIELD_SEP, rows.paths, rows.labels)
    columns = {
        "user.id": ["u0", "u1", "u2"],
        "user.recent": ["", "a", f"a{MULTI_SEP}b"],
        "price": ["0", "1", "2"],
        "click": ["1", "1", "1"],
    }
    expected = TextCells.of_columns(job, columns)
    np.testing.assert_array_equal(cells.lengths, [[1, 1, 1], [0, 1, 2]])
    np.testing.assert_array_equal(cells.lengths, expected.lengths)
    for got, want in zip(cells.ids, expected.ids, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cells.dense, [[0.0], [1.0], [2.0]])
    assert cells.labels == ["1", "1", "1"] and cells.cell(2, "user.recent") == f"a{MULTI_SEP}b"
    rows.add(Event(FIELD_SEP.join(["u3", "", "3"]), "3", 0.0))
    with pytest.raises(ValueError, match="row 3 has 3 fields, not 4"):
        TextCells.of_rows(job, [e.values for e in rows.events], FIELD_SEP, rows.paths, rows.labels)


def test_a_fast_stream_goes_out_in_whole_steps_and_no_sample_waits_past_the_timeout() -> None:
    # 100 rows waiting 1.2 s, 40 just in: 8 whole steps (4 drawn from the whole pool while more
    # than `pool` stay, 4 from its oldest) take every old row; 12 of the newest wait.
    rows = _pooled([(100, 0.0), (40, 1.1)])
    steps = _steps(rows, now=1.2)
    assert [len(s) for s in steps] == [16] * 8
    assert set(range(100)) <= {k for s in steps for k in s}
    assert len(rows) == 12 and min(rows.arrived) == 1.1
    assert _steps(rows, now=1.5) == []  # the 12 have not waited out their timeout
    # A mix of the pool is drawn at random while more than `pool` would stay.
    rows = _pooled([(100, 0.0)])
    assert [len(s) for s in _steps(rows, now=0.5)] == [16, 16]
    assert len(rows) == 68


def test_a_slow_stream_sends_what_it_has_after_the_timeout() -> None:
    rows = _pooled([(5, 0.0), (3, 0.9)])
    assert _steps(rows, now=0.9) == []
    assert _steps(rows, now=1.0) == [list(range(8))]  # one partial step: all of them
    assert len(rows) == 0


def test_partitions_ahead_of_the_slowest_in_event_time_are_paused_never_the_slowest() -> None:
    imps, clicks = [TopicPartition("imps", p) for p in range(2)], [TopicPartition("clicks", p) for p in range(2)]
    # Catching up: one impressions partition 30 s behind; the clicks, small messages, ran far ahead.
    times = {imps[0]: 1000.0, imps[1]: 1030.0, clicks[0]: 1001.5, clicks[1]: 1150.0}
    assert ahead(times, drift=2.0) == {imps[1], clicks[1]}
    # Caught up: within the drift of each other, none waits.
    assert ahead({tp: 1000.0 + 0.5 * i for i, tp in enumerate(imps + clicks)}, drift=2.0) == set()
    assert ahead({imps[0]: 5.0}, drift=0.0) == set() and ahead({}, drift=2.0) == set()


def _kafka_job() -> JobConfig:
    return JobConfig.model_validate(
        events_job().model_dump(mode="json")
        | {
            "data": {
                "source": "kafka",
                "event_time": "ts",
                "join": {"impressions": "i", "labels": "c", "key": "id", "window_seconds": 5},
            }
        }
    )


def _old_state(values: Any) -> dict[str, Any]:
    """A stream state as checkpoint formats 1 and 2 kept it: a list per event."""
    return {
        "rows": [[values, "r1", 1.0, "1", 1.5]],
        "joins": {
            "0": {
                "open": [[values, "k1", 10.0]],
                "held": [["k9", 12.0]],
                "closed": [["k2", [values, "k2", 5.0], False, 15.0], ["k3", None, True, 16.0]],
                "decided": [[[values, "k4", 7.0], True, 8.0, "positive"]],
                "counts": {"impressions": 4},
            }
        },
    }


@pytest.mark.parametrize("format", [1, 2])
def test_a_stream_state_of_an_older_checkpoint_format_reads_as_todays(format: int) -> None:
    """Format 1 kept each event's values as a dict by path (null: missing), formats 1 and 2 a list
    per event; a loader restoring either starts where its state says, as from today's."""
    job = _kafka_job()
    today = FIELD_SEP.join(["42", "", "3"])
    old = {"user.id": "42", "user.recent": None, "price": "3"} if format == 1 else today
    state = json.loads(json.dumps(upgrade_state(_old_state(old), job, format)))  # as a checkpoint keeps it
    join = PartitionJoin.from_state(job.data.join, state["joins"]["0"])
    assert json.loads(json.dumps(join.state())) == state["joins"]["0"]  # today's form, unchanged by a restore
    assert join.counts == {"impressions": 4} and join.open_count == 1
    join.label("k2", 16.0)  # closed negative, its event kept: corrected
    decided = join.advance(30.0)
    assert list(zip(decided.events, decided.kinds, decided.times, strict=True)) == [
        (Event(today, "k4", 7.0), "positive", 8.0),
        (Event(today, "k1", 10.0), "negative", 15.0),
        (Event(today, "k2", 5.0), "correction", 16.0),
    ]
    assert join.counts["unmatched_labels"] == 1  # k9's impression never came
    assert state["rows"] == {"values": [today], "keys": ["r1"], "times": [1.0], "labels": ["1"], "sample_times": [1.5]}
    rows = EventRows(job)
    rows.add(next(events_of(state["rows"])), "1")
    assert dict(zip(rows.paths, rows.events[0].values.split(FIELD_SEP), strict=True)) == {
        "user.id": "42",
        "user.recent": "",
        "price": "3",
    }
    assert rows.labels == ["1"]
