from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trillium_native
from trillium.data import load_job
from trillium.data.features import BatchBuilder, EncodedBlock, Encoder, TextCells, dense_stats, epoch_batches
from trillium.data.features.epochs import _encoded, _shuffle
from trillium.data.features.stats import _STATS_CHUNK, _Moments
from trillium.data.sources import RowBlock, open_source
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]

ADULT_ROW = (  # adult.data's first row
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, "
    "2174, 0, 40, United-States, <=50K"
)


def adult_row(age: str = "39", label: str = "<=50K", workclass: str = "State-gov") -> str:
    fields = ADULT_ROW.split(", ")
    fields[0], fields[1], fields[-1] = age, workclass, label
    return ", ".join(fields)


def adult_job(train: Path, test: Path | None = None, **training: Any) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "t",
            "data": {"source": "adult", "train": str(train), "test": str(test) if test else None},
            "slots": [{"name": "workclass", "column": "workclass"}, {"name": "sex", "column": "sex"}],
            "tables": {"workclass": {"dim": 2}, "sex": {"dim": 2}},
            "dense": [
                {"column": "age", "normalization": "standard"},
                {"column": "hours_per_week", "normalization": "standard", "mean": 40.0, "std": 10.0},
                {"column": "capital_gain", "normalization": "log1p"},
                {"column": "education_num", "normalization": "minmax"},
            ],
            "label": {"column": "income_bracket", "positive": ">50K", "negative": "<=50K"},
            "model": {"cls": "trillium.models:DNN"},
            "training": {"batch_size": 2, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}, **training},
            "topology": {"nn_ranks": 2},
        }
    )


def criteo_line(label: str = "1", dense: list[str] | None = None, cats: list[str] | None = None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats])


def criteo_job(train: Path, slots: list[dict[str, Any]], **training: Any) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "t",
            "data": {"source": "criteo", "train": str(train)},
            "slots": slots,
            "tables": {s.get("table", s["name"]): {"dim": 2} for s in slots},
            "dense": [{"column": "I1"}, {"column": "I2", "normalization": "standard"}],
            "label": {"column": "label", "positive": "1"},
            "model": {"cls": "trillium.models:DNN"},
            "training": {"batch_size": 4, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}, **training},
        }
    )


def test_adult_preset_handles_the_test_file_quirks(tmp_path: Path) -> None:
    path = tmp_path / "adult.test"
    lines = ["|1x3 Cross validator", adult_row(label=">50K."), "", "   ", adult_row(workclass="?")]
    path.write_text("\n".join(lines) + "\n")
    builder = BatchBuilder(adult_job(path))
    batch = next(builder.batches())
    np.testing.assert_array_equal(batch.labels, [1.0, 0.0])  # ">50K." is ">50K"
    values, lengths = batch.ids.slot("workclass")  # cells stripped; "?" is a value
    np.testing.assert_array_equal(values, trillium_native.hash_ids("workclass", ["State-gov", "?"]))
    assert builder.malformed == {}  # the "|" line and the blank ones are no rows


