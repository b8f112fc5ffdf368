"""Progressive validation: the ranks' summaries, through JSON as Redis carries them, merge into the
AUC and log loss of the scores they hold (rolling and per window of event time), and a summary
stays small however many windows it carries."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from trillium.train.progressive_validation import BINS, WINDOWS_KEPT, Scores, TaskScores, merge

WINDOW = 60.0


def _batches(rng: np.random.Generator, steps: int, size: int, seconds_per_step: float):
    for step in range(steps):
        labels = rng.random(size) < 0.3
        probs = 1 / (1 + np.exp(-(rng.normal(size=size) + 1.2 * labels - 0.8)))
        times = 28_333_334 * WINDOW + step * seconds_per_step + rng.random(size) * seconds_per_step
        yield labels.astype(np.float64), probs, times


def test_merged_summaries_score_what_the_ranks_hold() -> None:
    rng = np.random.default_rng(0)
    ranks = [Scores(samples=100_000, window_seconds=WINDOW) for _ in range(2)]
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for step, batch in enumerate(_batches(rng, steps=40, size=512, seconds_per_step=7.0)):
        ranks[step % 2].add(*batch)
        seen.append(batch)
    labels, probs, times = (np.concatenate(c) for c in zip(*seen, strict=True))

    merged = merge([json.loads(json.dumps(r.summary())) for r in ranks])

    assert merged["samples"] == merged["scored"] == len(labels)
    # Exact up to ties inside a logit bin: 2048 of them over [-12, 12].
    assert abs(merged["auc"] - roc_auc_score(labels, probs)) < 2e-3
    assert abs(merged["logloss"] - log_loss(labels, probs)) < 1e-9
    starts = np.floor(times / WINDOW) * WINDOW
    assert [w["start"] for w in merged["windows"]] == sorted(set(starts.tolist()))
    for w in merged["windows"]:
        mine = starts == w["start"]
        assert w["samples"] == int(mine.sum())
        assert abs(w["auc"] - roc_auc_score(labels[mine], probs[mine])) < 2e-3
        assert abs(w["logloss"] - log_loss(labels[mine], probs[mine])) < 1e-9


def test_the_rolling_scores_are_the_latest_samples() -> None:
    rng = np.random.default_rng(1)
    scores = Scores(samples=1000, window_seconds=WINDOW)
    batches = list(_batches(rng, steps=5, size=300, seconds_per_step=1.0))
    for batch in batches:
        scores.add(*batch)
    labels, probs = (np.concatenate(c)[-1000:] for c in list(zip(*batches, strict=True))[:2])
    merged = merge([json.loads(json.dumps(scores.summary()))])
    assert merged["samples"] == 1000 and merged["scored"] == 1500
    assert abs(merged["auc"] - roc_auc_score(labels, probs)) < 2e-3
    assert abs(merged["logloss"] - log_loss(labels, probs)) < 1e-9


def test_a_summary_of_every_window_kept_stays_small() -> None:
    """An hour of windows, each with most bins filled: what a rank writes to Redis once a second
    and the coordinator reads on every job view (as sparse JSON pairs it was megabytes)."""
    scores = Scores(samples=100_000, window_seconds=WINDOW)
    rng = np.random.default_rng(2)
    for labels, _, times in _batches(rng, steps=2 * WINDOWS_KEPT, size=4096, seconds_per_step=WINDOW / 2):
        scores.add(labels, rng.random(len(labels)), times)  # uniform scores: every bin used
    summary = scores.summary()
    assert len(summary["windows"]["starts"]) == WINDOWS_KEPT
    assert len(json.dumps(summary)) < 2 * WINDOWS_KEPT * BINS  # under a byte per bin each side
    assert merge([summary])["windows"][-1]["samples"] == 2 * 4096


def _logit_bins(probs: np.ndarray) -> np.ndarray:
    """The logit bin of each probability, written out: 2048 bins over [-12, 12]."""
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    return np.clip(np.floor((np.log(p / (1 - p)) + 12.0) / 24.0 * BINS), 0, BINS - 1)


def test_the_grouped_auc_merges_each_ranks_latest_samples_by_group() -> None:
    """Each rank ranks a group's samples it holds (its last 1,000); the merged GAUC weights every
    (rank, group) holding both classes by its samples. Samples with no group count in no group."""
    rng = np.random.default_rng(4)
    ranks = [Scores(samples=1000, window_seconds=WINDOW, grouped=True) for _ in range(2)]
    held: list[list[tuple[np.ndarray, ...]]] = [[], []]
    for step, (labels, probs, times) in enumerate(_batches(rng, steps=12, size=300, seconds_per_step=1.0)):
        groups = rng.integers(0, 15, len(labels)).astype(np.uint64) << np.uint64(40)  # IDs with high bits
        has = rng.random(len(labels)) < 0.95
        ranks[step % 2].add(labels, probs, times, (groups, has))
        held[step % 2].append((labels, probs, groups, has))
    weighted = weight = 0.0
    for batches in held:
        labels, probs, groups, has = (np.concatenate(c)[-1000:] for c in zip(*batches, strict=True))
        for g in np.unique(groups[has]):
            mine = has & (groups == g)
            if len(np.unique(labels[mine])) == 2:
                weighted += mine.sum() * roc_auc_score(labels[mine], _logit_bins(probs[mine]))
                weight += mine.sum()
    merged = merge([json.loads(json.dumps(r.summary())) for r in ranks])
    assert merged["gauc"] == pytest.approx(weighted / weight, abs=1e-12)
    assert merged["gauc"] != pytest.approx(merged["auc"], abs=1e-3)


def test_no_grouped_auc_unless_the_scores_are_grouped() -> None:
    rng = np.random.default_rng(5)
    labels, probs, times = next(_batches(rng, steps=1, size=100, seconds_per_step=1.0))
    plain, grouped = (
        Scores(samples=100, window_seconds=WINDOW),
        Scores(samples=100, window_seconds=WINDOW, grouped=True),
    )
    plain.add(labels, probs, times)
    assert "gauc_parts" not in plain.summary() and merge([plain.summary()])["gauc"] is None
    with pytest.raises(ValueError, match="groups must come with them"):
        grouped.add(labels, probs, times)
    with pytest.raises(ValueError, match="groups must come with them"):
        plain.add(labels, probs, times, (np.zeros(100, np.uint64), np.ones(100, bool)))
    grouped.add(labels, probs, times, (np.zeros(100, np.uint64), np.zeros(100, bool)))  # no sample has a group
    assert merge([grouped.summary()])["gauc"] is None


def test_a_multitask_jobs_scores_are_each_tasks_over_its_labelled_samples() -> None:
    """Three tasks (binary, regression, binary with most labels missing) on two ranks: each task's
    merged scores are those of the samples labelled for it; the job's own are the first binary
    task's, and its summary is sent once."""
    rng = np.random.default_rng(4)
    kinds = {"watch": "regression", "click": "binary", "buy": "binary"}
    ranks = [TaskScores(kinds, samples=100_000, window_seconds=WINDOW, grouped=False) for _ in range(2)]
    seen = []
    for step, (labels, probs, times) in enumerate(_batches(rng, steps=20, size=256, seconds_per_step=7.0)):
        y = np.stack([rng.normal(size=256), labels, rng.random(256) < 0.2], axis=1)
        s = np.stack([y[:, 0] + rng.normal(size=256), probs, rng.random(256)], axis=1)
        y[rng.random((256, 3)) < np.array([0.1, 0.0, 0.7])] = np.nan
        ranks[step % 2].add(y, s, times)
        seen.append((y, s))
    y, s = (np.concatenate(c) for c in zip(*seen, strict=True))
    summaries = [json.loads(json.dumps(r.summary())) for r in ranks]
    assert summaries[0]["tasks"]["click"] is None  # the headline's is the summary's top level
    merged = merge(summaries)
    assert list(merged["tasks"]) == ["watch", "click", "buy"]
    watch = ~np.isnan(y[:, 0])
    assert merged["tasks"]["watch"]["samples"] == int(watch.sum()) < len(y)
    assert merged["tasks"]["watch"]["mse"] == pytest.approx(np.mean((s[watch, 0] - y[watch, 0]) ** 2), rel=1e-9)
    assert merged["tasks"]["watch"]["mae"] == pytest.approx(np.mean(np.abs(s[watch, 0] - y[watch, 0])), rel=1e-9)
    for k, name in ((1, "click"), (2, "buy")):
        has = ~np.isnan(y[:, k])
        task = merged["tasks"][name]
        assert task["samples"] == task["scored"] == int(has.sum())
        assert abs(task["auc"] - roc_auc_score(y[has, k], s[has, k])) < 2e-3
        assert abs(task["logloss"] - log_loss(y[has, k], s[has, k])) < 1e-9
    assert merged["auc"] == merged["tasks"]["click"]["auc"] and merged["samples"] == len(y)
