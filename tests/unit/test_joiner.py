"""The joiner on hand-made event sequences: out-of-order event times, late and early labels,
duplicates, the cap on open impressions, and its state surviving a restart."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from joiner_reference import ReferenceJoin

from trillium.data.sources.events import Event
from trillium.data.sources.joiner import Decided, PartitionJoin
from trillium.job import JoinConfig


def _config(**changes) -> JoinConfig:
    return JoinConfig(**{"impressions": "imps", "labels": "clicks", "key": "id", "window_seconds": 10.0} | changes)


def _imp(key: str, t: float) -> Event:
    return Event(f"f{key}", key, t)


def _outcome(decided: Decided) -> list[tuple[str, str, float]]:
    return [(e.key, kind, t) for e, kind, t in zip(decided.events, decided.kinds, decided.times, strict=True)]


def test_clicks_in_the_window_are_positives_and_closed_windows_negatives() -> None:
    join = PartitionJoin(_config())
    join.impression(_imp("a", 100))
    join.impression(_imp("b", 95))  # out of order in event time
    join.label("a", 104)  # inside a's window: positive, handed out once the watermark passes 104
    join.impression(_imp("c", 101))
    assert _outcome(join.advance(103.9)) == []
    assert _outcome(join.advance(104.9)) == [("a", "positive", 104)]  # b's window ends at 105: still open
    assert _outcome(join.advance(105)) == [("b", "negative", 105)]
    join.label("c", 111.5)  # 10.5 s after c: outside the window
    assert _outcome(join.advance(112)) == [("c", "negative", 111)]  # counted late, not corrected (count mode)
    assert join.counts == {"impressions": 3, "labels": 2, "positives": 1, "negatives": 2, "late_labels": 1}


def test_samples_leave_in_the_order_of_their_decisions_however_the_events_came() -> None:
    """A watermark that jumps (a lagging partition caught up) hands out positives and negatives
    interleaved by event time, not the positives first: batches keep the stream's mix."""
    join = PartitionJoin(_config())
    for i in range(6):
        join.impression(_imp(f"i{i}", 100 + i))
    for i in (1, 3, 5):
        join.label(f"i{i}", 100 + i + 9.5)  # decided as they come, in the last half second of the window
    assert [(k, kind) for k, kind, _ in _outcome(join.advance(200))] == [
        ("i0", "negative"),
        ("i1", "positive"),
        ("i2", "negative"),
        ("i3", "positive"),
        ("i4", "negative"),
        ("i5", "positive"),
    ]


def test_late_labels_are_corrected_once_and_early_labels_wait_for_their_impression() -> None:
    join = PartitionJoin(_config(late_labels="correct"))
    join.label("x", 50)  # before its impression arrived (the topics are not in step)
    join.impression(_imp("x", 45))  # clicked 5 s after it: positive when it comes
    join.impression(_imp("y", 40))
    out = _outcome(join.advance(51))  # y closes negative
    join.label("y", 52)  # too late: a correction
    join.label("y", 53)  # a second late click of y: a duplicate
    join.label("x", 55)  # a second click of x: a duplicate
    join.label("z", 60)  # no impression ever: unmatched once the watermark passes it
    out += _outcome(join.advance(61))
    assert out == [("x", "positive", 50), ("y", "negative", 50), ("y", "correction", 52)]
    assert join.counts == {
        "impressions": 2,
        "labels": 5,
        "positives": 1,
        "negatives": 1,
        "late_labels": 1,
        "corrections": 1,
        "duplicate_labels": 2,
        "unmatched_labels": 1,
    }


def test_a_label_stamped_before_its_impression_is_its_click_at_the_impression_time() -> None:
    """Clocks disagree (a skewed producer; the loader clamping a pair from the future to its own
    clock as it reads each): the click still makes its impression positive, never earlier."""
    join = PartitionJoin(_config())
    join.impression(_imp("a", 100))
    join.label("a", 99)  # the click's producer is a second behind
    join.label("b", 200)  # read before its impression, and stamped before it too
    join.impression(_imp("b", 201))
    assert _outcome(join.advance(300)) == [("a", "positive", 100), ("b", "positive", 201)]
    assert join.counts["unmatched_labels"] == 0


def test_over_the_cap_the_oldest_impressions_close_early() -> None:
    join = PartitionJoin(_config(max_open_per_partition=2))
    for i, t in enumerate((10, 12, 11, 13)):
        join.impression(_imp(f"k{i}", t))
    assert [(k, kind) for k, kind, _ in _outcome(join.advance(11))] == [("k0", "negative"), ("k2", "negative")]
    assert join.counts["closed_early"] == 2 and join.open_count == 2
    join.impression(_imp("k1", 12))
    assert join.counts["duplicate_impressions"] == 1 and join.open_count == 2


def test_the_state_restores_every_open_impression_held_label_decided_sample_and_counter() -> None:
    config = _config(late_labels="correct")
    join = PartitionJoin(config)
    join.impression(_imp("a", 100))
    join.impression(_imp("b", 100))
    join.label("early", 99)
    join.advance(50)
    join.label("a", 101)  # decided, not handed out yet
    restored = PartitionJoin.from_state(config, json.loads(json.dumps(join.state())))  # as in a checkpoint
    for j in (join, restored):  # the same future
        out = _outcome(j.advance(110))
        j.label("b", 111)
        assert out + _outcome(j.advance(200)) == [
            ("a", "positive", 101),
            ("b", "negative", 110),
            ("b", "correction", 111),
        ]
    assert restored.counts == join.counts


def _ops():
    """Random event sequences over a few keys (duplicates, keys open again after they closed) and
    a few whole or half seconds (ties), with watermarks that mostly move forward."""
    time = st.integers(0, 40).map(lambda t: t / 2)
    key = st.sampled_from(["a", "b", "c", "d", "e", "f"])
    op = st.one_of(
        st.tuples(st.just("impression"), key, time),
        st.tuples(st.just("label"), key, time),
        st.tuples(st.just("advance"), st.just(""), time),
        st.tuples(st.just("restore"), st.just(""), st.just(0.0)),
    )
    return st.lists(op, max_size=60)


@settings(max_examples=400, deadline=None)
@given(
    ops=_ops(),
    window=st.sampled_from([0.5, 1.0, 3.0]),
    correct=st.booleans(),
    max_open=st.integers(1, 5),
)
def test_the_native_join_decides_as_the_python_reference(ops, window, correct, max_open) -> None:
    """Event by event against the joiner as it was in Python (`joiner_reference`), a restore from
    its checkpointed state at random points included."""
    config = _config(
        window_seconds=window, late_labels="correct" if correct else "count", max_open_per_partition=max_open
    )
    join, reference = PartitionJoin(config), ReferenceJoin(window, correct, max_open)
    watermark = 0.0
    for op, key, t in ops:
        if op == "impression":
            join.impression(_imp(key, t + watermark))
            reference.impression(_imp(key, t + watermark))
        elif op == "label":
            join.label(key, t + watermark)
            reference.label(key, t + watermark)
        elif op == "advance":
            watermark += t / 4
            expected = [(e.event.key, e.kind, e.time) for e in reference.advance(watermark)]
            assert _outcome(join.advance(watermark)) == expected
        else:
            join = PartitionJoin.from_state(config, json.loads(json.dumps(join.state())))
        assert join.counts == reference.counts
        assert join.open_count == len(reference.open)
    expected = [(e.event.key, e.kind, e.time) for e in reference.advance(float("inf"))]
    assert _outcome(join.advance(float("inf"))) == expected
