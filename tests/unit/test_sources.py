"""Generic sources: CSV in any layout, Parquet, compression, globs, shares for several loaders,
split policies, and the column checks of job files."""

from __future__ import annotations

import csv
import gzip
import io
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import trillium_native
from trillium.data import load_job
from trillium.data.features import BatchBuilder, dense_stats, epoch_batches
from trillium.data.sources import open_source
from trillium.data.sources.cells import as_numbers
from trillium.data.sources.files import GRID, LineChain, LineCounter, cut, next_row, ranges, read_range
from trillium.job import JobConfig

HEADER = ["id", "click", "hour", "site", "C14", "tags", "price", "note"]
# A layout no preset knows: string, numeric-looking and multi-valued categoricals, missing values,
# quoted cells holding the delimiter (and a quote).
ROWS = [
    ["a1", "1", "14102100", "news.example", "15706", "x|y|z", "1.5", "hello, world"],
    ["a2", "0", "14102100", "", "007", "", "", 'say "hi", then'],
    ["a3", "0", "14102101", "shop.example", "15706", "y||x", "2", ""],
    ["a4", "1", "14102902", "news.example", "42", "z", "-3.25", "plain"],
    ["a5", "0", "14102923", "shop.example", "7", "x|x|y|z|w", "0", "a,b,c"],
]


def write_csv(path: Path, rows: list[list[str]] = ROWS, header: list[str] | None = HEADER, **kw: Any) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, **kw)
        if header is not None:
            writer.writerow(header)
        writer.writerows(rows)
    return path


def csv_job(train: Any, *, data: dict[str, Any] | None = None, **training: Any) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "custom",
            "data": {"source": "csv", "train": train, **(data or {})},
            "slots": [
                {"name": "site", "column": "site"},
                {"name": "c14", "column": "C14"},
                {"name": "tags", "column": "tags", "separator": "|", "max_len": 3, "pooling": "mean"},
                {"name": "note", "column": "note"},
            ],
            "tables": {"site": {"dim": 4}, "c14": {"dim": 4}, "tags": {"dim": 4}, "note": {"dim": 4}},
            "dense": [{"column": "price", "normalization": "standard"}],
            "label": {"column": "click", "positive": "1", "negative": "0"},
            "model": {"cls": "trillium.models:DNN"},
            "training": {"batch_size": 2, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}, **training},
        }
    )


def one_batch(job: JobConfig, split: str = "train") -> Any:
    """All rows of a split as one batch."""
    builder = BatchBuilder(job)
    job = job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 10**6})})
    return next(epoch_batches(job, split, stats=builder.dense_stats))


def expected_ids(slot: str, cells: list[list[str]]) -> tuple[np.ndarray, list[int]]:
    flat = [v for row in cells for v in row]
    return trillium_native.hash_ids(slot, flat), [len(row) for row in cells]


def test_a_csv_in_its_own_layout_encodes_by_column_name(tmp_path: Path) -> None:
    batch = one_batch(csv_job(write_csv(tmp_path / "train.csv")))
    assert batch.batch_size == 5
    np.testing.assert_array_equal(batch.labels, [1, 0, 0, 1, 0])
    checks = {
        "site": [["news.example"], [], ["shop.example"], ["news.example"], ["shop.example"]],
        "c14": [["15706"], ["007"], ["15706"], ["42"], ["7"]],  # IDs as text: "007" is not "7"
        "tags": [["x", "y", "z"], [], ["y", "x"], ["z"], ["x", "x", "y"]],  # empties dropped, first 3
        "note": [["hello, world"], ['say "hi", then'], [], ["plain"], ["a,b,c"]],  # quotes undone
    }
    for slot, cells in checks.items():
        values, lengths = batch.ids.slot(slot)
        ids, counts = expected_ids(slot, cells)
        np.testing.assert_array_equal(values, ids, err_msg=slot)
        np.testing.assert_array_equal(lengths, counts, err_msg=slot)
    prices = np.array([1.5, 2, -3.25, 0])  # row 2's is missing: 0 after normalization
    expect = np.insert((prices - prices.mean()) / prices.std(), 1, 0.0).astype(np.float32)
    np.testing.assert_array_equal(batch.dense[:, 0], expect)


