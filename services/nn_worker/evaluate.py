"""Scoring a rank's partition of the eval topic, the metrics over every rank's scores, and the
predictions in the order of the test batches (saved beside a model version's files)."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np

from trillium import metrics
from trillium.wire import codec

from .embeddings import embeddings_of
from .feed import EpochEnd, Feed


class Scored(NamedTuple):
    """A rank's scores of its test batches (a tuple: `all_gather_object` pickles it)."""

    labels: np.ndarray  # float32[samples]
    probs: np.ndarray  # float32[samples]
    batch_ids: np.ndarray  # int64[samples]: each sample's batch
    groups: np.ndarray  # uint64[samples]: each sample's first ID in `evaluation.group_by`'s slot
    grouped: np.ndarray  # bool[samples]: whether it has one (all False without group_by)


async def score(feed: Feed, scores: Callable[..., Awaitable[np.ndarray]], group_by: str | None) -> Scored:
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
        return Scored(*(np.zeros(0, dtype) for dtype in (np.float32, np.float32, np.int64, np.uint64, bool)))
    return Scored(*(np.concatenate(x) for x in (labels, probs, batch_ids, groups, grouped)))


def summarize(gathered: list[Scored], group_by: str | None) -> dict[str, Any]:
    """AUC and log loss over the scores of every rank; with `group_by`, GAUC over the samples
    that have a group, and how many did."""
    labels = np.concatenate([g.labels for g in gathered])
    probs = np.concatenate([g.probs for g in gathered])
    out = {"auc": metrics.auc(labels, probs), "logloss": metrics.logloss(labels, probs), "samples": int(len(labels))}
    if group_by is not None:
        grouped = np.concatenate([g.grouped for g in gathered])
        groups = np.concatenate([g.groups for g in gathered])
        out["gauc"] = metrics.gauc(labels[grouped], probs[grouped], groups[grouped])
        out["gauc_samples"] = int(grouped.sum())
    return out


def in_batch_order(gathered: list[Scored]) -> bytes:
    """Every rank's predictions as one float32 array in the order of the test batches' ids (the
    test split's file order with one data loader), saved as `.npy` bytes."""
    probs = np.concatenate([g.probs for g in gathered]).astype(np.float32)
    order = np.argsort(np.concatenate([g.batch_ids for g in gathered]), kind="stable")
    out = io.BytesIO()
    np.save(out, probs[order])
    return out.getvalue()
