from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from trillium.metrics import auc, logloss


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
