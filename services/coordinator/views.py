"""Every answer of the coordinator's API, as its response models (bodies.py: what it is sent).

Only models: observe.py and publish.py build some of these, and job_view.py assembles a job's
from every part of the coordinator, so this module imports none of them. The records the parts
keep themselves are answered as they are: `JobRecord`, `Worker`, `CheckpointInfo`,
`CheckpointRequested`, `ForgetReceipt`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from trillium.job.record import JobRecord

from .checkpoints import CheckpointInfo
from .registry import Worker


class ErrorResponse(BaseModel):
    detail: str


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI's `responses` for these error codes."""
    return {code: {"model": ErrorResponse} for code in codes}


# ---- a job's view ------------------------------------------------------------------------------


class JobProgressView(BaseModel):
    samples: int
    steps: int
    epoch: int
    samples_per_sec: float = Field(description="mean over the job's running time")
    recent_samples_per_sec: float | None = Field(
        description="over the last few seconds (0 while paused); null when not measured"
    )
    mean_loss: float | None
    last_loss: float | None


class StalenessView(BaseModel):
    bound: int | None
    max: int
    mean: float
    count: int
    histogram: list[int] = Field(description="lookups by staleness 0, 1, ..., 15 and 16 or more")


class AutoBoundView(BaseModel):
    bound: int = Field(description="the bound chosen")
    wait_ms: float = Field(description="a step's wait for its embeddings at k = 0 (the slowest rank's)")
    step_ms: float = Field(description="a step's own time: forward, backward, the dense all-reduce")
    steps: int = Field(description="the steps measured")
    reason: str
    refinements: list[dict[str, float]] = Field(
        default_factory=list,
        description="each check at the bound set that found a wait left and raised it: the bound, the wait "
        "and the step it measured, over how many steps",
    )


class WindowView(BaseModel):
    start: float = Field(description="event time (UNIX seconds) the window starts at")
    samples: int
    auc: float | None
    logloss: float | None


class ProgressiveView(BaseModel):
    """Progressive validation: every sample scored before it was trained on."""

    samples: int = Field(description="the latest samples the rolling metrics are over")
    scored: int = Field(description="samples scored so far, all ranks")
    auc: float | None
    gauc: float | None = Field(
        None, description="grouped AUC (evaluation.group_by), each rank's share ranked on its own; null without"
    )
    logloss: float | None
    windows: list[WindowView] = Field(description="per window of event time (training.progressive_window_seconds)")
    delay_seconds: dict[str, float] | None = Field(
        description="p50 and p99 of the time from a click's event time to its sample trained"
    )
    tasks: dict[str, dict[str, float | int | None]] | None = Field(
        None,
        description="a multi-task job's, per task over the samples labelled for it: samples, scored and "
        "auc, gauc, logloss (binary) or mse, mae (regression); the top level is the first binary task's",
    )


class InputView(BaseModel):
    topic: str
    partition: int
    lag_messages: int
    lag_seconds: float | None = Field(description="now less the event time of the last message read")


class StreamView(BaseModel):
    """A stream's input as its data loaders see it."""

    inputs: list[InputView]
    dead_letters: dict[str, int] = Field(description="messages sent to the dead-letter topic, by reason")
    skipped: dict[str, int] = Field(
        default_factory=dict,
        description="input records gone before they were read and skipped (data.on_gap: skip), by topic/partition",
    )
    joined: dict[str, int] = Field(
        description="the joiner's counts: impressions, labels, positives, negatives, "
        "late labels, corrections, closed early, unmatched, duplicates (a multi-task job's join: "
        "impressions, samples, closed early, dropped early, duplicate impressions)"
    )
    joined_tasks: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="a multi-task job's join, each task's counts of its labels: labels, in_sample, "
        "corrections, late_labels, unmatched_labels, duplicate_labels",
    )
    events: dict[str, int]


class JobView(BaseModel):
    job: JobRecord = Field(
        description="the record: state, config, timestamps, error, and the last "
        "evaluation metrics (`metrics`) once finished"
    )
    progress: JobProgressView
    staleness: dict[int, StalenessView]  # per NN rank
    auto_bound: AutoBoundView | None = Field(
        None,
        description="`staleness_bound: auto`: the bound chosen from the job's own timings, and why "
        "(null while it calibrates at k = 0, and for a job with a bound of its own)",
    )
    results: dict[int, dict[str, Any]]  # per NN rank, once it is done: samples, steps, loss curve, eval
    ledgers: dict[int, dict[int, dict[str, Any]]] = Field(
        default_factory=dict,
        description="per attempt, per PS shard: the gradient ledger of its state as of its last applied step "
        "(trillium.runtime.ledger: which (step, rank) it holds, applied by which attempt, and any applied twice); "
        "the job's current attempt's are the model's",
    )
    lost_workers: list[str] = Field(description="workers of this active job not heard from in time")
    waiting_for: list[str] = Field(
        default_factory=list,
        description="what the active job waits for: each lost worker and since when it is unreachable "
        "(its last heartbeat), e.g. 'embedding_ps-1 unreachable since 2026-11-29T00:51:02Z (no heartbeat for 42 s)'",
    )
    last_checkpoint: CheckpointInfo | None = Field(description="the newest complete checkpoint")
    checkpoint_in_progress: bool
    ps_shards: int = Field(description="the PS shards the job runs on now (`job.reshards`: its live changes)")
    reshard_in_progress: bool = Field(
        description="a reshard asked for and not yet running on its new shards (its checkpoint, then `recovering`)"
    )
    publish_failures: list[str] = Field(
        default_factory=list,
        description="model versions abandoned (the latest), and why; `job.published` is the newest",
    )
    progressive: ProgressiveView
    stream: StreamView | None = Field(
        description="a stream's input (data.source: kafka): lag per partition, dead letters, the joiner's counts"
    )


class SeriesPoint(BaseModel):
    time: float
    samples: int
    auc: float | None = Field(description="the rolling progressive AUC then")
    loss: float | None = Field(description="the latest step's mean loss then")


class StalenessReport(BaseModel):
    job_id: str
    bound: int | None = Field(description="the live bound; null: unbounded")
    ranks: dict[int, StalenessView]  # observed per NN rank since the job started


# ---- a job's tables ----------------------------------------------------------------------------


class TableStats(BaseModel):
    rows: int = 0
    memory_bytes: int = 0
    admitted: int = 0
    evicted: int = 0
    expired: int = 0
    nan_grads_skipped: int = 0
    # The disk tier (tables.X.memory_budget_gb): rows in RAM, rows and bytes on disk, looked-up
    # ids read back from disk. Without one, every row is resident and the rest is 0.
    resident_rows: int = 0
    disk_rows: int = 0
    disk_bytes: int = 0
    disk_lookup_hits: int = 0
    lookups: int = 0


class ShardTables(BaseModel):
    shard: int
    grpc_address: str
    tables: dict[str, TableStats]


class TablesView(BaseModel):
    job_id: str
    tables: dict[str, TableStats]  # summed over the shards
    shards: list[ShardTables]


# ---- models and workers ------------------------------------------------------------------------


class HeartbeatResponse(BaseModel):
    worker: Worker
    job: JobRecord | None = Field(
        description="the current job, how the coordinator hands out work; null when there is "
        "none, and when it is the record the heartbeat's job_digest names (unchanged)"
    )
    job_digest: str | None = Field(description="names the current job's record as it stands; null: no job")