def test_parquet_form_of_the_same_data_gives_the_same_batches(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "train.csv")
    # pyarrow infers types: hour, C14 and price become numbers, the label an integer.
    table = pacsv.read_csv(path)
    assert pa.types.is_integer(table.schema.field("C14").type)
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=2)
    from_csv = csv_job(path)
    from_parquet = csv_job(tmp_path / "train.parquet", data={"source": "parquet"})
    with pytest.raises(AssertionError):  # "007" became 7: an honest difference, checked next
        assert list(BatchBuilder(from_csv).batches()) == list(BatchBuilder(from_parquet).batches())
    rows = [r if r[0] != "a2" else [*r[:4], "7", *r[5:]] for r in ROWS]
    path = write_csv(tmp_path / "train.csv", rows)
    pq.write_table(pacsv.read_csv(path), tmp_path / "train.parquet", row_group_size=2)
    csv_batches = list(BatchBuilder(csv_job(path)).batches())
    assert len(csv_batches) == 3
    assert csv_batches == list(BatchBuilder(from_parquet).batches())


def test_parquet_malformed_rows_name_the_row_number_and_the_row(tmp_path: Path) -> None:
    rows = [r[:] for r in ROWS]
    rows[3][6] = "cheap"  # price is then a string column
    table = pacsv.read_csv(
        write_csv(tmp_path / "train.csv", rows), convert_options=pacsv.ConvertOptions(column_types={"C14": pa.string()})
    )
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=2)
    job = csv_job(tmp_path / "train.parquet", data={"source": "parquet"})
    builder = BatchBuilder(job, quarantine=tmp_path / "q.jsonl")
    assert builder.split("train").rows == 4
    [record] = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert (record["file"], record["line"], record["reason"]) == (
        str(tmp_path / "train.parquet"),
        4,
        "price: non-numeric value 'cheap'",
    )
    assert json.loads(record["raw"]) == {**dict(zip(HEADER, rows[3], strict=True)), "click": 1, "hour": 14102902}


def test_compressed_files_and_globs_read_in_order(tmp_path: Path) -> None:
    plain = write_csv(tmp_path / "day_0.csv", ROWS[:3])
    with gzip.open(tmp_path / "day_1.csv.gz", "wt", newline="") as f:
        csv.writer(f).writerows([HEADER, *ROWS[3:]])
    together = write_csv(tmp_path / "all.csv")
    pa_out = pa.output_stream(str(tmp_path / "all.csv.zst"), compression="zstd")
    pa_out.write(together.read_bytes())
    pa_out.close()
    expect = list(BatchBuilder(csv_job(together)).batches())
    assert list(BatchBuilder(csv_job(str(tmp_path / "day_*"))).batches()) == expect
    assert list(BatchBuilder(csv_job([str(plain), str(tmp_path / "day_1.csv.gz")])).batches()) == expect
    assert list(BatchBuilder(csv_job(tmp_path / "all.csv.zst")).batches()) == expect


def test_without_header_the_job_names_the_columns(tmp_path: Path) -> None:
    tsv = write_csv(tmp_path / "train.tsv", header=None, delimiter="\t")
    job = csv_job(tsv, data={"header": False, "columns": HEADER, "delimiter": "\t"})
    assert list(BatchBuilder(job).batches()) == list(BatchBuilder(csv_job(write_csv(tmp_path / "t.csv"))).batches())
    # With a header line and columns, the line is skipped and the job's names replace its names.
    document = csv_job(tmp_path / "t.csv").model_dump(mode="json")
    document["data"]["columns"] = [c.upper() for c in HEADER]
    document |= {
        "label": {"column": "CLICK", "positive": "1"},
        "dense": [],
        "slots": [{"name": "site", "column": "SITE"}],
        "tables": {"site": {"dim": 2}},
    }
    values, _ = next(BatchBuilder(JobConfig.model_validate(document)).batches()).ids.slot("site")
    np.testing.assert_array_equal(values, trillium_native.hash_ids("site", ["news.example"]))


