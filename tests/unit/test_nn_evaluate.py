"""The job's evaluation over every rank's scores: AUC and log loss over all samples, GAUC (with
`evaluation.group_by`) over the samples that have a group, against scikit-learn per group."""

from __future__ import annotations

import numpy as np
import pytest
from gauc_reference import grouped_auc
from sklearn.metrics import log_loss, roc_auc_score

from trillium.services.nn_worker.evaluate import Scored, summarize


def rank_scores(rng: np.random.Generator, n: int) -> Scored:
    labels = (rng.random(n) < 0.3).astype(np.float32)
    probs = np.clip(0.3 + 0.3 * labels - 0.15 + rng.random(n).astype(np.float32) * 0.5, 0.01, 0.99)
    groups = rng.integers(0, 12, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # hashed IDs: high bits
    grouped = rng.random(n) < 0.9  # a tenth have no ID in the slot
    return Scored(labels, probs.astype(np.float32), np.zeros(n, np.int64), groups, grouped)


def test_gauc_is_over_the_grouped_samples_of_every_rank() -> None:
    rng = np.random.default_rng(3)
    gathered = [rank_scores(rng, 700), rank_scores(rng, 500)]
    labels, probs, groups, grouped = (
        np.concatenate([getattr(g, f) for g in gathered]) for f in ("labels", "probs", "groups", "grouped")
    )
    got = summarize(gathered, "user")
    assert got["gauc"] == pytest.approx(grouped_auc(labels[grouped], probs[grouped], groups[grouped]), abs=1e-12)
    assert got["gauc_samples"] == int(grouped.sum()) < got["samples"] == 1200
    assert got["auc"] == pytest.approx(roc_auc_score(labels, probs), abs=1e-12)
    assert got["logloss"] == pytest.approx(log_loss(labels, probs), abs=1e-6)
    assert got["gauc"] != pytest.approx(got["auc"], abs=1e-3)


def test_no_gauc_without_group_by() -> None:
    got = summarize([rank_scores(np.random.default_rng(0), 100)], None)
    assert set(got) == {"auc", "logloss", "samples"}
