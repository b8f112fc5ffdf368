"""Evaluation metrics shared by every component that evaluates a model. Numpy only but `auc`
(scikit-learn, imported there): the coordinator merges the ranks' grouped AUCs without it."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["auc", "gauc", "gauc_parts", "logloss", "task_metrics"]


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Area under the ROC curve of `scores` (any monotone score: probabilities or logits).

    NaN when `labels` hold a single class: AUC is undefined there, and an evaluation of a tiny
    split should report that rather than fail the job.
    """
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels).reshape(-1)
    if len(np.unique(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, np.asarray(scores, dtype=np.float64).reshape(-1)))


def gauc(labels: ArrayLike, scores: ArrayLike, groups: ArrayLike) -> float:
    """Grouped AUC: the AUC of each group's samples (a group: a user, say), averaged with each
    group's number of samples as its weight, over the groups holding both classes (a label > 0 is
    positive); NaN when no group does. `groups` holds any IDs numpy sorts (ints, strings).

    One sort by (group, score) for millions of rows: a sample's rank within its group, ties
    averaged, gives each group's AUC as Mann-Whitney's U / (positives x negatives), where
    U = (sum of the positives' ranks) - positives (positives + 1) / 2.
    """
    weighted, weight = gauc_parts(labels, scores, groups)
    return weighted / weight if weight else float("nan")


def gauc_parts(labels: ArrayLike, scores: ArrayLike, groups: ArrayLike) -> tuple[float, int]:
    """`gauc` as (the sum over the groups holding both classes of samples x AUC, their samples):
    what adds up across shares of the samples scored apart (`gauc` is the ratio)."""
    y = np.asarray(labels).reshape(-1) > 0
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    if not len(y) == len(s) == len(g):
        raise ValueError(f"{len(y)} labels, {len(s)} scores and {len(g)} groups: lengths differ")
    if np.isnan(s).any():
        raise ValueError("gauc: scores hold NaN")
    if not len(y):
        return 0.0, 0
    by_score = np.argsort(s, kind="stable")
    order = by_score[np.argsort(g[by_score], kind="stable")]  # by group, then score: np.lexsort's order, faster
    y, s, g = y[order], s[order], g[order]
    new_group = np.r_[True, g[1:] != g[:-1]]
    group = np.cumsum(new_group) - 1  # the sample's group, 0..G-1 in sorted order
    group_start = np.flatnonzero(new_group)
    run_start = np.flatnonzero(new_group | np.r_[True, s[1:] != s[:-1]])  # runs of equal (group, score)
    run_len = np.diff(np.r_[run_start, len(s)])
    # 1-based rank within the group, the mean of the run's ranks for every sample of a run of ties
    rank = np.repeat(run_start - group_start[group[run_start]] + (run_len + 1) / 2, run_len)
    n = np.bincount(group).astype(np.float64)
    pos = np.bincount(group, weights=y)
    neg = n - pos
    both = (pos > 0) & (neg > 0)
    u = np.bincount(group, weights=rank * y)[both] - pos[both] * (pos[both] + 1) / 2
    return float(np.sum(n[both] * u / (pos[both] * neg[both]))), int(np.sum(n[both]))


def logloss(labels: ArrayLike, probs: ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities `probs` (clipped to [eps, 1 - eps])."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), eps, 1.0 - eps)
    if len(y) != len(p):
        raise ValueError(f"{len(y)} labels but {len(p)} probabilities")
    if not len(y):
        raise ValueError("logloss of an empty set")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def task_metrics(
    kinds: list[str],
    labels: np.ndarray,
    scores: np.ndarray,
    groups: np.ndarray | None = None,
    grouped: np.ndarray | None = None,
) -> list[dict[str, float | int]]:
    """Each task's metrics over the samples labelled for it (its label not NaN); `labels` and
    `scores` are (N, T), task k of kind `kinds[k]`. A binary task: `auc` and `logloss`, and with
    `groups` (each sample's group ID) `gauc` over the samples `grouped` says have one
    (`gauc_samples` of them). A regression task: `mse` and `mae` on the scores' scale. Each:
    `samples`, how many were labelled for it."""
    out = []
    for k, kind in enumerate(kinds):
        has = ~np.isnan(labels[:, k])
        y, s = labels[has, k], scores[has, k]
        one: dict[str, float | int] = {"samples": int(has.sum())}
        if len(y) and kind == "binary":
            one["auc"], one["logloss"] = auc(y, s), logloss(y, s)
            if groups is not None and grouped is not None:
                both = has & grouped
                one["gauc"] = gauc(labels[both, k], scores[both, k], groups[both])
                one["gauc_samples"] = int(both.sum())
        elif len(y):
            error = s.astype(np.float64) - y
            one["mse"], one["mae"] = float(np.mean(error * error)), float(np.mean(np.abs(error)))
        out.append(one)
    return out