def test_a_missing_column_fails_validation_naming_it_and_the_header(tmp_path: Path) -> None:
    write_csv(tmp_path / "train.csv")
    document = csv_job(tmp_path / "train.csv").model_dump(mode="json")
    document["data"]["train"] = "train.csv"  # relative to the job file
    document["slots"][1]["column"] = "C15"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(ValueError) as info:
        load_job(tmp_path / "job.yaml")
    message = str(info.value)
    assert "slots[1] 'c14': unknown column 'C15'" in message and str(tmp_path / "train.csv") in message
    assert "its columns: " + ", ".join(HEADER) in message
    document["data"]["train"] = "elsewhere/*.csv"  # files the loaders will see: checked there
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document))
    job = load_job(tmp_path / "job.yaml")
    with pytest.raises(ValueError, match=r"data.train: no file matches '.*elsewhere/\*.csv'"):
        BatchBuilder(job)


def test_a_column_split_cuts_by_hour_and_reports_bad_values_once(tmp_path: Path) -> None:
    rows = [*ROWS, ["a6", "1", "", "x", "1", "", "1", ""], ["a7", "0", "soon", "x", "1", "", "1", ""], ["a8", "1"]]
    job = csv_job(write_csv(tmp_path / "train.csv", rows), data={"split": {"by": "hour", "test_from": 14102900}})
    builder = BatchBuilder(job)
    assert builder.has_test
    np.testing.assert_array_equal(builder.split("train").labels, [1, 0, 0])
    np.testing.assert_array_equal(builder.split("test").labels, [1, 0])
    # Rows of neither split are reported once, with the train split.
    assert builder.malformed == {"split_value": 2, "field_count": 1}
    by_text = csv_job(tmp_path / "train.csv", data={"split": {"by": "id", "test_from": "a4"}})
    builder = BatchBuilder(by_text)
    assert (builder.split("train").rows, builder.split("test").rows) == (3, 4)


