"""A PS shard's gradient ledger: which steps' gradients of which NN ranks its state holds, and which
attempt of the job applied each — exactly-once counted where the gradients land, not by the ranks
that sent them.

What one application is: a gradient message (`trillium.wire.batch.GradientUpdate`, one per PS
shard and step) holds one step's gradients of every NN rank an embedding worker serves; the shard
applies a step once every rank's message for it has come, each (step, rank) as part of that step's
one optimizer update. So the unit a shard's state can hold once, twice or not at all is
(step, rank), applied by the attempt whose Kafka header the message carries. Every rank sends
every shard a message for every step it trains, empty ones too (they advance the shard's
watermark), so a shard that holds a step holds it of every rank.

Kept as runs per rank, `(first, last, attempt)`: steps first..last, each applied once, all by
`attempt`, sorted and disjoint. Steps come in order, so a run grows at its end: a job of 10^6 steps
and k recoveries holds about k + 1 runs per rank. A (step, rank) applied to a state that already
holds it is recorded in `duplicates` (runs too, in the order they came; a third application
repeats a step there), counted in `duplicate_count` and logged by the shard — never silently.

The ledger travels with the state it describes: captured with the store at a checkpoint's cut
(`ledger_file` beside the snapshot), loaded with it on recovery, so what an abandoned attempt
applied after the cut vanishes with the rows it changed. A checkpoint written before ledgers
existed restores with `unknown_through` set to its step: what the state holds up to there is not
known, and a check of the ledger says so instead of passing.

Example:
    >>> ledger = GradientLedger()
    >>> for step in range(3):
    ...     _ = ledger.record(attempt=0, step=step, ranks=(0, 1))
    >>> ledger.record(attempt=1, step=2, ranks=(0, 1))  # step 2 again: both ranks' are duplicates
    [0, 1]
    >>> ledger.to_json()["contained"], ledger.to_json()["duplicates"], ledger.duplicate_count
    ({'0': [[0, 2, 0]], '1': [[0, 2, 0]]}, {'0': [[2, 2, 1]], '1': [[2, 2, 1]]}, 2)
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Sequence
from typing import Any

Run = tuple[int, int, int]  # (first step, last step, attempt)


class GradientLedger:
    """The (step, rank) applications a shard's state holds (see the module docstring)."""

    def __init__(
        self,
        contained: dict[int, list[Run]] | None = None,
        duplicates: dict[int, list[Run]] | None = None,
        duplicate_count: int = 0,
        unknown_through: int | None = None,
    ) -> None:
        self.contained: dict[int, list[Run]] = contained or {}  # rank -> runs, sorted, disjoint
        self.duplicates: dict[int, list[Run]] = duplicates or {}  # rank -> runs, as they came
        self.duplicate_count = duplicate_count
        self.unknown_through = unknown_through  # a step up to which the state's content is not known

    @classmethod
    def unknown(cls, through: int) -> GradientLedger:
        """Of a state restored from a checkpoint at step `through` that has no ledger."""
        return cls(unknown_through=through)

    # ---- recording ---------------------------------------------------------------------------------------
    def holds(self, rank: int, step: int) -> bool:
        runs = self.contained.get(rank, [])
        i = bisect.bisect_right(runs, (step, float("inf"))) - 1
        return i >= 0 and runs[i][0] <= step <= runs[i][1]

    def record(self, attempt: int, step: int, ranks: Iterable[int]) -> list[int]:
        """Record that `attempt` applied step `step` of `ranks` to the state; answers the ranks of
        which the state held that step already (the duplicates)."""
        again = []
        for rank in ranks:
            if self.holds(rank, step):
                _append(self.duplicates.setdefault(rank, []), step, attempt)
                self.duplicate_count += 1
                again.append(rank)
            else:
                _insert(self.contained.setdefault(rank, []), step, attempt)
        return again

    # ---- reading -----------------------------------------------------------------------------------------
    def steps(self, rank: int) -> list[tuple[int, int]]:
        """The steps held of `rank`, as (first, last) ranges, whichever attempts applied them."""
        out: list[tuple[int, int]] = []
        for first, last, _ in self.contained.get(rank, []):
            if out and out[-1][1] == first - 1:
                out[-1] = (out[-1][0], last)
            else:
                out.append((first, last))
        return out

    def copy(self) -> GradientLedger:
        return GradientLedger(
            {r: list(runs) for r, runs in self.contained.items()},
            {r: list(runs) for r, runs in self.duplicates.items()},
            self.duplicate_count,
            self.unknown_through,
        )

    # ---- the wire and checkpoint form --------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """JSON-ready: ranks as strings (JSON's keys), runs as [first, last, attempt]."""
        return {
            "contained": {str(r): [list(run) for run in runs] for r, runs in sorted(self.contained.items())},
            "duplicates": {str(r): [list(run) for run in runs] for r, runs in sorted(self.duplicates.items()) if runs},
            "duplicate_count": self.duplicate_count,
            "unknown_through": self.unknown_through,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> GradientLedger:
        def runs(value: dict[str, list[list[int]]]) -> dict[int, list[Run]]:
            return {int(r): [(int(a), int(b), int(c)) for a, b, c in rs] for r, rs in value.items()}

        ledger = cls(
            runs(raw.get("contained", {})),
            runs(raw.get("duplicates", {})),
            int(raw.get("duplicate_count", 0)),
            raw.get("unknown_through"),
        )
        for rank, held in ledger.contained.items():
            ordered = all(a[1] < b[0] for a, b in zip(held, held[1:], strict=False))
            if not ordered or any(first > last for first, last, _ in held):
                raise ValueError(f"ledger runs of rank {rank} are not sorted and disjoint: {held}")
        return ledger

    @classmethod
    def loads(cls, text: str | bytes) -> GradientLedger:
        return cls.from_json(json.loads(text))

    # ---- a state made of several ---------------------------------------------------------------------------
    @classmethod
    def merged(cls, ledgers: Sequence[GradientLedger | None], through: int) -> GradientLedger:
        """The ledger of a state loaded from several shards' checkpoint files (a reshard: each new
        shard keeps the rows it owns of every old shard's). A (step, rank) is held once only if every
        old shard held it (its rows may come from any of them; the attempt is the first one's);
        every old shard's duplicates stay. A file without a ledger (None) makes the whole unknown
        up to `through`, the checkpoint's step."""
        if not ledgers or any(ledger is None for ledger in ledgers):
            return cls.unknown(through)
        known = [ledger for ledger in ledgers if ledger is not None]
        first, rest = known[0], known[1:]
        unknown = [ledger.unknown_through for ledger in known if ledger.unknown_through is not None]
        out = cls(
            duplicate_count=sum(ledger.duplicate_count for ledger in known),
            unknown_through=max(unknown, default=None),
        )
        for rank, runs in first.contained.items():
            for other in rest:
                runs = _intersect(runs, other.contained.get(rank, []))
            if runs:
                out.contained[rank] = runs
        for ledger in known:
            for rank, runs in ledger.duplicates.items():
                out.duplicates.setdefault(rank, []).extend(runs)
        return out


def _append(runs: list[Run], step: int, attempt: int) -> None:
    """Add a step at the end of a log of runs (merged into the last run where it continues it)."""
    if runs and runs[-1][1] == step - 1 and runs[-1][2] == attempt:
        runs[-1] = (runs[-1][0], step, attempt)
    else:
        runs.append((step, step, attempt))


def _insert(runs: list[Run], step: int, attempt: int) -> None:
    """Add a step the runs do not hold, keeping them sorted, disjoint and merged."""
    if not runs or step > runs[-1][1]:
        _append(runs, step, attempt)  # the usual case: steps come in order
        return
    i = bisect.bisect_right(runs, (step, float("inf")))  # runs[:i] start at or before `step`
    runs.insert(i, (step, step, attempt))
    if i + 1 < len(runs) and runs[i + 1][0] == step + 1 and runs[i + 1][2] == attempt:
        runs[i : i + 2] = [(step, runs[i + 1][1], attempt)]
    if i > 0 and runs[i - 1][1] == step - 1 and runs[i - 1][2] == attempt:
        runs[i - 1 : i + 1] = [(runs[i - 1][0], runs[i][1], attempt)]


def _intersect(a: list[Run], b: list[Run]) -> list[Run]:
    """The steps both hold, as runs of `a`'s attempts."""
    out: list[Run] = []
    i = j = 0
    while i < len(a) and j < len(b):
        first, last = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if first > last:
            pass
        elif out and out[-1][1] == first - 1 and out[-1][2] == a[i][2]:
            out[-1] = (out[-1][0], last, a[i][2])
        else:
            out.append((first, last, a[i][2]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
