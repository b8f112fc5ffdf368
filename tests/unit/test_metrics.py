from __future__ import annotations

import math

import numpy as np
import pytest
from gauc_reference import grouped_auc
from sklearn.metrics import log_loss, roc_auc_score

from trillium.metrics import auc, gauc, logloss


def test_auc_matches_sklearn() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 500)
    scores = labels + rng.normal(0, 1, 500)
    assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores))
    assert auc([0, 1, 1], [0.1, 0.9, 0.8]) == 1.0


def test_auc_of_a_single_class_is_nan() -> None:
    assert math.isnan(auc([1, 1], [0.2, 0.3]))


def test_logloss() -> None:
    labels, probs = np.array([1, 0, 1, 0]), np.array([0.9, 0.2, 0.6, 0.5])
    assert logloss(labels, probs) == pytest.approx(log_loss(labels, probs))
    assert math.isfinite(logloss([1, 0], [0.0, 1.0]))  # clipped, not infinite
    with pytest.raises(ValueError, match="2 labels but 1"):
        logloss([1, 0], [0.5])


@pytest.mark.parametrize("seed", range(3))
def test_gauc_matches_sklearn_per_group(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.choice([1, 2, 3, 10, 50, 200], size=300)  # mixed sizes: singletons have one class
    groups = np.repeat(rng.permutation(len(sizes)), sizes)
    n = len(groups)
    labels = (rng.random(n) < rng.random(len(sizes))[groups]).astype(int)  # some groups all 0 or all 1
    scores = np.round(labels * 0.5 + rng.normal(0, 1, n), 1)  # rounded: many ties, across classes too
    order = rng.permutation(n)  # groups interleaved, as rows arrive
    labels, scores, groups = labels[order], scores[order], groups[order]
    skipped = [g for g in np.unique(groups) if len(np.unique(labels[groups == g])) < 2]
    assert len(skipped) > 50  # the test exercises the skipping
    expected = grouped_auc(labels, scores, groups)
    assert gauc(labels, scores, groups) == pytest.approx(expected, abs=1e-12)
    names = np.array([f"user-{g}" for g in groups])  # string IDs sort in another order: same result
    assert gauc(labels, scores, names) == pytest.approx(expected, abs=1e-12)
    assert gauc(labels.astype(bool), scores, names.tolist()) == pytest.approx(expected, abs=1e-12)


def test_gauc_of_one_group_is_auc() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 500)
    scores = np.round(labels + rng.normal(0, 1, 500), 1)
    assert gauc(labels, scores, np.full(500, 7)) == pytest.approx(auc(labels, scores), abs=1e-12)


def test_gauc_without_a_group_of_both_classes_is_nan() -> None:
    assert math.isnan(gauc([1, 1, 0, 0], [0.2, 0.3, 0.4, 0.1], ["a", "a", "b", "b"]))
    assert math.isnan(gauc([], [], []))


def test_gauc_refuses_lengths_that_differ() -> None:
    with pytest.raises(ValueError, match="3 labels, 3 scores and 2 groups"):
        gauc([1, 0, 1], [0.2, 0.3, 0.4], [1, 1])
    with pytest.raises(ValueError, match="2 scores"):
        gauc([1, 0, 1], [0.2, 0.3], [1, 1, 1])
