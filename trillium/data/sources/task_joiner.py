"""The joiner of a multi-task job: impressions and the labels of several tasks, each task's from a
topic of its own with a window of its own (`data.join.labels: [{topic, task, window_seconds}]`).

One `PartitionTaskJoin` per input partition (every topic is co-partitioned by the key). The caller
feeds events in arrival order and advances the watermark, as with the one-label joiner
(trillium.data.sources.joiner), and the join decides:

- an impression's **sample** when its shortest window closes (the watermark passes it), with each
  task's label known by then: "1" for a label at or before that end, else "0". Each impression is
  one sample, whichever labels come;
- a label of a task inside its own window but after that end: a **correction**, the impression
  again with that task's label "1" and no label ("") for the others, so it trains that task alone
  (a conversion a day after the impression whose click window closed long before);
- a label after its task's window: **late** (counted); with `late_labels: correct`, still a
  correction up to a second window of its task;
- a label before its impression: held until the impression comes, or the watermark passes it
  (then **unmatched**); a second label of a task for one impression: a duplicate (counted).

Labels are decided by event time, never by arrival: a label at or before the shortest window's
end is in the sample even when it arrives after a later one, so a replay decides as the first run
did. Decided samples leave in the order of their decision times (the window's end, or the
correcting label's time), each once the watermark passes it.

**Memory.** An impression is tracked from its arrival until its longest window (two, correcting
late labels) has closed, since a label may still come: a 24 h conversion window holds a day of
impressions. `max_open_per_partition` caps the tracked impressions of a partition: over it the one
whose window closes first is forgotten (counted `dropped_early`; a label of it then is unmatched)
or, if its sample has not left, its sample leaves at once with the labels known (`closed_early`).
Measured by `bench/task_join.py` on a 24 h window (48 h of event time at 20 impressions a second,
events of Criteo's 39 fields): 816 bytes a tracked impression, its event included; the memory
stays flat at the cap (or at a day of impressions, when the cap is higher) however long the
stream runs.

The join is native (`trillium_native.TaskJoin`, native/stream/src/task_join.rs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import trillium_native
from trillium.data.sources.events import Event, event_columns, events_of

if TYPE_CHECKING:
    from trillium.job import JobConfig

__all__ = ["COUNTS", "TASK_COUNTS", "PartitionTaskJoin", "TaskDecided"]

# What the join counts of impressions, and of each task's labels (the job view shows them).
COUNTS = ("impressions", "samples", "closed_early", "dropped_early", "duplicate_impressions")
TASK_COUNTS = ("labels", "in_sample", "corrections", "late_labels", "unmatched_labels", "duplicate_labels")


class TaskDecided(NamedTuple):
    """Samples, a list per field, in the order of their decisions: each impression, its labels
    (a text per task: "1", "0", or "" for none), when it became a sample (event time) and whether
    it corrects an earlier one."""

    events: list[Event]
    labels: list[tuple[str, ...]]
    times: list[float]
    corrections: list[bool]


class PartitionTaskJoin(trillium_native.TaskJoin):
    """The join of one input partition of a multi-task job: its events in arrival order
    (`impression`, `label`), `advance` to a watermark for what it decided. The native core
    joins; this adds the job's config and the checkpointed state."""

    tasks: list[str]

    def __new__(cls, job: JobConfig) -> PartitionTaskJoin:
        join = job.data.join  # type: ignore[union-attr]
        windows = {j.task: j.window_seconds for j in join.labels}
        self = super().__new__(
            cls, [windows[t.name] for t in job.tasks], join.late_labels == "correct", join.max_open_per_partition
        )
        self.tasks = [t.name for t in job.tasks]
        return self

    def advance(self, watermark: float) -> TaskDecided:
        """Emit the samples whose shortest window ends at or before the watermark, and hand out
        the samples decided at or before it, in the order of their decisions."""
        return TaskDecided(*super().advance(watermark))

    @property
    def counts(self) -> Counter[str]:
        return Counter({name: n for name, n in zip(COUNTS, self.count_values(), strict=True) if n})

    @property
    def task_counts(self) -> dict[str, Counter[str]]:
        """Each task's counts of its labels, by task name."""
        return {
            task: Counter({name: n for name, n in zip(TASK_COUNTS, values, strict=True) if n})
            for task, values in zip(self.tasks, self.task_count_values(), strict=True)
        }

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A plain value, a list per field (`event_columns`)."""
        tracked, held, decided = self.parts()
        d = TaskDecided(*decided)
        return {
            "tracked": event_columns(event for event, _, _ in tracked)
            | {
                # NaN (no label yet) as None: a checkpoint's msgpack keeps it, JSON views do not.
                "labels": [[None if math.isnan(t) else t for t in times] for _, times, _ in tracked],
                "emitted": [emitted for _, _, emitted in tracked],
            },
            "held": [{"keys": [k for k, _ in h], "times": [t for _, t in h]} for h in held],
            "decided": event_columns(d.events)
            | {"labels": [list(x) for x in d.labels], "at": list(d.times), "corrections": list(d.corrections)},
            "counts": dict(self.counts),
            "task_counts": {task: dict(c) for task, c in self.task_counts.items()},
        }

    @classmethod
    def from_state(cls, job: JobConfig, state: dict[str, Any]) -> PartitionTaskJoin:
        join = cls(job)
        t = state["tracked"]
        for event, times, emitted in zip(events_of(t), t["labels"], t["emitted"], strict=True):
            join.restore_tracked(event, _times(times), emitted)
        for task, held in enumerate(state["held"]):
            for key, time in zip(held["keys"], held["times"], strict=True):
                join.restore_held(task, key, time)
        d = state["decided"]
        for event, labels, time, correction in zip(events_of(d), d["labels"], d["at"], d["corrections"], strict=True):
            join.restore_decided(event, labels, time, correction)
        counts = state["task_counts"]
        join.restore_counts(
            [state["counts"].get(name, 0) for name in COUNTS],
            [[counts.get(task, {}).get(name, 0) for name in TASK_COUNTS] for task in join.tasks],
        )
        return join


def _times(times: Sequence[float | None]) -> list[float]:
    return [float("nan") if t is None else t for t in times]
