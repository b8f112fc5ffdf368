"""The joiner: impressions and their labels (clicks) joined by key, in event time.

One `PartitionJoin` per input partition (the impressions and labels topics are co-partitioned by
the key, so an impression and its labels meet in the same one). The caller feeds events in arrival
order and advances the watermark (the least event time over its input partitions, less the allowed
lateness); the joiner decides what becomes a sample:

- a label whose impression is open, at most `window` after it (event time): a **positive** (one
  stamped before its impression too: clocks disagree, a click is always after its impression);
- an impression whose window ends at or before the watermark: a **negative**;
- a label for an impression already emitted negative, or outside the window: **late** (counted);
  with `late_labels: correct`, a positive **correction** sample of the same impression (up to a
  window of event time after the impression's closed; a label later still is counted unmatched);
- a label before its impression: held until the impression comes, or the watermark passes it
  (then it is **unmatched**);
- over `max_open` open impressions, the oldest closes early as a negative (counted).

A decided sample leaves when the watermark passes the event time of its decision (the click, or
the window's end), in that order. Positives are decided as their clicks come and negatives only
as windows close, so handing each out at once would make the output bursty (the watermark moves in
steps: a lagging partition holds every negative back, then releases them together), and a model
trained on batches of one label at a time swings with them. In decision order, each stretch of
event time gives the samples it decided, in the stream's own mix. Of windows ending (or held
labels due) at the same time, the one that came first goes first.

Every impression is emitted exactly once as a positive or a negative (corrections come on top),
and its state — open impressions, held labels, recently closed ones — is a plain value
(`state`/`from_state`), checkpointed with the input offsets it matches.

The join itself is native (`trillium_native.EventJoin`, native/stream/src/join.rs): a few hash-map and
heap operations an event cost half of a loader's CPU per event in Python. It holds the events as
the loader made them; tests/unit/joiner_reference.py keeps the Python join as its oracle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import trillium_native
from trillium.data.sources.events import Event, event_columns, events_of

if TYPE_CHECKING:
    from trillium.job import JoinConfig

__all__ = ["COUNTS", "Decided", "PartitionJoin", "columns_of_rows"]

# What a joiner counts (the job view shows them).
COUNTS = (
    "impressions",
    "labels",
    "positives",
    "negatives",
    "late_labels",
    "corrections",
    "closed_early",
    "unmatched_labels",
    "duplicate_impressions",
    "duplicate_labels",
)


class Decided(NamedTuple):
    """Samples, a list per field, in the order of their decisions: each impression, its label,
    when it became a sample (event time) and why."""

    events: list[Event]
    positive: list[bool]
    times: list[float]
    kinds: list[Literal["positive", "negative", "correction"]]


class PartitionJoin(trillium_native.EventJoin):
    """The join of one input partition: its events in arrival order (`impression`, `label`),
    `advance` to a watermark for what it decided. The native core joins; this adds the job's
    config and the checkpointed state."""

    def __new__(cls, config: JoinConfig) -> PartitionJoin:
        return super().__new__(
            cls, config.window_seconds, config.late_labels == "correct", config.max_open_per_partition
        )

    def advance(self, watermark: float) -> Decided:
        """Close the windows that end at or before the watermark, drop the held labels it passed,
        and hand out the samples decided at or before it, in the order of their decisions."""
        return Decided(*super().advance(watermark))

    @property
    def counts(self) -> Counter[str]:
        return Counter({name: n for name, n in zip(COUNTS, self.count_values(), strict=True) if n})

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A plain value, a list per field (`event_columns`)."""
        open_events, held, closed, decided = self.parts()
        return _state(open_events, held, closed, Decided(*decided), self.counts)

    @classmethod
    def from_state(cls, config: JoinConfig, state: dict[str, Any]) -> PartitionJoin:
        join = cls(config)
        c = state["closed"]
        for key, values, time, positive, end in zip(
            c["keys"], c["values"], c["times"], c["positive"], c["ends"], strict=True
        ):
            join.restore_closed(key, Event(values, key, time) if values is not None else None, positive, end)
        for event in events_of(state["open"]):
            join.restore_open(event)
        for key, time in zip(state["held"]["keys"], state["held"]["times"], strict=True):
            join.restore_held(key, time)
        d = state["decided"]
        for event, positive, time, kind in zip(events_of(d), d["positive"], d["at"], d["kinds"], strict=True):
            join.restore_decided(event, positive, time, kind)
        join.restore_counts([state["counts"].get(name, 0) for name in COUNTS])
        return join


def columns_of_rows(state: dict[str, Any]) -> dict[str, Any]:
    """A join's state as checkpoint formats 1 and 2 kept it (a list per event) in today's form."""
    return _state(
        (Event(*e) for e in state["open"]),
        state["held"],
        [(key, (Event(*e) if e is not None else None, positive, end)) for key, e, positive, end in state["closed"]],
        Decided(
            [Event(*e) for e, _, _, _ in state["decided"]],
            [positive for _, positive, _, _ in state["decided"]],
            [time for _, _, time, _ in state["decided"]],
            [kind for _, _, _, kind in state["decided"]],
        ),
        state["counts"],
    )


def _state(
    open_events: Iterable[Event],
    held: Iterable[tuple[str, float]],
    closed: list[tuple[str, tuple[Event | None, bool, float]]],
    decided: Decided,
    counts: Mapping[str, int],
) -> dict[str, Any]:
    held = list(held)
    return {
        "open": event_columns(open_events),
        "held": {"keys": [key for key, _ in held], "times": [time for _, time in held]},
        "closed": {
            "keys": [key for key, _ in closed],
            # The impression, kept only to correct a late label: its key is the entry's.
            "values": [e.values if e is not None else None for _, (e, _, _) in closed],
            "times": [e.time if e is not None else None for _, (e, _, _) in closed],
            "positive": [positive for _, (_, positive, _) in closed],
            "ends": [end for _, (_, _, end) in closed],
        },
        "decided": event_columns(decided.events)
        | {"positive": list(decided.positive), "at": list(decided.times), "kinds": list(decided.kinds)},
        "counts": dict(counts),
    }
