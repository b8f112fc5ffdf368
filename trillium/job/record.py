"""A submitted job as the coordinator records it and hands it to the workers.

The record carries the job's state machine, its **attempt** and its **lineage**:

- Every recovery (and every resume) starts a new attempt from a complete checkpoint (a recovery
  of a job that has written none, from the beginning). Workers tag
  what they report and what they write to Kafka with the attempt, so nothing of an abandoned
  attempt — a late report, a zombie producer — is ever taken for the current one.
- The lineage says which records of the loader-written topics (samples, eval) belong to the
  current attempt's history. Per partition it is a list of segments `(first offset, attempt)`:
  a record at offset `o` counts iff its attempt header equals the attempt of the last segment
  starting at or before `o`. A new attempt restored from a checkpoint whose data loaders had
  written up to offset `E` appends `(E, new attempt)`: what the old attempt wrote after `E`
  is skipped, and the restored loaders write it again. A job that fails before its first
  checkpoint starts over: its new attempt's lineage is `(0, new attempt)` on every partition.

    submitted → starting → running ⇄ paused → stopping → finished | failed | stopped
                   ↓          ↓  ↑      ↓
                   ╰──────→ recovering (a new attempt from the last checkpoint, or from the
                                        beginning when the job has written none)
"""

from __future__ import annotations

import bisect
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from trillium.job import JobConfig, stored_config

JobState = Literal[
    "submitted", "starting", "running", "paused", "recovering", "stopping", "finished", "failed", "stopped"
]
ACTIVE: frozenset[str] = frozenset({"submitted", "starting", "running", "paused", "recovering", "stopping"})
TRANSITIONS: dict[str, frozenset[str]] = {
    "submitted": frozenset({"starting", "stopping", "failed"}),
    "starting": frozenset({"running", "recovering", "stopping", "failed"}),
    "running": frozenset({"paused", "recovering", "stopping", "finished", "failed"}),
    "paused": frozenset({"running", "recovering", "stopping", "failed"}),
    "recovering": frozenset({"running", "recovering", "stopping", "failed"}),
    "stopping": frozenset({"stopped", "failed"}),
    "finished": frozenset(),
    "failed": frozenset({"recovering"}),  # resumed from a checkpoint
    "stopped": frozenset({"recovering"}),
}
TERMINAL: frozenset[str] = frozenset(TRANSITIONS) - ACTIVE

# topic -> partition -> [(first offset, attempt), ...] sorted by offset
Lineage = dict[str, dict[int, list[tuple[int, int]]]]


class IllegalTransition(ValueError):
    pass


class Topics(BaseModel):
    samples: str  # train batches, one partition per NN rank
    eval: str  # test batches, one partition per NN rank
    gradients: str  # embedding gradients, one partition per PS shard
    dlq: str | None = None  # a stream's dead letters: messages that cannot be samples, with why


class CheckpointRef(BaseModel):
    """A complete checkpoint: the directory (or URL) holding its manifest."""

    location: str
    step: int


class Published(BaseModel):
    """The newest model version a job has published: the PS shards' next deltas diff from its cut."""

    version: int
    attempt: int
    step: int


class Recovery(BaseModel):
    at: float
    attempt: int = Field(description="the attempt this recovery started")
    kind: Literal["recovery", "resume", "reshard"] = "recovery"
    cause: str
    checkpoint_step: int | None = Field(description="the checkpoint it restored (None: it started from the beginning)")
    refused: list[str] = Field(default_factory=list, description="newer checkpoints passed over, and why")


class Reshard(BaseModel):
    """A live change of the job's number of PS shards (`POST /v1/jobs/{id}/reshard`): the ranks stop at
    a cut, a final checkpoint is taken there, and a new attempt restores it resharded onto `to_shards`."""

    requested_at: float
    from_shards: int
    to_shards: int
    seq: int = Field(description="the checkpoint request (checkpoint_seq) whose checkpoint it restores")
    state: Literal["pending", "done", "failed", "cancelled"] = Field(
        "pending",
        description="pending: waiting for its checkpoint; done: the new attempt started from it; failed: "
        "its checkpoint was abandoned (the job went on with from_shards); cancelled: stopped or ended first",
    )
    attempt: int | None = Field(None, description="the attempt that runs on to_shards")
    checkpoint_step: int | None = None
    done_at: float | None = None
    error: str | None = None


