"""Progressive validation: every batch is scored before it is trained on, so the scores of the
samples trained so far are an honest test of the model as it was (the usual online metric of a
recommender trained on a stream; on files, the first epoch's scores are such a test too).

Each NN rank keeps its latest samples' scores as histograms over the logit (`BINS` bins on
[-`LOGIT_RANGE`, `LOGIT_RANGE`]: AUC from them is exact up to ties inside a bin) with their log
loss, over the last `samples` samples and per window of event time, and publishes a summary;
the coordinator merges the ranks' summaries into a rolling AUC and log loss (`merge`). Numpy only:
the coordinator needs no scikit-learn for it.

A multi-task job's rank scores each task over the samples labelled for it (`TaskScores`: a regression
task by its rolling MSE and MAE); the first binary task's scores are the job's headline ones.

With `evaluation.group_by`, a rank also scores its latest samples by grouped AUC (the logit bins as
scores) and publishes it as `gauc_parts`; the merged GAUC adds the ranks' parts up. A group (a
user) whose samples two ranks score is two groups there, each ranked within its own share: exact
with one NN rank, and with several the per-group AUCs of smaller shares.
"""

from __future__ import annotations

import base64
import collections
import zlib
from typing import Any

import numpy as np

from trillium.job import JobConfig
from trillium.metrics import gauc_parts

BINS = 2048
LOGIT_RANGE = 12.0
WINDOWS_KEPT = 60  # the latest windows of event time a rank reports
_EPS = 1e-7


