"""REFERENCE ONLY: the stream loader's joiner as it was in Python (dicts and heaps per event),
before it moved into the native core (issue 21). Kept as the oracle of tests/unit/test_joiner.py
and the baseline of `bench/online.py --joiner-only`; nothing else imports it. Unchanged but for
ties: of windows (or held labels) due at the same time, the one that came first is first, as the
native join orders them (this ordered them by key).

trillium/data/sources/joiner.py says what a join decides.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from typing import Any, NamedTuple


class Emitted(NamedTuple):
    event: Any
    positive: bool
    time: float
    kind: str


class ReferenceJoin:
    def __init__(self, window: float, correct: bool, max_open: int) -> None:
        self.window, self.correct, self.max_open = window, correct, max_open
        self.open: dict[str, Any] = {}
        self.opened: dict[str, int] = {}  # key -> arrival of the open impression
        self.ends: list[tuple[float, int, str]] = []
        self.held: dict[str, tuple[float, int]] = {}
        self.held_order: list[tuple[float, int, str]] = []
        self.closed: OrderedDict[str, tuple[Any, bool, float]] = OrderedDict()
        self.decided: list[tuple[float, int, Emitted]] = []
        self.seq = 0
        self.arrivals = 0
        self.counts: Counter[str] = Counter()

    def impression(self, event: Any) -> None:
        key = event.key
        self.counts["impressions"] += 1
        if key in self.open or key in self.closed:
            self.counts["duplicate_impressions"] += 1
            return
        self.arrivals += 1
        self.open[key], self.opened[key] = event, self.arrivals
        heapq.heappush(self.ends, (event.time + self.window, self.arrivals, key))
        held = self.held.pop(key, None)
        if held is not None:
            self._label_of_open(key, held[0])
        while len(self.open) > self.max_open:
            self._close_oldest()

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
            self.arrivals += 1
            self.held[key] = (time, self.arrivals)
            heapq.heappush(self.held_order, (time, self.arrivals, key))

    def advance(self, watermark: float) -> list[Emitted]:
        while self.ends and self.ends[0][0] <= watermark:
            end, seq, key = heapq.heappop(self.ends)
            if self.opened.get(key) == seq and key in self.open:
                self._close(key, positive=False, time=end)
        while self.closed and next(iter(self.closed.values()))[2] <= watermark - self.window:
            self.closed.popitem(last=False)
        while self.held_order and self.held_order[0][0] <= watermark:
            time, seq, key = heapq.heappop(self.held_order)
            if self.held.get(key) == (time, seq):
                del self.held[key]
                self.counts["unmatched_labels"] += 1
        out: list[Emitted] = []
        while self.decided and self.decided[0][0] <= watermark:
            out.append(heapq.heappop(self.decided)[2])
        return out

    def _decide(self, sample: Emitted) -> None:
        heapq.heappush(self.decided, (sample.time, self.seq, sample))
        self.seq += 1

    def _label_of_open(self, key: str, time: float) -> None:
        event = self.open[key]
        if time <= event.time + self.window:
            self._close(key, positive=True, time=max(time, event.time))
        else:
            self._close(key, positive=False, time=event.time + self.window)
            self._late(key, self.closed[key][0], time)

    def _late(self, key: str, event: Any, time: float) -> None:
        self.counts["late_labels"] += 1
        if event is not None:
            self.counts["corrections"] += 1
            self.closed[key] = (None, True, self.closed[key][2])
            self._decide(Emitted(event, True, time, "correction"))

    def _close(self, key: str, *, positive: bool, time: float) -> None:
        event = self.open.pop(key)
        del self.opened[key]
        self.counts["positives" if positive else "negatives"] += 1
        self.closed[key] = (event if self.correct and not positive else None, positive, event.time + self.window)
        while len(self.closed) > self.max_open:
            self.closed.popitem(last=False)
        self._decide(Emitted(event, positive, time, "positive" if positive else "negative"))

    def _close_oldest(self) -> None:
        while self.ends:
            _, seq, key = heapq.heappop(self.ends)
            if self.opened.get(key) == seq:
                self.counts["closed_early"] += 1
                self._close(key, positive=False, time=self.open[key].time)
                return