def test_a_fraction_split_is_stable_and_disjoint(tmp_path: Path) -> None:
    rows = [[f"r{i}", str(i % 2), "1", f"s{i}", str(i), "", str(i), ""] for i in range(2000)]
    path = write_csv(tmp_path / "train.csv", rows)

    def ids(split: str, seed: int = 0) -> set[int]:
        """The rows of a split, by their C14 IDs (one per row)."""
        job = csv_job(path, data={"split": {"by": "fraction", "test_fraction": 0.2, "seed": seed}})
        return {int(v) for v in one_batch(job, split).ids.slot("c14")[0]}

    train, test = ids("train"), ids("test")
    assert not train & test and len(train | test) == 2000
    assert 300 < len(test) < 500
    assert ids("test") == test and ids("test", seed=1) != test


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_blocks_cut_on_the_grid_whatever_the_line_ending(tmp_path: Path, newline: str) -> None:
    # 64-byte lines: a line starts exactly on each grid line.
    line = ("x" * (63 - len(newline)) + "," + newline).encode()
    data = line * (2 * GRID // len(line) + 3)
    blocks = list(cut(io.BytesIO(data), 0, 1 << 62, None))
    assert [(k, offset) for k, offset, _ in blocks] == [(0, 0), (1, GRID), (2, 2 * GRID)]
    assert b"".join(bytes(b) for _, _, b in blocks) == data
    quoted = b'"a\nb",1\n' + b"c,2\n"  # a line break inside quotes is no row end
    assert [bytes(b) for _, _, b in cut(io.BytesIO(quoted), 0, 1 << 62, b'"')] == [quoted]
    # A plain file's blocks found by seeking (where a loader's share starts) are the same ranges.
    path = tmp_path / "grid.csv"
    path.write_bytes(data + b"tail-without-newline")
    with open(path, "rb") as f:
        expect = [(k, offset, offset + len(b)) for k, offset, b in cut(f, 0, 1 << 62, None)]
        assert list(ranges(f, 0, 1 << 62)) == expect
        assert next_row(f, GRID + 1) == GRID + 64  # mid-line: the next row
        assert list(ranges(f, GRID + 64, 1 << 62)) == [(1, GRID + 64, 2 * GRID), *expect[2:]]
        assert list(ranges(f, next_row(f, GRID), 2)) == expect[1:2]
    assert read_range(path, *expect[-1][1:]).endswith(b"tail-without-newline")


def test_line_chain_numbers_blocks_counted_out_of_order() -> None:
    chain = LineChain(LineCounter(Path("unused"), 0, 10))
    chain.record(1, 5)
    chain.record(0, 3)
    assert chain.first_line(0) == 10 and chain.first_line(2) == 18
    waiting = threading.Thread(target=lambda: results.append(chain.first_line(4)))
    results: list[int] = []
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # block 3 not counted yet
    chain.record(3, 1)
    chain.record(2, 0)
    waiting.join(5)
    assert results == [19]
    chain.record(4, None)  # block 4 failed before counting
    with pytest.raises(RuntimeError, match="block 4 of the same share failed"):
        chain.first_line(5)


def numbered_rows(n: int) -> list[list[str]]:
    pad = "-" * 60  # ~100-byte rows: files of a few grid blocks
    return [[f"r{i}{pad}", str(i % 2), "1", f"s{i % 97}", str(i), "x|y" if i % 3 else "", str(i), ""] for i in range(n)]


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_shares_hold_every_row_exactly_once(tmp_path: Path, parts: int) -> None:
    # Three plain files of ~5, ~1 and 0 grid blocks, a gzip file (read whole) and a quoted-newline
    # free layout: byte ranges, whole files and tiny files mixed.
    big = write_csv(tmp_path / "a_big.csv", numbered_rows(220_000))
    write_csv(tmp_path / "b_small.csv", numbered_rows(300))
    write_csv(tmp_path / "c_empty.csv", [])
    with gzip.open(tmp_path / "d.csv.gz", "wt", newline="") as f:
        csv.writer(f).writerows([HEADER, *numbered_rows(1000)])
    assert big.stat().st_size > 4 * GRID
    job = csv_job(str(tmp_path / "*.csv*"), batch_size=512)
    stats = dense_stats(job)
    shares = []
    for part in range(parts):
        batches = epoch_batches(job, "train", stats=stats, part=part, parts=parts)
        shares.append(np.concatenate([b.dense[:, 0] for b in batches] or [np.zeros(0, np.float32)]))
    whole = np.concatenate(shares)
    expect = np.concatenate([b.dense[:, 0] for b in epoch_batches(job, "train", stats=stats)])
    np.testing.assert_array_equal(whole, expect)  # every row once, shares in file order
    assert len(expect) == 220_000 + 300 + 1000
    if parts > 1:
        assert sum(len(s) > 0 for s in shares) > 1


def test_parquet_and_synthetic_shares(tmp_path: Path) -> None:
    table = pacsv.read_csv(write_csv(tmp_path / "train.csv", numbered_rows(5000)))
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=700)
    pq.write_table(table.slice(0, 100), tmp_path / "b.parquet")
    job = csv_job(str(tmp_path / "*.parquet"), data={"source": "parquet"}, batch_size=256)
    stats = dense_stats(job)
    full = np.concatenate([b.dense[:, 0] for b in epoch_batches(job, "train", stats=stats)])
    for parts in (2, 5):
        shares = [
            np.concatenate(
                [b.dense[:, 0] for b in epoch_batches(job, "train", stats=stats, part=p, parts=parts)]
                or [np.zeros(0, np.float32)]
            )
            for p in range(parts)
        ]
        np.testing.assert_array_equal(np.concatenate(shares), full)
    synthetic = load_job(Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml").model_dump(mode="json")
    synthetic["data"] = {"source": "synthetic", "rows": 140_000, "seed": 2, "vocab_sizes": [5] * 26}
    job = JobConfig.model_validate(synthetic)
    stats = dense_stats(job)
    labels = [
        np.concatenate([b.labels for b in epoch_batches(job, "train", stats=stats, part=p, parts=2)]) for p in range(2)
    ]
    # Sample blocks of 131072 rows; the second's middle falls in the second half.
    assert [len(x) for x in labels] == [131072, 140_000 - 131072]
    whole = np.concatenate([b.labels for b in epoch_batches(job, "train", stats=stats)])
    np.testing.assert_array_equal(np.concatenate(labels), whole)


def test_malformed_rows_name_file_line_and_raw_text(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    good = ",".join(ROWS[0][:-1]) + ',"hello, world"'
    lines = [
        ",".join(HEADER),
        good,
        "a2,1,1,x,1",
        good.replace("1.5", "cheap"),
        '"a\nb",1,1,x,1,,1,\r',
        good.replace(",1,", ",yes,", 1),
        "",
        good,
    ]
    path.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    quarantine = tmp_path / "q.jsonl"
    job = csv_job(path, data={"quoted_newlines": True})
    builder = BatchBuilder(job, quarantine=quarantine)
    assert builder.split("train").rows == 3
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in records] == [
        (str(path), 3, "expected 8 fields, got 5"),
        (str(path), 4, "price: non-numeric value 'cheap'"),
        (str(path), 8, "click: unknown label 'yes'"),
    ]
    assert records[0]["raw"] == "a2,1,1,x,1" and records[1]["raw"] == lines[3]
    # The quoted line break makes one well-formed row of lines 5 and 6; its stray \r ends line 6 (as
    # Python and pyarrow count lines) and the \r\n after it an empty line 7: "yes" is on line 8.
    assert builder.malformed == {"field_count": 1, "dense_value": 1, "label": 1}


def test_a_stray_quote_in_an_unquoted_cell_is_an_ordinary_character(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    good = ",".join(ROWS[0][:-1]) + ",plain"
    path.write_text("\n".join([",".join(HEADER), good.replace("plain", '12" screen'), good, "x,2,1,,1,,1,n"]) + "\n")
    builder = BatchBuilder(csv_job(path), quarantine=tmp_path / "q.jsonl")
    values, _ = next(builder.batches()).ids.slot("note")
    np.testing.assert_array_equal(values, trillium_native.hash_ids("note", ['12" screen', "plain"]))
    [record] = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert (record["line"], record["reason"]) == (4, "click: unknown label '2'")


def test_line_numbers_of_a_share_that_starts_mid_file(tmp_path: Path) -> None:
    rows = numbered_rows(100_000)
    rows[90_000][6] = "n/a"  # line 90_002 (after the header)
    path = write_csv(tmp_path / "train.csv", rows)
    assert path.stat().st_size > 2 * GRID
    job = csv_job(path)
    stats = {"price": {"mean": 0.0, "std": 1.0}}
    quarantine = tmp_path / "q.jsonl"
    from trillium.data.features import Quarantine

    report = Quarantine("train", quarantine)
    counts = [
        sum(b.batch_size for b in epoch_batches(job, "train", stats=stats, part=p, parts=2, quarantine=report))
        for p in range(2)
    ]
    assert sum(counts) == 99_999 and min(counts) > 0
    [record] = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert record["line"] == 90_002 and record["reason"] == "price: non-numeric value 'n/a'"
    assert record["raw"] == ",".join(rows[90_000])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="0123456789+-.eEinfaINFx _", max_size=8), min_size=1, max_size=20))
def test_numbers_parse_as_python_float_does(cells: list[str]) -> None:
    values, bad = as_numbers(pa.array(cells), "x")
    for i, cell in enumerate(cells):
        try:
            number = float(cell) if cell else None
        except ValueError:
            assert bad[i] == f"x: non-numeric value {cell!r}"
            continue
        if number is None:
            assert np.isnan(values[i]) and i not in bad
        elif not np.isfinite(number):
            assert bad[i] == f"x: non-finite value {cell!r}"
        else:
            assert values[i] == number and i not in bad


def test_a_job_without_test_has_no_test_blocks(tmp_path: Path) -> None:
    source = open_source(csv_job(write_csv(tmp_path / "train.csv")).data)
    assert source.has("train") and not source.has("test")
    assert list(source.blocks("test", ["click"])) == []
