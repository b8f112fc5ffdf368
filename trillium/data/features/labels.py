"""A block's labels: the one binary label of a `label:` job, or each task's of a `labels:` job
(float32 (rows, T), NaN where a row has no label for a task), with the rows they make malformed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trillium.data.sources import LABEL
from trillium.data.sources.cells import as_numbers, as_text, present
from trillium.job import JobConfig, TaskConfig
from trillium.job.tasks import MASK_OFF, MASK_ON

Problems = dict[int, tuple[str, str]]  # row -> (kind, reason), a row's first problem


def _member(text: pa.Array, values: list[str]) -> np.ndarray:
    return pc.is_in(text, value_set=pa.array(values, pa.string()).cast(text.type)).to_numpy(zero_copy_only=False)


def _flag(text: pa.Array, rows: np.ndarray, column: str, what: str, problems: Problems) -> None:
    """Each of `rows` malformed: its cell of `column` is an unknown `what`."""
    if not len(rows):
        return
    cells = text.take(pa.array(rows))
    cells = cells.view(pa.large_binary() if pa.types.is_large_string(text.type) else pa.binary())
    for row, cell in zip(rows, cells.to_pylist(), strict=True):
        shown = (cell or b"").decode("utf-8", "replace")
        problems.setdefault(int(row), (LABEL, f"{column}: unknown {what} {shown!r}"))


def binary(
    text: pa.Array, column: str, positive: list[str], negative: list[str] | None, problems: Problems
) -> tuple[np.ndarray, np.ndarray]:
    """(positive, known) bool[rows]. Without `negative`, every other non-empty value is 0; with
    it, a value in neither list is a malformed row. An empty cell is neither."""
    pos = _member(text, positive)
    has = present(text)
    neg = has & ~pos if negative is None else _member(text, negative)
    _flag(text, np.flatnonzero(has & ~pos & ~neg), column, "label", problems)
    return pos, pos | neg


def single_label(job: JobConfig, column: Callable[[str], pa.Array], problems: Problems) -> np.ndarray:
    """bool[rows]: the `label:` job's positives; a row without a label is malformed."""
    label = job.label
    assert label is not None
    text = as_text(column(label.column))
    pos, known = binary(text, label.column, label.positive, label.negative, problems)
    _flag(text, np.flatnonzero(~known & ~present(text)), label.column, "label", problems)
    return pos


def _transformed(task: TaskConfig, values: np.ndarray, problems: Problems) -> np.ndarray:
    if task.transform == "none":
        return values
    low = 0.0 if task.transform == "log" else -1.0
    for row in np.flatnonzero(values <= low):  # NaN compares false: a missing label is no problem
        problems.setdefault(
            int(row), (LABEL, f"{task.column}: {float(values[row])!r} is outside {task.transform}'s domain (> {low:g})")
        )
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(values) if task.transform == "log" else np.log1p(values)


def task_labels(job: JobConfig, column: Callable[[str], pa.Array], rows: int, problems: Problems) -> np.ndarray:
    """float32 (rows, T) of a `labels:` job, NaN where a row has no label for a task (an empty
    cell, or its mask off); a row with no label for any task is malformed."""
    tasks = job.tasks
    out = np.full((rows, len(tasks)), np.nan, np.float32)
    for k, task in enumerate(tasks):
        if task.kind == "binary":
            text = as_text(column(task.column))
            pos, known = binary(text, task.column, task.positive_values, task.negative, problems)
            out[known, k] = pos[known]
        else:
            values, bad = as_numbers(column(task.column), task.column)
            for row, reason in bad.items():
                problems.setdefault(row, (LABEL, reason))
            out[:, k] = _transformed(task, values, problems)
        if task.mask is not None:
            mask = as_text(column(task.mask))
            on = _member(mask, list(MASK_ON))
            off = _member(mask, list(MASK_OFF)) | ~present(mask)
            _flag(mask, np.flatnonzero(~on & ~off), task.mask, "mask value", problems)
            out[~on, k] = np.nan
    none = np.flatnonzero(np.isnan(out).all(axis=1))
    for row in none:
        problems.setdefault(int(row), (LABEL, "no label for any task"))
    out[~np.isfinite(out)] = np.nan  # a malformed row's label is not read; keep no inf about
    return out
