"""Delimited text files (`csv`, and the `adult` and `criteo` presets): bytes -> RowBlocks.

The files are cut into blocks of whole rows (`files.cut`) in the calling thread; each block is
then parsed by `pyarrow.csv.read_csv` in a worker thread (`BlockTask`), which releases the GIL.
Why pyarrow's reader: it parses at C++ speed straight into Arrow string arrays whose offset and data
buffers the native hasher reads in place, handles quoting, delimiters inside quotes and quoted
line breaks, and calls back for each row with the wrong number of fields instead of failing the
block. Blocks are parsed serially inside (`use_threads=False`) and in parallel across blocks:
that way pyarrow numbers the rows it rejects, and one row's line is found from its block alone.

Every cell is read as text (a numeric-looking categorical such as `15706` stays the text it is);
an empty cell, quoted or not, is missing. Line numbers and raw lines of malformed rows are
recovered from the block's bytes only for blocks that have some (`_Records`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from trillium.data.sources.files import (
    GRID,
    LineChain,
    LineCounter,
    SplitFiles,
    Unit,
    column_list,
    compression,
    count_lines,
    cut,
    first_row,
    next_row,
    open_stream,
    ranges,
    read_range,
    share,
)
from trillium.data.sources.presets import ADULT, CRITEO, Dialect
from trillium.data.sources.rows import FIELD_COUNT, SPLIT_VALUE, BlockTask, Malformed, RowBlock, Split
from trillium.data.sources.split import BLOCK_SHIFT, FILE_SHIFT, policy_column, split_rows

if TYPE_CHECKING:
    from trillium.job import AdultData, CriteoData, CsvData, JobConfig, SplitPolicy

__all__ = ["DelimitedSource", "Spec", "block_task"]

_HEADER_LIMIT = 1 << 20  # a header line longer than this is a wrong delimiter or no header


def dialect_of(data: AdultData | CriteoData | CsvData) -> Dialect:
    if data.source == "adult":
        return ADULT
    if data.source == "criteo":
        return CRITEO
    columns = tuple(data.columns) if data.columns is not None else None
    return Dialect(data.delimiter, data.quote, data.header, columns, data.quoted_newlines)


@dataclass(frozen=True)
class _Header:
    names: tuple[str, ...]  # the columns, in file order
    end: int  # the byte offset of the first row
    lines: int  # line breaks before it


class _Records:
    """The rows of a block as its bytes hold them, found only when asked (for malformed rows): the
    byte span (without line break) and the line (0-based, in the block) of every non-empty record,
    numbered from 1 as pyarrow numbers the rows it rejects (`rejected`; it parsed `parsed`)."""

    def __init__(
        self, data: bytes | bytearray, quote: bytes | None, rejected: list[int], parsed: int, file: str
    ) -> None:
        self._data, self._quote, self._file = data, quote, file
        self._rejected, self._parsed = np.array(rejected, np.int64), parsed
        self._spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._rows: np.ndarray | None = None
        self._lock = threading.Lock()

    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            if self._spans is None:
                self._spans = self._compute()
            return self._spans

    def _compute(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        v = np.frombuffer(self._data, np.uint8)
        n = len(v)
        cr = np.flatnonzero(v == 13)
        lone_cr = cr[(cr + 1 == n) | (v[np.minimum(cr + 1, n - 1)] != 10)] if len(cr) else cr
        ends = np.sort(np.concatenate([np.flatnonzero(v == 10), lone_cr]))  # last byte of each break
        crlf = (v[ends] == 10) & (ends > 0) & (v[np.maximum(ends - 1, 0)] == 13)
        starts = np.concatenate([[0], ends + 1])
        stops = np.concatenate([ends - crlf, [n]])
        if starts[-1] == n:  # the block ends with a line break
            starts, stops = starts[:-1], stops[:-1]
        first_line = np.arange(len(starts))
        if self._quote is not None:  # a break inside quotes continues the record
            quotes = np.flatnonzero(v == self._quote[0])
            closes = np.searchsorted(quotes, stops[:-1]) % 2 == 0
            last = np.concatenate([np.flatnonzero(closes), [len(starts) - 1]])
            first = np.concatenate([[0], last[:-1] + 1])
            starts, stops, first_line = starts[first], stops[last], first
        keep = stops > starts
        return starts[keep], stops[keep], first_line[keep]

    def rows(self) -> np.ndarray:
        """The record numbers of the rows pyarrow parsed, in order."""
        if self._rows is None:
            total = len(self.spans()[0])
            if total != self._parsed + len(self._rejected):
                raise ValueError(
                    f"{self._file}: pyarrow read {self._parsed + len(self._rejected)} rows where a block's "
                    f"bytes hold {total} lines: a line break inside quotes? (set data.quoted_newlines: true)"
                )
            self._rows = np.setdiff1d(np.arange(1, total + 1), self._rejected)
        return self._rows

    def place(self, numbers: np.ndarray, first_line: int) -> list[tuple[int, str]]:
        """`(line, raw)` of records `numbers` (1-based)."""
        self.rows()  # the records match pyarrow's, or fail saying why
        starts, stops, lines = self.spans()
        return [
            (first_line + int(lines[i]), bytes(self._data[starts[i] : stops[i]]).decode("utf-8", "replace"))
            for i in np.asarray(numbers, np.int64) - 1
        ]


@dataclass(frozen=True)
class Spec:
    """What parsing a block of one file needs."""

    file: str
    names: tuple[str, ...]
    wanted: tuple[str, ...]
    dialect: Dialect
    policy: SplitPolicy | None
    split: Split
    index: int  # the file's place in the split's list


def block_task(spec: Spec, k: int, i: int, read: Callable[[], bytes | bytearray], lines: LineChain) -> RowBlock:
    """A `BlockTask` body: read block `k` of a file, the `i`-th of its share (`lines`
    numbers them), count its line breaks, and parse it."""
    try:
        data = read()
        lines.record(i, count_lines(data))
    except BaseException:
        lines.record(i, None)
        raise
    return parse_block(spec, k, data, lambda: lines.first_line(i))


def parse_block(spec: Spec, k: int, data: bytes | bytearray, first_line: Callable[[], int]) -> RowBlock:
    """Parse block `k` of a file; `first_line()` is the line number of its first byte (asked
    for malformed rows only)."""
    dialect = spec.dialect
    invalid: list[tuple[int, int, str]] = []  # (record number, fields, text) of rows pyarrow rejects

    def on_invalid(row: pacsv.InvalidRow) -> str:
        if row.number is None:  # only a multi-threaded parse leaves it out
            raise RuntimeError("pyarrow gave no row number for a malformed row")
        invalid.append((row.number, row.actual_columns, row.text))
        return "skip"

    table = pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(
            column_names=list(spec.names), use_threads=False, block_size=max(len(data), 1 << 20) + 1
        ),
        parse_options=pacsv.ParseOptions(
            delimiter=dialect.delimiter,
            quote_char=dialect.quote or False,
            newlines_in_values=dialect.quoted_newlines,
            invalid_row_handler=on_invalid,
        ),
        convert_options=pacsv.ConvertOptions(
            include_columns=list(spec.wanted),
            column_types=dict.fromkeys(spec.wanted, pa.string()),
            strings_can_be_null=True,
            null_values=[""],
            check_utf8=False,  # cells are bytes to hash; a bad byte is no reason to fail a block
        ),
    )
    if dialect.strip or dialect.drop_final_dot:
        table = _adult_quirks(table, spec.names[-1], dialect)
    # Line breaks inside quotes are row breaks unless the job says otherwise (a stray quote in an
    # unquoted cell, `12" screen`, is then an ordinary character, as pyarrow reads it).
    quote = dialect.quote.encode() if dialect.quoted_newlines and dialect.quote else None
    records = _Records(data, quote, [number for number, _, _ in invalid], table.num_rows, spec.file)
    keep, problems = split_rows(spec.policy, table, spec.split, (spec.index << FILE_SHIFT) | (k << BLOCK_SHIFT))
    kept = None
    if keep is not None:
        table, kept = table.filter(pa.array(keep)), np.flatnonzero(keep)

    def place(numbers: np.ndarray) -> list[tuple[int, str]]:
        return records.place(numbers, first_line())

    def locate(rows: np.ndarray) -> list[tuple[int, str]]:
        rows = np.asarray(rows, np.int64)
        return place(records.rows()[kept[rows] if kept is not None else rows])

    # A row that cannot be parsed belongs to no split: with a split policy, it is reported with the
    # train split only (as split.py reports rows without a split value).
    reported = [
        (number, f"expected {len(spec.names)} fields, got {fields}")
        for number, fields, text in invalid
        if not (dialect.skip_prefix and text.startswith(dialect.skip_prefix))
        and not (dialect.strip and not text.strip())
        and (spec.policy is None or spec.split == "train")
    ]
    bad = []
    if reported:
        places = place(np.array([number for number, _ in reported]))
        bad += [
            Malformed(spec.file, line, raw, FIELD_COUNT, why)
            for (_, why), (line, raw) in zip(reported, places, strict=True)
        ]
    if problems:
        rows = np.array(sorted(problems), np.int64)
        bad += [
            Malformed(spec.file, line, raw, SPLIT_VALUE, problems[int(row)])
            for row, (line, raw) in zip(rows, place(records.rows()[rows]), strict=True)
        ]
    bad.sort(key=lambda m: m.line)
    return RowBlock(spec.file, table, tuple(bad), locate)


def _adult_quirks(table: pa.Table, last: str, dialect: Dialect) -> pa.Table:
    columns = []
    for name, column in zip(table.column_names, table.columns, strict=True):
        if dialect.strip:
            column = pc.ascii_trim_whitespace(column)
        if dialect.drop_final_dot and name == last:
            column = pc.replace_substring_regex(column, pattern=r"\.$", replacement="", max_replacements=1)
        columns.append(column)
    return pa.table(columns, names=table.column_names)


class DelimitedSource:
    """A `csv`, `adult` or `criteo` job's files (see the module docstring)."""

    def __init__(self, data: AdultData | CriteoData | CsvData) -> None:
        self._dialect = dialect_of(data)
        self._policy = data.split
        self._files = SplitFiles(data.train, data.test, data.split)
        self._headers: dict[Path, _Header] = {}

    def has(self, split: Split) -> bool:
        return self._files.has(split)

    def check(self, job: JobConfig, *, missing_files_ok: bool = False) -> None:
        self._files.check(job.column_uses(), lambda path: self._header(path).names, missing_ok=missing_files_ok)

    def blocks(self, split: Split, columns: Sequence[str], *, part: int = 0, parts: int = 1) -> Iterator[BlockTask]:
        files = self._files.files(split)
        wanted = tuple(dict.fromkeys([*columns, *filter(None, [policy_column(self._policy)])]))
        units = []
        for index, path in enumerate(files):
            size = path.stat().st_size
            if self._whole(path):
                units.append(Unit(index, path, 0, 1, size))
            else:
                units += [Unit(index, path, k, k + 1, min(GRID, size - k * GRID)) for k in range(-(-size // GRID))]
        for unit in share(units, part, parts):
            yield from self._unit_tasks(split, unit, wanted)

    def _whole(self, path: Path) -> bool:
        """Whether a file is read whole, never from a byte offset (files.py says why)."""
        return compression(path) is not None or self._dialect.quoted_newlines

    def _unit_tasks(self, split: Split, unit: Unit, wanted: tuple[str, ...]) -> Iterator[BlockTask]:
        header = self._header(unit.path)
        missing = [c for c in wanted if c not in header.names]
        if missing:
            raise ValueError(f"{unit.path}: no column {missing[0]!r}; its columns: {column_list(header.names)}")
        spec = Spec(str(unit.path), header.names, wanted, self._dialect, self._policy, split, unit.index)
        if self._whole(unit.path):  # read here, in order: a stream, or quotes to pair up
            quote = self._dialect.quote.encode() if self._dialect.quoted_newlines and self._dialect.quote else None
            lines = LineChain(LineCounter(unit.path, header.end, 1 + header.lines))
            with open_stream(unit.path) as f:
                f.read(header.end)
                for i, (k, _, data) in enumerate(cut(f, header.end, 1 << 62, quote)):
                    yield partial(block_task, spec, k, i, partial(bytes, data), lines)
            return
        with open(unit.path, "rb") as f:  # only the block ends here; each task reads its block
            offset = next_row(f, max(unit.first * GRID, header.end))
            lines = LineChain(LineCounter(unit.path, offset, 1 + header.lines if offset == header.end else None))
            for i, (k, start, end) in enumerate(ranges(f, offset, unit.last)):
                yield partial(block_task, spec, k, i, partial(read_range, unit.path, start, end), lines)

    def _header(self, path: Path) -> _Header:
        """The file's column names and where its rows start (cached per file)."""
        if path not in self._headers:
            dialect = self._dialect
            if not dialect.header:
                assert dialect.columns is not None  # the job schema requires them
                self._headers[path] = _Header(dialect.columns, 0, 0)
            else:
                quote = dialect.quote.encode() if dialect.quoted_newlines and dialect.quote else None
                with open_stream(path) as f:
                    first = first_row(f, quote, _HEADER_LIMIT)
                if first is None:
                    raise ValueError(f"{path}: no header line in its first {_HEADER_LIMIT} bytes")
                names = dialect.columns or tuple(_header_names(first, dialect))
                self._headers[path] = _Header(names, len(first), count_lines(first))
        return self._headers[path]


def _header_names(line: bytes, dialect: Dialect) -> list[str]:
    if not line.strip():
        return []
    return pacsv.read_csv(
        pa.py_buffer(line),
        read_options=pacsv.ReadOptions(use_threads=False),
        parse_options=pacsv.ParseOptions(
            delimiter=dialect.delimiter,
            quote_char=dialect.quote or False,
            newlines_in_values=dialect.quoted_newlines,
        ),
    ).column_names
