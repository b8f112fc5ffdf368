"""A rank's own progress through a job, checkpointed as rank-<r>.json."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trillium.wire.batch import Batch

from .step import StepResult

STREAM_LOSSES = 10_000  # a continuous job keeps its latest steps' losses, not every one


@dataclass
class RankState:
    """A rank's own progress, checkpointed as rank-<r>.json."""

    epochs: int | None  # None: a continuous job
    step: int = 0  # steps trained
    epoch: int = 0  # the epoch in progress (== epochs once every epoch is trained)
    position: int = 0  # the next samples record to read
    seq: int = 0  # the last checkpoint request served
    publish_seq: int = 0  # the last model version request served
    event_time: float | None = None  # the newest event time of a sample trained (streams)
    complete_through: float | None = None  # the newest batch's low watermark (streams): see Batch
    last_cut: int = -1  # the step of the last cut
    trained: int = 0
    loss_sum: float = 0.0
    train_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # the mean loss of every step (a stream's: the latest)
    task_losses: list[list[float]] = field(default_factory=list)  # a multi-task job's: per step, each task's
    per_epoch: list[dict[str, float]] = field(default_factory=list)  # samples and label sum of each epoch

    def __post_init__(self) -> None:
        if not self.per_epoch and self.epochs is not None:
            self.per_epoch = [{"samples": 0, "label_sum": 0.0} for _ in range(self.epochs)]

    def training(self) -> bool:
        return self.epochs is None or self.epoch < self.epochs

    def stepped(self, batch: Batch, position: int, result: StepResult, multitask: bool) -> None:
        """Count a step trained on `batch` (read up to record `position`)."""
        self.step += 1
        self.position = position
        self.trained += batch.batch_size
        self.loss_sum += result.loss_sum
        samples = result.control.samples
        if samples:  # not an idle stream's tick
            # The whole step's mean, every rank's batch in it: this rank's own sum over the step's
            # count would read 1/R of the loss, and jump on a step where the others had none.
            self.losses.append(sum(result.step_loss_sums) / samples)
            if multitask:
                self.task_losses.append([x / samples for x in result.step_loss_sums])
        if self.epochs is None:
            del self.losses[:-STREAM_LOSSES]
            del self.task_losses[:-STREAM_LOSSES]
        else:
            self.per_epoch[batch.epoch]["samples"] += batch.batch_size
            self.per_epoch[batch.epoch]["label_sum"] += float(np.nansum(batch.labels))

    def task_loss_curves(self, names: list[str]) -> dict[str, list[float]]:
        """A multi-task job's mean loss of every step, per task by name (empty for one label)."""
        return {name: [step[k] for step in self.task_losses] for k, name in enumerate(names) if self.task_losses}
