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
event time gives the samples it decided, in the stream's own mix.

Every impression is emitted exactly once as a positive or a negative (corrections come on top),
and its state — open impressions, held labels, recently closed ones — is a plain value
(`state`/`from_state`), checkpointed with the input offsets it matches.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from trillium.data.sources.events import Event, event_columns, events_of

if TYPE_CHECKING:
    from trillium.job import JoinConfig

__all__ = ["COUNTS", "Emitted", "PartitionJoin", "columns_of_rows"]

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


class Emitted(NamedTuple):
    """A sample: the impression, its label, and when it became a sample (event time)."""

    event: Event
    positive: bool
    time: float
    kind: Literal["positive", "negative", "correction"]


class PartitionJoin:
    def __init__(self, config: JoinConfig) -> None:
        self.window = config.window_seconds
        self.correct = config.late_labels == "correct"
        self.max_open = config.max_open_per_partition
        self.open: dict[str, Event] = {}
        self.ends: list[tuple[float, str]] = []  # heap of (window end, key) of open impressions
        self.held: dict[str, float] = {}  # labels before their impression: key -> label time
        self.held_order: list[tuple[float, str]] = []  # heap of (label time, key)
        # Impressions emitted in the last window of event time, for late labels: key -> (event, positive,
        # window end). A label later than that is late but cannot be corrected. The event is kept only
        # to correct it (late_labels: correct).
        self.closed: OrderedDict[str, tuple[Event | None, bool, float]] = OrderedDict()
        self.decided: list[tuple[float, int, Emitted]] = []  # heap of (decision time, seq, sample) to hand out
        self.seq = 0
        self.counts: Counter[str] = Counter()

    # ---- events ------------------------------------------------------------------------------
    def impression(self, event: Event) -> None:
        key = event.key
        assert key is not None
        self.counts["impressions"] += 1
        if key in self.open or key in self.closed:
            self.counts["duplicate_impressions"] += 1
            return
        self.open[key] = event
        heapq.heappush(self.ends, (event.time + self.window, key))
        held = self.held.pop(key, None)
        if held is not None:
            self._label_of_open(key, held)
        while len(self.open) > self.max_open:  # the oldest close early
            self._close_oldest(early=True)

    def label(self, key: str, time: float) -> None:
        self.counts["labels"] += 1
        if key in self.open:
            self._label_of_open(key, time)
        elif key in self.closed:
            event, positive, _ = self.closed[key]
            if positive:
                self.counts["duplicate_labels"] += 1
            else:
                self._late(key, event, time)
        elif key in self.held:
            self.counts["duplicate_labels"] += 1
        else:
            self.held[key] = time
            heapq.heappush(self.held_order, (time, key))

    def advance(self, watermark: float) -> list[Emitted]:
        """Close the windows that end at or before the watermark, drop the held labels it passed,
        and hand out the samples decided at or before it, in the order of their decisions."""
        while self.ends and self.ends[0][0] <= watermark:
            end, key = heapq.heappop(self.ends)
            if key in self.open and self.open[key].time + self.window == end:
                self._close(key, positive=False, time=end)
        while self.closed and next(iter(self.closed.values()))[2] <= watermark - self.window:
            self.closed.popitem(last=False)  # a label this late is counted as unmatched
        while self.held_order and self.held_order[0][0] <= watermark:
            time, key = heapq.heappop(self.held_order)
            if self.held.get(key) == time:
                del self.held[key]
                self.counts["unmatched_labels"] += 1
        out: list[Emitted] = []
        while self.decided and self.decided[0][0] <= watermark:
            out.append(heapq.heappop(self.decided)[2])
        return out

    # ---- helpers -----------------------------------------------------------------------------
    def _decide(self, sample: Emitted) -> None:
        heapq.heappush(self.decided, (sample.time, self.seq, sample))
        self.seq += 1

    def _label_of_open(self, key: str, time: float) -> None:
        event = self.open[key]
        if time <= event.time + self.window:
            # A label stamped before its impression is two clocks disagreeing (a producer's
            # skew, or the loader clamping each of a pair from the future as it reads them): a
            # key has a click only once it was shown. It is taken at the impression's time.
            self._close(key, positive=True, time=max(time, event.time))
        else:  # outside the window: the impression was not clicked in time
            self._close(key, positive=False, time=event.time + self.window)
            self._late(key, self.closed[key][0], time)

    def _late(self, key: str, event: Event | None, time: float) -> None:
        self.counts["late_labels"] += 1
        if event is not None:
            self.counts["corrections"] += 1
            self.closed[key] = (None, True, self.closed[key][2])  # corrected once
            self._decide(Emitted(event, True, time, "correction"))

    def _close(self, key: str, *, positive: bool, time: float) -> None:
        event = self.open.pop(key)
        self.counts["positives" if positive else "negatives"] += 1
        self.closed[key] = (event if self.correct and not positive else None, positive, event.time + self.window)
        while len(self.closed) > self.max_open:
            self.closed.popitem(last=False)
        self._decide(Emitted(event, positive, time, "positive" if positive else "negative"))

    def _close_oldest(self, early: bool) -> None:
        while self.ends:
            end, key = heapq.heappop(self.ends)
            if key in self.open and self.open[key].time + self.window == end:
                self.counts["closed_early"] += early
                self._close(key, positive=False, time=self.open[key].time)
                return

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A plain value, a list per field (`event_columns`)."""
        decided = [e for _, _, e in sorted(self.decided)]
        return _state(self.open.values(), self.held.items(), list(self.closed.items()), decided, self.counts)

    @classmethod
    def from_state(cls, config: JoinConfig, state: dict[str, Any]) -> PartitionJoin:
        join = cls(config)
        c = state["closed"]
        for key, values, time, positive, end in zip(
            c["keys"], c["values"], c["times"], c["positive"], c["ends"], strict=True
        ):
            join.closed[key] = (Event(values, key, time) if values is not None else None, positive, end)
        for event in events_of(state["open"]):
            join.open[event.key] = event
            heapq.heappush(join.ends, (event.time + join.window, event.key))
        for key, time in zip(state["held"]["keys"], state["held"]["times"], strict=True):
            join.held[key] = time
            heapq.heappush(join.held_order, (time, key))
        d = state["decided"]
        for event, positive, time, kind in zip(events_of(d), d["positive"], d["at"], d["kinds"], strict=True):
            join._decide(Emitted(event, positive, time, kind))
        join.counts.update(state["counts"])
        return join


def columns_of_rows(state: dict[str, Any]) -> dict[str, Any]:
    """A join's state as checkpoint formats 1 and 2 kept it (a list per event) in today's form."""
    return _state(
        (Event(*e) for e in state["open"]),
        state["held"],
        [(key, (Event(*e) if e is not None else None, positive, end)) for key, e, positive, end in state["closed"]],
        [Emitted(Event(*e), positive, time, kind) for e, positive, time, kind in state["decided"]],
        state["counts"],
    )


def _state(
    open_events: Iterable[Event],
    held: Iterable[tuple[str, float]],
    closed: list[tuple[str, tuple[Event | None, bool, float]]],
    decided: list[Emitted],
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
        "decided": event_columns(e.event for e in decided)
        | {
            "positive": [e.positive for e in decided],
            "at": [e.time for e in decided],
            "kinds": [e.kind for e in decided],
        },
        "counts": dict(counts),
    }
