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


async def score(feed: Feed, scores: Callable[..., Awaitable[np.ndarray]]) -> Scored:
    """The labels, predicted probabilities and batch ids of every batch of the feed's first epoch;
    `scores(batch, embeddings)` runs the model (on the rank's torch thread). The feed is stopped on
    the way out: its consumer, left running, would poll the job's topics forever — and, once they
    are deleted, spin on metadata requests (35% of a core per idle NN worker, and the broker's as much)."""
    labels, probs, batch_ids = [], [], []
    try:
        while not isinstance(item := await feed.get(), EpochEnd):
            response = await item.lookup
            batch = codec.decode_batch(item.raw)
            probs.append(await scores(batch, embeddings_of(response)))
            labels.append(np.asarray(batch.labels))
            batch_ids.append(np.full(batch.batch_size, batch.batch_id, np.int64))
    finally:
        await feed.stop()
    if not labels:
        return Scored(np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64))
    return Scored(np.concatenate(labels), np.concatenate(probs), np.concatenate(batch_ids))


def summarize(gathered: list[Scored]) -> dict[str, Any]:
    """AUC and log loss over the scores of every rank."""
    labels = np.concatenate([g.labels for g in gathered])
    probs = np.concatenate([g.probs for g in gathered])
    return {"auc": metrics.auc(labels, probs), "logloss": metrics.logloss(labels, probs), "samples": int(len(labels))}


def in_batch_order(gathered: list[Scored]) -> bytes:
    """Every rank's predictions as one float32 array in the order of the test batches' ids (the
    test split's file order with one data loader), saved as `.npy` bytes."""
    probs = np.concatenate([g.probs for g in gathered]).astype(np.float32)
    order = np.argsort(np.concatenate([g.batch_ids for g in gathered]), kind="stable")
    out = io.BytesIO()
    np.save(out, probs[order])
    return out.getvalue()
