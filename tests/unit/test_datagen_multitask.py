"""`trillium datagen --multitask`: the file holds the planted model's draws, the report is the
planted model's own score on them (computed here with scikit-learn, per user in a plain loop),
and the planted structure is there for a model to find (the history predicts clicks, a conversion
needs a click)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from gauc_reference import grouped_auc
from sklearn.metrics import roc_auc_score

from trillium.data.sources.datagen_multitask import COLUMNS, MultitaskModel, generate_multitask

ROWS, USERS, ITEMS = 20_000, 500, 3_000


def drawn(seed: int = 4, rows: int = ROWS) -> dict[str, np.ndarray]:
    blocks = MultitaskModel.create(seed, users=USERS, items=ITEMS).sample(rows)
    return {name: np.concatenate([getattr(b, name) for b in blocks]) for name in vars(blocks[0])}


def test_the_report_is_the_planted_models_own_score(tmp_path: Path) -> None:
    report = generate_multitask(tmp_path / "train.csv", ROWS, seed=4, users=USERS, items=ITEMS)
    d = drawn()
    assert (report.rows, report.users) == (ROWS, len(np.unique(d["user"])))
    for task, prob in (("click", "click_prob"), ("conversion", "conversion_prob")):
        ceiling = report.tasks[task]
        assert ceiling.kind == "binary"
        assert ceiling.positive_rate == pytest.approx(d[task].mean(), abs=1e-12)
        assert ceiling.auc == pytest.approx(roc_auc_score(d[task], d[prob]), abs=1e-12)
        assert ceiling.gauc == pytest.approx(grouped_auc(d[task], d[prob], d["user"]), abs=1e-12)
        assert 0.6 < ceiling.gauc < ceiling.auc < 0.95, (task, ceiling)  # learnable, not trivially
    watch = report.tasks["watch_seconds"]
    assert watch.kind == "regression"
    assert watch.mse_log == pytest.approx(np.mean((np.log(d["watch_seconds"]) - d["log_watch_mean"]) ** 2))
    assert watch.mse_log == pytest.approx(0.5**2, rel=0.05)  # the planted noise, up to the rounding to 1 ms
    assert 0.05 < report.tasks["conversion"].positive_rate < report.tasks["click"].positive_rate < 0.5


def test_the_file_holds_the_draws(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    generate_multitask(path, ROWS, seed=4, users=USERS, items=ITEMS)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        assert tuple(next(reader)) == COLUMNS
        rows = list(reader)
    d = drawn()
    assert len(rows) == ROWS
    columns = dict(zip(COLUMNS, zip(*rows, strict=True), strict=True))
    for name in ("user", "item", "hour", "item_age_days", "click", "conversion"):
        np.testing.assert_array_equal(np.array(columns[name], dtype=np.int64), d[name], err_msg=name)
    np.testing.assert_array_equal(np.array(columns["watch_seconds"], dtype=np.float64), d["watch_seconds"])
    history = np.array([cell.split("|") for cell in columns["history"]], dtype=np.int64)
    np.testing.assert_array_equal(history, d["history"])


def test_the_planted_structure_is_there() -> None:
    model = MultitaskModel.create(4, users=USERS, items=ITEMS)
    d = drawn()
    assert not np.any(d["conversion"] & ~d["click"])  # a conversion needs a click
    match = (model.item_category[d["history"]] == model.item_category[d["item"]][:, None]).mean(axis=1)
    # A history in the item's category predicts a click (beta = 2 on the fraction that matches).
    assert d["click"][match >= 0.6].mean() > d["click"][match == 0].mean() + 0.15
    # Histories lean to the user's favourite category: taste 0.6 plus chance.
    favourite = model.item_category[d["history"]] == model.user_favourite[d["user"]][:, None]
    assert 0.55 < favourite.mean() < 0.7
    # Popularity follows a power law: the most frequent user far above a uniform draw's share.
    assert np.bincount(d["user"]).max() > 20 * ROWS / USERS
    assert d["history"].shape == (ROWS, model.history_len)
    assert d["hour"].min() >= 0 and d["hour"].max() <= 23 and d["watch_seconds"].min() > 0


def test_same_seed_same_file_and_splits_differ(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    for path, split in ((a, "train"), (b, "train"), (c, "test")):
        generate_multitask(path, 300, seed=9, split=split, users=USERS, items=ITEMS)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"users": 0}, "users"),
        ({"items": 0}, "items"),
        ({"categories": 1}, "categories"),
        ({"history_len": 0}, "history_len"),
    ],
)
def test_bad_arguments_name_their_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MultitaskModel.create(0, **kwargs)
