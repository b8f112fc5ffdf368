"""Evaluation metrics shared by every component that evaluates a model."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from sklearn.metrics import roc_auc_score

__all__ = ["auc", "logloss"]


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Area under the ROC curve of `scores` (any monotone score: probabilities or logits).

    NaN when `labels` hold a single class: AUC is undefined there, and an evaluation of a tiny
    split should report that rather than fail the job.
    """
    labels = np.asarray(labels).reshape(-1)
    if len(np.unique(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, np.asarray(scores, dtype=np.float64).reshape(-1)))


def logloss(labels: ArrayLike, probs: ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities `probs` (clipped to [eps, 1 - eps])."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), eps, 1.0 - eps)
    if len(y) != len(p):
        raise ValueError(f"{len(y)} labels but {len(p)} probabilities")
    if not len(y):
        raise ValueError("logloss of an empty set")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
