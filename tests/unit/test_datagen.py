from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from trillium.data.sources.datagen import PlantedModel, SyntheticRows, generate_criteo

VOCAB = [50, 1000, 20_000] * 8 + [10, 10]


def test_report_is_the_planted_models_own_auc(tmp_path: Path) -> None:
    path = tmp_path / "out" / "train.tsv"
    report = generate_criteo(path, 20_000, seed=3, vocab_sizes=VOCAB)
    blocks = list(PlantedModel.create(3, vocab_sizes=VOCAB).sample(20_000))
    probs = np.concatenate([b.probs for b in blocks])
    labels = np.concatenate([b.labels for b in blocks])
    assert report.auc == pytest.approx(roc_auc_score(labels, probs), abs=1e-12)
    assert report.positive_rate == pytest.approx(labels.mean())
    assert (report.path, report.rows) == (path, 20_000)
    assert 0.2 < report.positive_rate < 0.3
    assert 0.75 < report.auc < 0.95  # learnable, but not trivially
    written = [int(line.split("\t", 1)[0]) for line in path.read_text().splitlines()]
    np.testing.assert_array_equal(written, labels)


def test_rows_look_like_criteo(tmp_path: Path) -> None:
    path = tmp_path / "train.tsv"
    generate_criteo(path, 2_000, seed=1, vocab_sizes=VOCAB)
    lines = path.read_text().splitlines()
    assert len(lines) == 2_000
    fields = [line.split("\t") for line in lines]
    assert {len(f) for f in fields} == {40}
    dense = [cell for f in fields for cell in f[1:14]]
    assert all(re.fullmatch(r"0|[1-9][0-9]*|", cell) for cell in dense)
    assert 0 < dense.count("") < len(dense) // 2  # some missing, as in Criteo
    cats = [cell for f in fields for cell in f[14:]]
    assert all(re.fullmatch(r"[0-9a-f]{8}|", cell) for cell in cats)
    assert 0 < cats.count("") < len(cats) // 2
    # Power-law popularity: the most frequent value of a 20k-vocabulary slot is far above uniform.
    column = [f[16] for f in fields if f[16]]
    assert max(column.count(v) for v in set(column)) > 20 * len(column) / 20_000


def test_same_seed_same_file_and_splits_differ(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    generate_criteo(a, 500, seed=9, vocab_sizes=VOCAB)
    generate_criteo(b, 500, seed=9, vocab_sizes=VOCAB)
    generate_criteo(c, 500, seed=9, vocab_sizes=VOCAB, split="test")
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_positive_rate_is_tuned() -> None:
    model = PlantedModel.create(0, vocab_sizes=VOCAB, positive_rate=0.1)
    labels = np.concatenate([b.labels for b in model.sample(20_000)])
    assert 0.08 < labels.mean() < 0.12


def test_to_tsv_formats_cells() -> None:
    categorical = np.full((2, 26), -1, np.int64)
    categorical[0, 0] = 0
    dense = np.full((2, 13), -1, np.int64)
    dense[0, :4] = [0, 7, 10, 123456]
    rows = SyntheticRows(categorical, dense, np.array([0.5, 0.5]), np.array([1, 0], np.uint8))
    first, second = rows.to_tsv().decode().splitlines()
    assert first.split("\t")[:16] == ["1", "0", "7", "10", "123456", *[""] * 9, "00000000", ""]
    assert second == "0" + "\t" * 39


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_sizes": [10] * 25}, "26 positive ints"),
        ({"zipf_exponent": 1.0}, "zipf_exponent"),
        ({"zipf_exponent": -0.5}, "zipf_exponent"),
        ({"positive_rate": 1.0}, "positive_rate"),
    ],
)
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PlantedModel.create(0, **kwargs)


def test_an_exponent_below_one_reaches_the_tail_of_a_large_vocabulary() -> None:
    """What a scale run materializes: 20k rows over a 100k-ID vocabulary reach ~18% of it
    uniformly (1 - e^-0.2), less under a power law, and least under Criteo's 1.1."""
    seen = {}
    for a in (0.0, 0.5, 1.1):
        blocks = PlantedModel.create(5, vocab_sizes=[100_000] * 26, zipf_exponent=a).sample(20_000)
        ids = np.concatenate([b.categorical[:, 0] for b in blocks])
        ids = ids[ids >= 0]
        assert ids.max() < 100_000
        seen[a] = len(np.unique(ids)) / 100_000
    assert seen[0.0] == pytest.approx(1 - np.exp(-len(ids) / 100_000), abs=0.01)
    assert seen[0.0] > seen[0.5] > 2 * seen[1.1]


def test_tiny_job_data_is_what_its_comment_says(tmp_path: Path) -> None:
    tiny = Path(__file__).resolve().parents[1] / "data" / "tiny"
    for split, rows in (("train", 1000), ("test", 300)):
        generate_criteo(tmp_path / f"{split}.tsv", rows, seed=7, vocab_sizes=[10] * 26, split=split)
        assert (tmp_path / f"{split}.tsv").read_bytes() == (tiny / f"{split}.tsv").read_bytes()


@pytest.mark.parametrize("zero", [False, True])
def test_a_missing_count_is_a_zero_count_only_when_asked(zero: bool) -> None:
    """What the file says of a row is what the planted model's logit depends on, with
    missing_count_is_zero: an empty dense cell (read as 0) then weighs like a count of 0."""
    model = PlantedModel.create(3, vocab_sizes=VOCAB, missing_count_is_zero=zero)
    categorical = np.zeros((2, 26), np.int64)
    dense = np.full((2, 13), 4, np.int64)
    column = int(np.flatnonzero(model.dense_weights)[0])
    dense[0, column], dense[1, column] = -1, 0  # missing, zero
    missing, zero_count = model._logits(categorical, dense)
    assert bool(missing == pytest.approx(zero_count)) is zero
