"""REFERENCE ONLY: grouped AUC as its definition reads, scikit-learn's AUC per group in a plain
loop: the oracle of the tests of `trillium.metrics.gauc` and of whatever reports a GAUC."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score


def grouped_auc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> float:
    """The AUC of each group holding both classes, weighted by the group's size."""
    total = weight = 0.0
    for group in np.unique(groups):
        mask = groups == group
        if len(np.unique(labels[mask])) == 2:
            total += mask.sum() * roc_auc_score(labels[mask], scores[mask])
            weight += mask.sum()
    return total / weight
