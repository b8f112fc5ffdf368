"""Scoring a rank's partition of the eval topic, and the metrics over every rank's scores."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from trillium import metrics
from trillium.wire import codec

from .embeddings import embeddings_of
from .feed import EpochEnd, Feed


async def score(feed: Feed, scores: Callable[..., Awaitable[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predicted probabilities) of every batch of the feed's first epoch; `scores(batch,
    embeddings)` runs the model (on the rank's torch thread). The feed is stopped on the way out:
    its consumer, left running, would poll the job's topics forever — and, once they are deleted,
    spin on metadata requests (35% of a core per idle NN worker, and the broker's as much)."""
    labels, probs = [], []
    try:
        while not isinstance(item := await feed.get(), EpochEnd):
            response = await item.lookup
            batch = codec.decode_batch(item.raw)
            probs.append(await scores(batch, embeddings_of(response)))
            labels.append(np.asarray(batch.labels))
    finally:
        await feed.stop()
    if not labels:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(labels), np.concatenate(probs)


def summarize(gathered: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """AUC and log loss over the (labels, probabilities) of every rank."""
    labels = np.concatenate([g[0] for g in gathered])
    probs = np.concatenate([g[1] for g in gathered])
    return {"auc": metrics.auc(labels, probs), "logloss": metrics.logloss(labels, probs), "samples": int(len(labels))}
