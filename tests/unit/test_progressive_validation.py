"""Progressive validation: the ranks' summaries, through JSON as Redis carries them, merge into the
AUC and log loss of the scores they hold (rolling and per window of event time), and a summary
stays small however many windows it carries."""

from __future__ import annotations

import json

import numpy as np
from sklearn.metrics import log_loss, roc_auc_score

from trillium.train.progressive_validation import BINS, WINDOWS_KEPT, Scores, merge

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