def test_malformed_rows_are_counted_logged_and_quarantined(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train = tmp_path / "train.csv"
    lines = [
        adult_row(),
        ", ".join(ADULT_ROW.split(", ")[:14]),  # 14 fields
        adult_row(age="abc"),
        adult_row(label="maybe"),
        adult_row(label=">50K"),
        "",
        adult_row(age="nan"),
    ]
    train.write_text("\n".join(lines) + "\n")
    quarantine = tmp_path / "q" / "bad.jsonl"
    quarantine.parent.mkdir()
    quarantine.write_text('{"earlier": "record"}\n')
    builder = BatchBuilder(adult_job(train), quarantine=quarantine)
    with caplog.at_level(logging.WARNING, logger="trillium.data.features"):
        split = builder.split("train")
    assert split.rows == 2
    np.testing.assert_array_equal(split.labels, [0.0, 1.0])
    assert builder.malformed == {"field_count": 1, "dense_value": 2, "label": 1}
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert records[0] == {"earlier": "record"}  # appended, not overwritten
    assert [(r["file"], r["line"]) for r in records[1:]] == [(str(train), n) for n in (2, 3, 4, 7)]
    assert [r["raw"] for r in records[1:]] == [lines[i] for i in (1, 2, 3, 6)]
    assert "expected 15 fields, got 14" in records[1]["reason"]
    assert "age: non-numeric value 'abc'" in records[2]["reason"]
    assert "income_bracket: unknown label 'maybe'" in records[3]["reason"]
    assert "age: non-finite value 'nan'" in records[4]["reason"]
    logged = caplog.text
    assert f"{train}:2: skipped malformed row" in logged and f"{train}:7:" in logged
    assert "skipped 4 malformed rows" in logged


def test_without_negative_values_any_other_label_is_zero(tmp_path: Path) -> None:
    train = tmp_path / "train.tsv"
    train.write_text("\n".join([criteo_line("1"), criteo_line("0"), criteo_line("-1"), criteo_line("")]) + "\n")
    builder = BatchBuilder(criteo_job(train, [{"name": "c1", "column": "C1"}]))
    np.testing.assert_array_equal(builder.split("train").labels, [1, 0, 0])
    assert builder.malformed == {"label": 1}  # an empty label is never a value


def test_normalization(tmp_path: Path) -> None:
    ages, hours, gains, edu = [20, 30, 40, 70], [40, 50, 30, 40], [0, 9, 99, 0], [1, 5, 9, 13]
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"

    def row(i: int) -> str:
        fields = ADULT_ROW.split(", ")
        fields[0], fields[12], fields[10], fields[4] = str(ages[i]), str(hours[i]), str(gains[i]), str(edu[i])
        return ", ".join(fields)

    train.write_text("\n".join(row(i) for i in range(4)) + "\n")
    test.write_text(row(3) + "\n")
    builder = BatchBuilder(adult_job(train, test))
    mean, std = np.mean(ages), np.std(ages)
    assert builder.dense_stats == {
        "age": {"mean": pytest.approx(mean), "std": pytest.approx(std)},
        "hours_per_week": {"mean": 40.0, "std": 10.0},
        "education_num": {"min": 1.0, "max": 13.0},
    }
    dense = builder.split("train").dense
    assert dense.dtype == np.float32
    np.testing.assert_allclose(dense[:, 0], (np.array(ages) - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(dense[:, 1], (np.array(hours) - 40) / 10)
    np.testing.assert_allclose(dense[:, 2], np.log1p(gains), rtol=1e-6)
    np.testing.assert_allclose(dense[:, 3], (np.array(edu) - 1) / 12, rtol=1e-6)
    # The test split is normalized with the train split's statistics.
    np.testing.assert_allclose(builder.split("test").dense, dense[3:4])


def test_missing_dense_values_become_zero(tmp_path: Path) -> None:
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(criteo_line(dense=["", v, *[""] * 11]) for v in ["1", "", "3"]) + "\n")
    builder = BatchBuilder(criteo_job(train, [{"name": "c1", "column": "C1"}]))
    np.testing.assert_array_equal(builder.split("train").dense, [[0, -1], [0, 0], [0, 1]])
    assert builder.dense_stats["I2"] == {"mean": 2.0, "std": 1.0}  # over the present values only


@pytest.mark.parametrize("ids", ["shared", "per_slot"])
def test_ids_are_hashed_in_their_slots_id_space(tmp_path: Path, ids: str) -> None:
    """The slots of a table share its ID space (its name's namespace) unless it says `per_slot`
    (each slot's own); a table of one slot named after it hashes alike either way."""
    train = tmp_path / "train.tsv"
    cats = [["aa", "", "x|y|z", *[""] * 23], ["bb", "aa", "", *[""] * 23]]
    train.write_text("\n".join(criteo_line(cats=c) for c in cats) + "\n")
    slots = [
        {"name": "c1", "column": "C1", "table": "shared"},
        {"name": "c2", "column": "C2", "table": "shared"},
        {"name": "hist", "column": "C3", "separator": "|", "max_len": 2, "pooling": "none"},
    ]
    job = criteo_job(train, slots)
    job = job.model_copy(
        update={"tables": job.tables | {"shared": job.tables["shared"].model_copy(update={"ids": ids})}}
    )
    space = {"c1": "shared", "c2": "shared"} if ids == "shared" else {"c1": "c1", "c2": "c2"}
    batch = next(BatchBuilder(job).batches())
    assert batch.ids.keys == ("c1", "c2", "hist")
    values, lengths = batch.ids.slot("c1")
    np.testing.assert_array_equal(values, trillium_native.hash_ids(space["c1"], ["aa", "bb"]))
    np.testing.assert_array_equal(lengths, [1, 1])
    values, lengths = batch.ids.slot("c2")  # a missing cell has no ID
    np.testing.assert_array_equal(values, trillium_native.hash_ids(space["c2"], ["aa"]))
    np.testing.assert_array_equal(lengths, [0, 1])
    values, lengths = batch.ids.slot("hist")  # split, then cut to max_len
    np.testing.assert_array_equal(values, trillium_native.hash_ids("hist", ["x", "y"]))
    np.testing.assert_array_equal(lengths, [2, 0])
    # "aa" in c1 and in c2: one ID (one row) in a shared table, two per slot.
    same = batch.ids.slot("c1")[0][0] == batch.ids.slot("c2")[0][0]
    assert same == (ids == "shared")


def write_numbered(tmp_path: Path, rows: int) -> Path:
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(criteo_line(dense=[str(i), *["0"] * 12]) for i in range(rows)) + "\n")
    return train


def test_batches_in_order_with_ranks(tmp_path: Path) -> None:
    builder = BatchBuilder(criteo_job(write_numbered(tmp_path, 10), [{"name": "c1", "column": "C1"}]))
    batches = list(builder.batches("train", epoch=3))
    assert builder.num_batches() == 3
    assert [(b.batch_id, b.epoch, b.batch_size) for b in batches] == [(0, 3, 4), (1, 3, 4), (2, 3, 2)]
    assert [b.rank for b in batches] == [0, 0, 0]  # one NN rank
    np.testing.assert_array_equal(np.concatenate([b.dense[:, 0] for b in batches]), np.arange(10))


def test_ranks_are_batch_id_modulo_nn_ranks(tmp_path: Path) -> None:
    train = tmp_path / "train.csv"
    train.write_text("\n".join([adult_row()] * 7) + "\n")
    assert [b.rank for b in BatchBuilder(adult_job(train)).batches()] == [0, 1, 0, 1]


def test_shuffle_buffer_is_a_deterministic_function_of_seed_and_epoch(tmp_path: Path) -> None:
    train = write_numbered(tmp_path, 50)

    def order(seed: int, epoch: int, buffer: int = 20) -> list[float]:
        job = criteo_job(train, [{"name": "c1", "column": "C1"}], shuffle_buffer=buffer, seed=seed)
        return np.concatenate([b.dense[:, 0] for b in BatchBuilder(job).batches("train", epoch)]).tolist()

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    assert sorted(order(1, 0)) == list(range(50))
    assert order(1, 0, buffer=0) == list(range(50))  # no buffer: file order
    # IDs move with their rows.
    job = criteo_job(train, [{"name": "c1", "column": "C1"}], shuffle_buffer=20, seed=1)
    for batch in BatchBuilder(job).batches("train", 1):
        assert len(batch.ids.values) == batch.batch_size


def test_synthetic_source_equals_the_generated_file(tmp_path: Path) -> None:
    vocab = [5] * 26
    generate_criteo(tmp_path / "train.tsv", 300, seed=4, vocab_sizes=vocab)
    generate_criteo(tmp_path / "test.tsv", 100, seed=4, vocab_sizes=vocab, split="test")
    from_file = load_job(ROOT / "tests" / "data" / "tiny_job.yaml")
    document = from_file.model_dump(mode="json")
    document["data"] = {
        "source": "criteo",
        "train": str(tmp_path / "train.tsv"),
        "test": str(tmp_path / "test.tsv"),
    }
    files = BatchBuilder(JobConfig.model_validate(document))
    document["data"] = {"source": "synthetic", "rows": 300, "test_rows": 100, "seed": 4, "vocab_sizes": vocab}
    synthetic = BatchBuilder(JobConfig.model_validate(document))
    for split in ("train", "test"):
        assert list(files.batches(split)) == list(synthetic.batches(split))
    assert synthetic.has_test and files.num_batches("test") == 1


def test_a_job_without_test_split(tmp_path: Path) -> None:
    builder = BatchBuilder(criteo_job(write_numbered(tmp_path, 3), [{"name": "c1", "column": "C1"}]))
    assert not builder.has_test
    assert list(open_source(builder.job.data).blocks("test", ["label"])) == []


def test_adult_example_reads_cleanly() -> None:
    builder = BatchBuilder(load_job(ROOT / "examples" / "adult" / "job.yaml"))
    train, test = builder.split("train"), builder.split("test")
    assert (train.rows, test.rows) == (32561, 16281)
    assert builder.malformed == {}
    assert 0.2 < train.labels.mean() < 0.3 and 0.2 < test.labels.mean() < 0.3
    np.testing.assert_allclose(train.dense.mean(axis=0), 0, atol=1e-4)  # all standardized
    np.testing.assert_allclose(train.dense.std(axis=0), 1, atol=1e-4)


def many_blocks_job(tmp_path: Path, **training: Any) -> JobConfig:
    """A Criteo-format job over ~3 grid blocks (~40k rows), with statistics from the train split."""
    path = tmp_path / "train.tsv"
    generate_criteo(path, 40_000, seed=5, vocab_sizes=[1000] * 26)
    return criteo_job(path, [{"name": "c1", "column": "C1"}, {"name": "c2", "column": "C2"}], **training)


@pytest.mark.parametrize("buffer", [0, 5000])
def test_streamed_epochs_equal_the_in_memory_ones_and_resume_at_any_batch(tmp_path: Path, buffer: int) -> None:
    job = many_blocks_job(tmp_path, batch_size=1000, shuffle_buffer=buffer, seed=3)
    builder = BatchBuilder(job)
    stats = dense_stats(job)
    assert stats == builder.dense_stats
    assert len(builder.split("train").blocks) >= 3
    for epoch in (0, 1):
        expect = list(builder.batches("train", epoch))
        assert len(expect) == 40
        assert list(epoch_batches(job, "train", stats=stats, epoch=epoch)) == expect
        for skip in (1, 17, 39, 40):  # within a block, across blocks, the last batch, past the end
            assert list(epoch_batches(job, "train", stats=stats, epoch=epoch, skip=skip)) == expect[skip:]
    if buffer:
        assert list(builder.batches("train", 0)) != list(builder.batches("train", 1))


class CountingEncoder(Encoder):
    """Counts the rows it encodes."""

    encoded = 0

    def encode(self, block: Any, checked: Any, *, skip: int = 0) -> Any:
        out = super().encode(block, checked, skip=skip)
        CountingEncoder.encoded += out.rows
        return out


def test_skipped_batches_are_not_encoded_without_a_shuffle_buffer(tmp_path: Path) -> None:
    job = many_blocks_job(tmp_path, batch_size=1000)
    encoder = CountingEncoder(job, dense_stats(job))
    CountingEncoder.encoded = 0
    rows = sum(b.rows for b in _encoded(job, "train", encoder, part=0, parts=1, skip_rows=35_000, quarantine=None))
    assert rows == 5_000
    assert CountingEncoder.encoded < 40_000 - 20_000  # at most a block or two encoded in vain


def encoded_rows(ids: list[int]) -> EncodedBlock:
    lengths = np.ones((1, len(ids)), np.int32)
    values = (np.array(ids, np.uint64),)
    dense = np.array(ids, np.float32)[:, None]
    return EncodedBlock.from_lengths(lengths, values, dense, np.zeros(len(ids), np.float32))


def test_the_shuffle_buffer_moves_rows_at_most_about_its_size(tmp_path: Path) -> None:
    blocks = [encoded_rows(list(range(start, start + 100))) for start in range(0, 2000, 100)]

    def shuffled(seed: int, size: int, skip: int = 0) -> list[int]:
        out = _shuffle(iter(blocks), size, np.random.default_rng(seed), skip)
        return [int(v) for block in out for v in block.values[0]]

    order = shuffled(0, 250)
    assert sorted(order) == list(range(2000)) and order != list(range(2000))
    assert order == shuffled(0, 250) and order != shuffled(1, 250)
    position = np.argsort(order)  # where each row went
    # A row leaves no earlier than when its block arrives: at most buffer + block rows ahead.
    assert (position >= np.arange(2000) - 250 - 100).all()
    assert shuffled(0, 250, skip=777) == order[777:]
    ids = [int(v) for block in _shuffle(iter(blocks), 250, np.random.default_rng(0), 0) for v in block.dense[:, 0]]
    assert ids == order  # IDs and dense values move together


@given(
    lengths=st.lists(st.lists(st.integers(0, 3), min_size=6, max_size=6), min_size=1, max_size=3),
    start=st.integers(0, 6),
    size=st.integers(0, 6),
)
def test_a_slice_of_rows_is_the_take_of_them(lengths: list[list[int]], start: int, size: int) -> None:
    counts = np.array(lengths, np.int32)
    values = tuple(np.arange(100 * k, 100 * k + n, dtype=np.uint64) for k, n in enumerate(counts.sum(axis=1)))
    block = EncodedBlock.from_lengths(counts, values, np.arange(6, dtype=np.float32)[:, None], np.ones(6, np.float32))
    stop = min(start + size, 6)
    got, want = block.slice(start, stop), block.take(np.arange(start, stop))
    np.testing.assert_array_equal(got.offsets, want.offsets)
    for x, y in zip(got.values, want.values, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.labels, want.labels)


def test_statistics_merged_over_chunks_match_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.lognormal(3, 1, 3 * _STATS_CHUNK + 12345) + 1e6  # a large mean: no cancellation
    moments = _Moments()
    for start in range(0, len(values), 9999):  # any cut of the input gives the same chunks
        moments.add(values[start : start + 9999])
    stats = moments.stats("standard")
    assert stats["mean"] == pytest.approx(values.mean(), rel=1e-14)
    assert stats["std"] == pytest.approx(values.std(), rel=1e-10)
    other = _Moments()
    other.add(values)
    assert other.stats("standard") == stats
    small = _Moments()
    small.add(values[:1000])
    assert small.stats("standard") == {"mean": float(values[:1000].mean()), "std": float(values[:1000].std())}
    assert moments.stats("minmax") == {"min": float(values.min()), "max": float(values.max())}


def test_given_statistics_are_checked(tmp_path: Path) -> None:
    job = many_blocks_job(tmp_path)
    for bad in ({}, {"I2": {"mean": 1.0}}, {"I2": {"mean": 1.0, "std": 0.0}}, {"I2": {"mean": "1", "std": 1.0}}):
        with pytest.raises(ValueError, match="dense column 'I2' \\(standard\\): stats need a mean and a std > 0"):
            epoch_batches(job, "train", stats=bad)
    assert next(epoch_batches(job, "train", stats={"I2": {"mean": 1.0, "std": 2.0}})).batch_size == 4


def test_a_row_quarantined_before_is_not_appended_again(tmp_path: Path) -> None:
    """A data loader restored from a checkpoint reads again rows it read before its crash."""
    train = tmp_path / "train.csv"
    train.write_text("\n".join([adult_row(), adult_row(age="abc"), adult_row(label="maybe")]) + "\n")
    quarantine = tmp_path / "bad.jsonl"
    for _ in range(2):  # the first attempt, then its recovery
        builder = BatchBuilder(adult_job(train), quarantine=quarantine)
        assert builder.split("train").rows == 1
        assert builder.malformed == {"dense_value": 1, "label": 1}  # counted each time, written once
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [r["line"] for r in records] == [2, 3]


_CELLS = st.one_of(
    st.none(),
    st.just(""),
    st.sampled_from(["1", "2.5", "-3", " 4", "1e3", "1_000", "x", "nan", "inf", "0x1p3"]),
    st.text(alphabet="ab|c,", max_size=8),
)


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_rows_as_text_cells_encode_as_a_block_of_them(data) -> None:
    """Events and prediction requests take `check_cells`/`encode_cells` (cells of events read a
    text per row, of requests a column per field); files take `check`/`encode` on Arrow blocks:
    the same rows give the same bits, the same bad rows and reasons, every way."""
    slots = [
        {"name": "one", "column": "a"},
        {"name": "many", "column": "b", "separator": "|", "pooling": "mean", "max_len": 2},
        {"name": "seq", "column": "b", "separator": ",", "pooling": "none", "max_len": 3},
    ]
    negative = data.draw(st.sampled_from([None, ["0"]]))
    job = JobConfig.model_validate(
        {
            "name": "cells",
            "data": {"source": "csv", "train": "/nonexistent.csv"},
            "slots": slots,
            "tables": {"one": {"dim": 2}, "many": {"dim": 2}, "seq": {"dim": 2}},
            "dense": [{"column": "x", "normalization": "standard"}, {"column": "y", "normalization": "log1p"}],
            "label": {"column": "l", "positive": "1", **({"negative": negative} if negative else {})},
            "model": {"cls": "trillium.models:DNN"},
            "training": {"batch_size": 4, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
        }
    )
    rows = data.draw(st.integers(0, 12))
    columns = {c: data.draw(st.lists(_CELLS, min_size=rows, max_size=rows)) for c in ("a", "b", "x", "y")}
    columns["l"] = data.draw(st.lists(st.sampled_from([None, "", "0", "1", "2"]), min_size=rows, max_size=rows))
    encoder = Encoder(job, {"x": {"mean": 1.0, "std": 2.0}})
    table = pa.table({name: pa.array(cells, pa.string()) for name, cells in columns.items()})
    block = RowBlock("f", table, (), lambda idx: [(int(i), "") for i in idx])
    by_arrow = encoder.check(block)
    a = encoder.encode(block, by_arrow)
    # As prediction requests come (a column per field) and as a stream's events (a text per row).
    fields = ("a", "b", "x", "y")
    texts = ["\x1e".join(columns[f][i] or "" for f in fields) for i in range(rows)]
    for cells in (
        TextCells.of_columns(job, columns),
        TextCells.of_rows(job, texts, "\x1e", fields, columns["l"]),
    ):
        by_cells = encoder.check_cells(cells, lambda i: (i, ""), file="f")
        assert by_cells.bad == by_arrow.bad
        np.testing.assert_array_equal(by_cells.keep, by_arrow.keep)
        np.testing.assert_array_equal(by_cells.labels, by_arrow.labels)
        kept = by_arrow.keep
        np.testing.assert_array_equal(by_cells.dense[kept], by_arrow.dense[kept])
        b = encoder.encode_cells(cells, by_cells)
        np.testing.assert_array_equal(a.offsets, b.offsets)
        for x, y in zip(a.values, b.values, strict=True):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