def bins_and_losses(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int32 bin of each probability's logit, and each sample's log loss (one clip and two
    logarithms serve both: this runs on every step of every rank)."""
    p = np.clip(np.asarray(probs, np.float64), _EPS, 1 - _EPS)
    log_p, log_q = np.log(p), np.log1p(-p)
    bins = ((log_p - log_q + LOGIT_RANGE) / (2 * LOGIT_RANGE) * BINS).astype(np.int32)
    np.clip(bins, 0, BINS - 1, out=bins)
    y = np.asarray(labels, np.float64)
    return bins, -(y * log_p + (1 - y) * log_q)


def _counts(bins: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """[2, BINS] counts (positives, negatives) of samples' bins: one bincount, where `np.add.at`
    on each row cost several times more."""
    return np.bincount(bins + np.where(positive, 0, BINS), minlength=2 * BINS).reshape(2, BINS)


def auc_of(pos: np.ndarray, neg: np.ndarray) -> float | None:
    """P(a positive scores above a negative), ties counted half; None without both classes."""
    npos, nneg = float(pos.sum()), float(neg.sum())
    if not npos or not nneg:
        return None
    below = np.cumsum(neg) - neg
    return float((pos * (below + 0.5 * neg)).sum() / (npos * nneg))


class Scores:
    """One rank's latest scores: the last `samples` (a ring) and per event-time window."""

    def __init__(self, samples: int, window_seconds: float, *, grouped: bool = False) -> None:
        self.size = samples
        self.window = window_seconds
        self.bins = np.zeros(samples, np.int32)
        self.labels = np.zeros(samples, bool)
        # With `grouped`: each sample's group (a slot's first ID) and whether it has one.
        self.grouped = grouped
        self.groups = np.zeros(samples if grouped else 0, np.uint64)
        self.has_group = np.zeros(samples if grouped else 0, bool)
        self.loss = np.zeros(samples, np.float64)
        self.filled = 0
        self.next = 0
        self.hist = np.zeros((2, BINS), np.int64)  # of the ring's samples: positives, negatives
        self.total = 0  # samples scored so far
        self.windows: collections.OrderedDict[float, list[Any]] = collections.OrderedDict()

    def add(
        self,
        labels: np.ndarray,
        probs: np.ndarray,
        times: np.ndarray | None,
        groups: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Score a batch: its labels, predicted probabilities, event times (streams) and, when
        the scores are `grouped`, (each sample's group, whether it has one)."""
        n = len(labels)
        if not n:
            return
        if self.grouped != (groups is not None):
            raise ValueError(
                f"scores {'are' if self.grouped else 'are not'} grouped: groups must come with them or not"
            )
        (bins, loss), y = bins_and_losses(labels, probs), np.asarray(labels) > 0.5
        if n > self.size:
            bins, y, loss = bins[-self.size :], y[-self.size :], loss[-self.size :]
        k = len(bins)
        idx = (self.next + np.arange(k)) % self.size
        old = idx[idx < self.filled]  # slots holding a sample that now falls out of the ring
        if len(old):
            self.hist -= _counts(self.bins[old], self.labels[old])
        self.bins[idx], self.labels[idx], self.loss[idx] = bins, y, loss
        if groups is not None:
            self.groups[idx], self.has_group[idx] = groups[0][-k:], groups[1][-k:]
        self.hist += _counts(bins, y)
        self.next = (self.next + k) % self.size
        self.filled = min(self.filled + k, self.size)
        self.total += n
        if times is not None:
            starts = np.floor(np.asarray(times, np.float64)[-k:] / self.window) * self.window
            for start in np.unique(starts):
                mine = starts == start
                window = self.windows.setdefault(float(start), [np.zeros((2, BINS), np.int64), 0.0, 0])
                window[0] += _counts(bins[mine], y[mine])
                window[1] += float(loss[mine].sum())
                window[2] += int(mine.sum())
            while len(self.windows) > WINDOWS_KEPT:
                self.windows.pop(min(self.windows))

    def summary(self) -> dict[str, Any]:
        """What a rank publishes (JSON). The histograms travel as one packed array each: a rank's
        hour of windows is thousands of non-empty bins, which as JSON pairs made the coordinator
        build (and its heap keep) a Python object per bin on every read of the job view."""
        starts = list(self.windows)
        hists = np.stack([w[0] for w in self.windows.values()]) if starts else np.zeros((0, 2, BINS))
        summary: dict[str, Any] = {
            "total": self.total,
            "samples": self.filled,
            "loss_sum": float(self.loss[: self.filled].sum()),
            "hist": _pack(self.hist),
            "windows": {
                "starts": starts,
                "loss": [w[1] for w in self.windows.values()],
                "n": [w[2] for w in self.windows.values()],
                "hist": _pack(hists),
            },
        }
        if self.grouped:
            has = self.has_group[: self.filled]
            ring = slice(0, self.filled)
            summary["gauc_parts"] = gauc_parts(self.labels[ring][has], self.bins[ring][has], self.groups[ring][has])
        return summary


class Errors:
    """A regression task's latest errors (a ring of the last `samples`): its rolling MSE and MAE."""

    def __init__(self, samples: int) -> None:
        self.size = samples
        self.squared = np.zeros(samples, np.float64)
        self.absolute = np.zeros(samples, np.float64)
        self.filled = 0
        self.next = 0
        self.total = 0

    def add(self, labels: np.ndarray, predictions: np.ndarray) -> None:
        error = (np.asarray(predictions, np.float64) - np.asarray(labels, np.float64))[-self.size :]
        idx = (self.next + np.arange(len(error))) % self.size
        self.squared[idx], self.absolute[idx] = error * error, np.abs(error)
        self.next = (self.next + len(error)) % self.size
        self.filled = min(self.filled + len(error), self.size)
        self.total += len(labels)

    def summary(self) -> dict[str, Any]:
        ring = slice(0, self.filled)
        return {
            "total": self.total,
            "samples": self.filled,
            "squared_sum": float(self.squared[ring].sum()),
            "absolute_sum": float(self.absolute[ring].sum()),
        }


class TaskScores:
    """A multi-task job's progressive scores: each task's over the samples labelled for it (a
    binary task's `Scores`, a regression task's `Errors`). The first binary task's are also the
    job's own (its summary's top level: the headline AUC)."""

    def __init__(self, kinds: dict[str, str], samples: int, window_seconds: float, *, grouped: bool) -> None:
        self.tasks: dict[str, Scores | Errors] = {
            name: Scores(samples, window_seconds, grouped=grouped) if kind == "binary" else Errors(samples)
            for name, kind in kinds.items()
        }
        binary = [s for s in self.tasks.values() if isinstance(s, Scores)]
        self.headline = binary[0] if binary else Scores(1, window_seconds, grouped=grouped)

    def add(
        self,
        labels: np.ndarray,
        scores: np.ndarray,
        times: np.ndarray | None,
        groups: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Score a batch: labels and scores (B, T), NaN where a sample has no label for a task."""
        for k, task in enumerate(self.tasks.values()):
            rows = ~np.isnan(labels[:, k])
            if isinstance(task, Errors):
                task.add(labels[rows, k], scores[rows, k])
                continue
            task_times = None if times is None else times[rows]
            task_groups = None if groups is None else (groups[0][rows], groups[1][rows])
            task.add(labels[rows, k], scores[rows, k], task_times, task_groups)

    def summary(self) -> dict[str, Any]:
        """The headline's summary, and each other task's in `tasks` (the headline's is named there,
        as None: it is sent once)."""
        tasks = {name: None if task is self.headline else task.summary() for name, task in self.tasks.items()}
        return {**self.headline.summary(), "tasks": tasks}


def _pack(counts: np.ndarray) -> str:
    """Histogram counts as text: int32 (a bin of one rank's window never holds 2^31 samples),
    zlib-compressed (mostly empty bins), base64."""
    return base64.b64encode(zlib.compress(counts.astype(np.int32).tobytes(), 1)).decode()


def _unpack(text: str) -> np.ndarray:
    """`_pack`'s counts, as [..., 2, BINS] int64 (pos, neg)."""
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), np.int32).reshape(-1, 2, BINS).astype(np.int64)


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's summary as one: the rolling AUC and log loss, and per window of event time;
    a multi-task job's (`TaskScores`) also each task's, in `tasks` by name."""
    merged = _merge_scores(summaries)
    if summaries and "tasks" in summaries[0]:
        merged["tasks"] = {
            name: _merge_task([s if s["tasks"][name] is None else s["tasks"][name] for s in summaries])
            for name in summaries[0]["tasks"]
        }
    return merged


def _merge_task(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    samples = sum(s["samples"] for s in summaries)
    scored = sum(s["total"] for s in summaries)
    if "hist" in summaries[0]:
        merged = _merge_scores(summaries)
        return {k: merged[k] for k in ("samples", "scored", "auc", "gauc", "logloss")}
    squared = sum(s["squared_sum"] for s in summaries)
    absolute = sum(s["absolute_sum"] for s in summaries)
    return {
        "samples": samples,
        "scored": scored,
        "mse": squared / samples if samples else None,
        "mae": absolute / samples if samples else None,
    }


def _merge_scores(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    if not summaries:
        return {"samples": 0, "scored": 0, "auc": None, "gauc": None, "logloss": None, "windows": []}
    pos, neg = sum((_unpack(s["hist"])[0] for s in summaries), np.zeros((2, BINS), np.int64))
    samples = sum(s["samples"] for s in summaries)
    windows: dict[float, list[Any]] = {}
    for s in summaries:
        w = s["windows"]
        for start, hist, loss, n in zip(w["starts"], _unpack(w["hist"]), w["loss"], w["n"], strict=True):
            merged = windows.setdefault(start, [np.zeros((2, BINS), np.int64), 0.0, 0])
            merged[0] += hist
            merged[1] += loss
            merged[2] += n
    weighted = sum(s["gauc_parts"][0] for s in summaries if "gauc_parts" in s)
    weight = sum(s["gauc_parts"][1] for s in summaries if "gauc_parts" in s)
    return {
        "samples": samples,
        "scored": sum(s["total"] for s in summaries),
        "auc": auc_of(pos, neg),
        "gauc": weighted / weight if weight else None,
        "logloss": sum(s["loss_sum"] for s in summaries) / samples if samples else None,
        "windows": [
            {"start": start, "samples": w[2], "auc": auc_of(*w[0]), "logloss": w[1] / w[2] if w[2] else None}
            for start, w in sorted(windows.items())
        ],
    }


def of_job(job: JobConfig, samples: int) -> Scores | TaskScores:
    """A rank's progressive scores of `job`, over its latest `samples`."""
    window, grouped = job.training.progressive_window_seconds, job.evaluation.group_by is not None
    if not job.multitask:
        return Scores(samples, window, grouped=grouped)
    return TaskScores({t.name: t.kind for t in job.tasks}, samples, window, grouped=grouped)
