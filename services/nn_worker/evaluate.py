"""Scoring a rank's partition of the eval topic, the metrics over every rank's scores, and the
predictions in the order of the test batches (saved beside a model version's files)."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np

from trillium import metrics
from trillium.models import Objective
from trillium.wire import codec

from .embeddings import embeddings_of
from .feed import EpochEnd, Feed


class Scored(NamedTuple):
    """A rank's scores of its test batches (a tuple: `all_gather_object` pickles it)."""

    labels: np.ndarray  # float32[samples] (a multi-task job's [samples, T], NaN: no label)
    probs: np.ndarray  # float32, as `labels`: `Objective.scores`
    batch_ids: np.ndarray  # int64[samples]: each sample's batch
    groups: np.ndarray  # uint64[samples]: each sample's first ID in `evaluation.group_by`'s slot
    grouped: np.ndarray  # bool[samples]: whether it has one (all False without group_by)


async def score(
    feed: Feed, scores: Callable[..., Awaitable[np.ndarray]], group_by: str | None, objective: Objective
) -> Scored:
    """The labels, predicted probabilities, batch ids and GAUC groups (from slot `group_by`) of
    every batch of the feed's first epoch;
    `scores(batch, embeddings)` runs the model (on the rank's torch thread). The feed is stopped on
    the way out: its consumer, left running, would poll the job's topics forever — and, once they
    are deleted, spin on metadata requests (35% of a core per idle NN worker, and the broker's as much)."""
    labels, probs, batch_ids, groups, grouped = [], [], [], [], []
    try:
        while not isinstance(item := await feed.get(), EpochEnd):
            response = await item.lookup
            batch = codec.decode_batch(item.raw)
            probs.append(await scores(batch, embeddings_of(response)))
            labels.append(np.asarray(batch.labels))
            batch_ids.append(np.full(batch.batch_size, batch.batch_id, np.int64))
            if group_by is None:
                groups.append(np.zeros(batch.batch_size, np.uint64))
                grouped.append(np.zeros(batch.batch_size, bool))
            else:
                first, has = batch.ids.first(group_by)
                groups.append(first)
                grouped.append(has)
    finally:
        await feed.stop()
    if not labels:
        empty = np.zeros((0, *objective.label_shape), np.float32)
        return Scored(empty, empty, *(np.zeros(0, dtype) for dtype in (np.int64, np.uint64, bool)))
    return Scored(*(np.concatenate(x) for x in (labels, probs, batch_ids, groups, grouped)))


def summarize(gathered: list[Scored], group_by: str | None, objective: Objective) -> dict[str, Any]:
    """Every task's metrics over the scores of every rank (`tasks`, by name: `metrics.task_metrics`,
    GAUC over the samples that have a group with `group_by`), the first task's also at the top
    (a one-label job's `auc`, `logloss`, `gauc` as ever), and `samples`."""
    labels = np.concatenate([g.labels for g in gathered])
    probs = np.concatenate([g.probs for g in gathered])
    shape = (len(labels), -1)  # a one-label job's (N,) as one task's column
    groups = np.concatenate([g.groups for g in gathered]) if group_by is not None else None
    grouped = np.concatenate([g.grouped for g in gathered]) if group_by is not None else None
    kinds = [t.kind for t in objective.tasks]
    per_task = metrics.task_metrics(kinds, labels.reshape(shape), probs.reshape(shape), groups, grouped)
    return {**per_task[0], "samples": int(len(labels)), "tasks": dict(zip(objective.names, per_task, strict=True))}


def in_batch_order(gathered: list[Scored]) -> bytes:
    """Every rank's predictions as one float32 array ((samples,), or (samples, T) for several
    tasks) in the order of the test batches' ids (the test split's file order with one data
    loader), saved as `.npy` bytes."""
    probs = np.concatenate([g.probs for g in gathered]).astype(np.float32)
    order = np.argsort(np.concatenate([g.batch_ids for g in gathered]), kind="stable")
    out = io.BytesIO()
    np.save(out, probs[order])
    return out.getvalue()
