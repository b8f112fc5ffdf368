"""The job's evaluation over every rank's scores: AUC and log loss over all samples, GAUC (with
`evaluation.group_by`) over the samples that have a group, against scikit-learn per group."""

from __future__ import annotations

import numpy as np
import pytest
from gauc_reference import grouped_auc
from sklearn.metrics import log_loss, roc_auc_score

from trillium.job import TaskConfig
from trillium.models import Objective
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
    got = summarize(gathered, "user", Objective.one_label())
    assert got["gauc"] == pytest.approx(grouped_auc(labels[grouped], probs[grouped], groups[grouped]), abs=1e-12)
    assert got["gauc_samples"] == int(grouped.sum()) < got["samples"] == 1200
    assert got["auc"] == pytest.approx(roc_auc_score(labels, probs), abs=1e-12)
    assert got["logloss"] == pytest.approx(log_loss(labels, probs), abs=1e-6)
    assert got["gauc"] != pytest.approx(got["auc"], abs=1e-3)


def test_no_gauc_without_group_by() -> None:
    got = summarize([rank_scores(np.random.default_rng(0), 100)], None, Objective.one_label())
    assert set(got) == {"auc", "logloss", "samples", "tasks"}
    assert got["tasks"] == {"label": {"auc": got["auc"], "logloss": got["logloss"], "samples": 100}}


def test_each_task_is_scored_over_the_samples_labelled_for_it() -> None:
    """Three tasks over two ranks, with labels missing (NaN) for some samples of each: every
    task's metrics equal scikit-learn's (numpy's for a regression) over its labelled samples."""
    rng = np.random.default_rng(5)
    tasks = [
        TaskConfig(name="click", column="c"),
        TaskConfig(name="watch", column="w", kind="regression", transform="log"),
        TaskConfig(name="buy", column="b", mask="c"),
    ]
    ranks = []
    for n in (700, 500):
        one = rank_scores(rng, n)
        labels = np.stack([one.labels, rng.normal(size=n), (rng.random(n) < 0.2)], axis=1).astype(np.float32)
        labels[rng.random(n) < 0.1, 0] = np.nan
        labels[rng.random(n) < 0.6, 2] = np.nan
        scores = np.stack([one.probs, rng.normal(size=n), rng.random(n)], axis=1).astype(np.float32)
        ranks.append(one._replace(labels=labels, probs=scores))
    got = summarize(ranks, "user", Objective(tasks, multitask=True))
    y = np.concatenate([r.labels for r in ranks])
    p = np.concatenate([r.probs for r in ranks])
    grouped = np.concatenate([r.grouped for r in ranks])
    groups = np.concatenate([r.groups for r in ranks])
    assert set(got["tasks"]) == {"click", "watch", "buy"} and got["samples"] == 1200
    for k in (0, 2):
        has = ~np.isnan(y[:, k])
        one = got["tasks"][tasks[k].name]
        assert one["samples"] == int(has.sum()) < 1200
        assert one["auc"] == pytest.approx(roc_auc_score(y[has, k], p[has, k]), abs=1e-12)
        assert one["logloss"] == pytest.approx(log_loss(y[has, k], p[has, k]), abs=1e-6)
        both = has & grouped
        expected = grouped_auc(y[both, k], p[both, k], groups[both])
        assert one["gauc"] == pytest.approx(expected, abs=1e-12) and one["gauc_samples"] == int(both.sum())
    watch = got["tasks"]["watch"]
    assert set(watch) == {"mse", "mae", "samples"} and watch["samples"] == 1200
    assert watch["mse"] == pytest.approx(float(np.mean((p[:, 1].astype(float) - y[:, 1]) ** 2)), rel=1e-9)
    assert watch["mae"] == pytest.approx(float(np.mean(np.abs(p[:, 1].astype(float) - y[:, 1]))), rel=1e-9)
    click = {k: v for k, v in got["tasks"]["click"].items() if k != "samples"}
    assert {k: v for k, v in got.items() if k not in ("tasks", "samples")} == click  # the first task's on top