class ForgetMask(BaseModel):
    """IDs a forget removed (`POST /v1/jobs/{id}/forget`), masked in the batches the job had written
    before it: a later attempt that replays or re-reads those batches (a recovery from an older
    checkpoint) looks them up as zeros and creates no row. A batch after `through_batch` is new
    data, where such an ID is a new ID."""

    receipt: str = Field(description="the forget's receipt id")
    tables: dict[str, list[int]] = Field(description="table -> the forgotten IDs (u64, as the slots hash them)")
    through_batch: int = Field(description="the newest batch_id written to the samples topic when it ran")


class CheckpointFailures(BaseModel):
    """Checkpoints the job abandoned (a part that failed to write or timed out, a worker that did
    not answer): the job went on from each, its earlier checkpoints untouched."""

    count: int = 0
    last_step: int | None = None
    last_error: str | None = None
    last_at: float | None = None


class JobRecord(BaseModel):
    id: str
    state: JobState
    config: JobConfig
    topics: Topics
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None
    attempt: int = 0
    restore: CheckpointRef | None = Field(None, description="the checkpoint the current attempt started from")
    init_from: CheckpointRef | None = Field(None, description="the warm start of attempt 0 (config.init_from)")
    lineage: Lineage = Field(default_factory=dict)
    recoveries: list[Recovery] = Field(default_factory=list)
    checkpoint_seq: int = Field(
        0,
        description="checkpoints requested so far (API, every_seconds); the NN "
        "ranks cut at the first step after they agree on a new one",
    )
    publish_seq: int = Field(
        0,
        description="model versions requested so far (every_seconds); the NN ranks "
        "cut at the first step after they agree on a new one",
    )
    published: Published | None = Field(None, description="the newest model version published")
    checkpoint_failures: CheckpointFailures = Field(default_factory=CheckpointFailures)
    topics_deleted: bool = Field(
        False, description="its samples, eval and gradients topics deleted (a finished job's, once its workers left)"
    )
    stop_after: int | None = Field(
        None,
        description="a stop (or a reshard) asked with a final checkpoint: the checkpoint request "
        "(checkpoint_seq) whose checkpoint the job stops after",
    )
    reshards: list[Reshard] = Field(default_factory=list, description="live changes of ps_shards, oldest first")
    forgotten: list[ForgetMask] = Field(default_factory=list, description="forgets run on the job, oldest first")
    forgetting: str | None = Field(
        None, description="the receipt id of the forget running on the job: no resume or delete until it is done"
    )

    @field_validator("config", mode="before")
    @classmethod
    def _stored(cls, raw: Any) -> Any:
        return stored_config(raw)  # a record of an earlier Trillium: its tables hashed per slot

    @property
    def pending_reshard(self) -> Reshard | None:
        last = self.reshards[-1] if self.reshards else None
        return last if last is not None and last.state == "pending" else None

    def cancel_reshard(self, why: str, at: float | None) -> None:
        if (reshard := self.pending_reshard) is not None:
            reshard.state, reshard.error, reshard.done_at = "cancelled", why, at


class PartitionLineage:
    """Which records of one partition belong to the current attempt (see the module docstring)."""

    def __init__(self, segments: list[tuple[int, int]] | None) -> None:
        segments = sorted(segments or [(0, 0)])
        self._starts = [start for start, _ in segments]
        self._attempts = [attempt for _, attempt in segments]

    def counts(self, offset: int, attempt: int) -> bool:
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and self._attempts[i] == attempt


def fresh_lineage(job: JobRecord, attempt: int) -> Lineage:
    """The lineage of `attempt` started from the beginning: of every loader-written partition, only
    its own records count, wherever they land."""
    ranks = range(job.config.topology.nn_ranks)
    return {topic: {rank: [(0, attempt)] for rank in ranks} for topic in (job.topics.samples, job.topics.eval)}


def extend_lineage(lineage: Lineage, ends: dict[str, dict[int, int]], attempt: int) -> Lineage:
    """The lineage of `attempt`, restored from a checkpoint whose loaders had written up to `ends`."""
    out: Lineage = {}
    for topic in lineage.keys() | ends.keys():
        parts = lineage.get(topic, {})
        out[topic] = {}
        for partition in parts.keys() | ends.get(topic, {}).keys():
            segments = list(parts.get(partition, [(0, 0)]))
            end = ends.get(topic, {}).get(partition)
            if end is not None:
                segments = [s for s in segments if s[0] < end] + [(end, attempt)]
            out[topic][partition] = segments
    return out
