"""Files of a split, and how they are cut: into shares for several loaders, and into blocks.

**Blocks.** A plain (uncompressed) delimited file is cut on a grid of `GRID` bytes: block `k`
holds the rows that *start* in bytes `[k * GRID, (k + 1) * GRID)`, so a block ends at the first
line break at or after its grid line and every row falls in exactly one block, wherever a reader
starts. Blocks are the unit of parallel parsing and bound the memory a reader holds; they also
give every row a stable place `(file, block, index)` that does not depend on how the input is
shared (`split.py` draws fraction splits from it). Lines end with `\\n` or `\\r\\n`.

**Shares.** `share(units, part, parts)` gives loader `part` of `parts` a run of consecutive
units, cut by size, so the shares are disjoint and together hold every unit once. A unit is a grid
block of a plain file, a whole compressed file (`.gz`, `.zst`: a stream cannot be entered in
the middle), a whole file whose quoted values may hold line breaks (a byte offset cannot tell a
line break inside quotes from a row's end), or a Parquet row group. With fewer units than loaders
some loaders get none.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from trillium.job import SplitPolicy

__all__ = [
    "GRID",
    "LineChain",
    "LineCounter",
    "SplitFiles",
    "Unit",
    "column_list",
    "compression",
    "count_lines",
    "cut",
    "expand",
    "first_row",
    "next_row",
    "open_stream",
    "ranges",
    "read_range",
    "share",
]

GRID = 1 << 22  # 4 MiB: about 18k Criteo rows per block
_READ = 1 << 22  # bytes per read while counting lines
_LOOKAHEAD = 1 << 16  # read past a grid line to find the row end there
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# An error names at most this many of a file's columns, each cut to COLUMN_SHOWN characters: the
# header of a file that was never meant as data (a key file's line) goes no further than this.
COLUMNS_SHOWN = 40
COLUMN_SHOWN = 64


def expand(paths: Path | Sequence[Path], what: str, *, missing_ok: bool = False) -> list[Path]:
    """The files of `paths` in order, each glob pattern expanded in sorted order; a pattern or
    file that matches nothing fails naming it (`what` says where it is set), unless
    `missing_ok`."""
    files: list[Path] = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        text = str(path)
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text] * Path(text).is_file()
        if not matches and not missing_ok:
            raise ValueError(f"{what}: no file matches {text!r}")
        files += [Path(m) for m in matches]
    return files


class SplitFiles:
    """The files of each split of a file source: the test split's are the test files, or the train
    files when a split policy cuts them in two (`split.py`)."""

    def __init__(
        self, train: Path | Sequence[Path], test: Path | Sequence[Path] | None, policy: SplitPolicy | None
    ) -> None:
        self._train, self._test, self._policy = train, test, policy

    def has(self, split: str) -> bool:
        return split == "train" or self._test is not None or self._policy is not None

    def files(self, split: str, *, missing_ok: bool = False) -> list[Path]:
        if split == "train" or self._policy is not None:
            return expand(self._train, "data.train", missing_ok=missing_ok)
        return expand(self._test, "data.test", missing_ok=missing_ok) if self._test is not None else []

    def check(
        self, uses: Sequence[tuple[str, str]], names_of: Callable[[Path], Sequence[str]], *, missing_ok: bool
    ) -> None:
        """Fail naming the first column in `uses` (`(where, column)`) that a file lacks or
        holds twice, with the file and the columns it has."""
        files = dict.fromkeys(self.files("train", missing_ok=missing_ok) + self.files("test", missing_ok=missing_ok))
        for path in files:
            names = list(names_of(path))
            for where, column in uses:
                if column not in names:
                    raise ValueError(f"{where}: unknown column {column!r} in {path}; its columns: {column_list(names)}")
                if names.count(column) > 1:
                    raise ValueError(f"{where}: column {column!r} appears {names.count(column)} times in {path}")


def column_list(names: Sequence[str]) -> str:
    """A file's column names as an error shows them: the first COLUMNS_SHOWN, each cut short."""
    shown = [n if len(n) <= COLUMN_SHOWN else n[:COLUMN_SHOWN] + "…" for n in names[:COLUMNS_SHOWN]]
    more = f", … ({len(names) - COLUMNS_SHOWN} more)" if len(names) > COLUMNS_SHOWN else ""
    return ", ".join(shown) + more


def compression(path: Path) -> str | None:
    """The codec of a compressed file, from its extension; None for a plain file."""
    return _COMPRESSION.get(path.suffix.lower())


def open_stream(path: Path) -> BinaryIO:
    """The file's bytes, decompressed when its extension says so."""
    codec = compression(path)
    return pa.input_stream(str(path), compression=codec) if codec else open(path, "rb")


@dataclass(frozen=True)
class Unit:
    """What one loader reads whole: blocks `[first, last)` of file `index` of the split (grid
    blocks of a plain file, row groups of a Parquet file; `[0, 1)` for a file read whole)."""

    index: int
    path: Path
    first: int
    last: int
    weight: int  # bytes (Parquet: rows), for cutting shares


def share(units: Sequence[Unit], part: int, parts: int) -> list[Unit]:
    """Loader `part`'s share of `units`: those whose middle byte falls in its `1/parts` of
    the total; consecutive blocks of a file are merged into one unit."""
    if not 0 <= part < parts:
        raise ValueError(f"part must be in [0, {parts}), got {part}")
    total = sum(u.weight for u in units)
    mine: list[Unit] = []
    before = 0
    for unit in units:
        owner = min(parts - 1, (2 * before + unit.weight) * parts // (2 * total)) if total else 0
        before += unit.weight
        if owner != part:
            continue
        last = mine[-1] if mine else None
        if last is not None and last.index == unit.index and last.last == unit.first:
            mine[-1] = Unit(unit.index, unit.path, last.first, unit.last, last.weight + unit.weight)
        else:
            mine.append(unit)
    return mine


def count_lines(data: bytes | bytearray) -> int:
    """Line breaks in `data` (`\\n`, `\\r\\n` or a lone `\\r`, as Python and pyarrow
    count them)."""
    v = np.frombuffer(data, np.uint8)
    n = int(np.count_nonzero(v == 10))
    if data.find(b"\r") >= 0:
        n += int(np.count_nonzero(v == 13)) - int(np.count_nonzero((v[:-1] == 13) & (v[1:] == 10)))
    return n


class LineCounter:
    """The line number of byte `offset` of a plain file, counted from the file's start only when
    first asked (a malformed row in a share that starts mid-file); thread-safe."""

    def __init__(self, path: Path, offset: int, line: int | None = None) -> None:
        self._path, self._offset, self._line = path, offset, line
        self._lock = threading.Lock()

    def line(self) -> int:
        with self._lock:
            if self._line is None:
                lines, last = 0, b""
                with open(self._path, "rb") as f:
                    remaining = self._offset
                    while remaining:
                        chunk = f.read(min(_READ, remaining))
                        remaining -= len(chunk)
                        lines += count_lines(chunk)
                        if last == b"\r" and chunk[:1] == b"\n":  # one \r\n across two chunks
                            lines -= 1
                        last = chunk[-1:]
                self._line = 1 + lines
            return self._line


class LineChain:
    """Line numbers of consecutive blocks read from one place (a share of a file, a stream): each
    block's task counts its own line breaks, in a worker thread; block `i`'s first line is the
    place's first line plus the breaks of blocks `0..i-1`, waited for when asked. Tasks start
    in order, so those are running or done (a task that fails first records None)."""

    def __init__(self, start: LineCounter) -> None:
        self._start = start
        self._counts: dict[int, int | None] = {}
        self._changed = threading.Condition()

    def record(self, i: int, lines: int | None) -> None:
        with self._changed:
            self._counts[i] = lines
            self._changed.notify_all()

    def first_line(self, i: int) -> int:
        with self._changed:
            self._changed.wait_for(lambda: all(j in self._counts for j in range(i)))
            counts = [self._counts[j] for j in range(i)]
        if None in counts:
            raise RuntimeError(f"block {counts.index(None)} of the same share failed: its line count is unknown")
        return self._start.line() + sum(counts)  # type: ignore[arg-type]  # no None left


def _row_end(buf: bytes | bytearray, start: int, quote: bytes | None) -> int:
    """The index just after the first line break at or after `start` that ends a row (outside
    quotes when `quote` is given; `buf` starts at a row's start); -1 when `buf` has none."""
    nl = buf.find(b"\n", start)
    if quote is None:
        return nl + 1 if nl >= 0 else -1
    while nl >= 0 and buf.count(quote, 0, nl) % 2:
        nl = buf.find(b"\n", nl + 1)
    return nl + 1 if nl >= 0 else -1


def first_row(f: BinaryIO, quote: bytes | None, limit: int) -> bytes | None:
    """The first row of `f` with its line break (all of `f` when it has none); None when it
    is longer than `limit` bytes."""
    buf = b""
    while (end := _row_end(buf, 0, quote)) < 0 and len(buf) <= limit:
        chunk = f.read(1 << 16)
        if not chunk:
            return buf
        buf += chunk
    return buf[:end] if 0 <= end <= limit else None


def next_row(f: BinaryIO, offset: int) -> int:
    """The first row start at or after byte `offset` of a plain file (its size when none): just
    after the first `\\n` at or after `offset - 1`."""
    if offset == 0:
        return 0
    pos = f.seek(offset - 1)
    while chunk := f.read(_LOOKAHEAD):
        nl = chunk.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(chunk)
    return f.seek(0, os.SEEK_END)


def ranges(f: BinaryIO, offset: int, last: int) -> Iterator[tuple[int, int, int]]:
    """`(k, start, end)`: the byte range of each block before block `last` of a plain file's
    rows from `offset` (a row's start). Only a little is read past each grid line, to find the
    row end there: the blocks' bytes are read by whoever parses them (`read_range`)."""
    size = os.fstat(f.fileno()).st_size
    while offset < size and (k := offset // GRID) < last:
        end = next_row(f, (k + 1) * GRID)
        yield k, offset, end
        offset = end


def read_range(path: Path, start: int, end: int) -> bytearray:
    """Bytes `[start, end)` of a file."""
    buf = bytearray(end - start)
    with open(path, "rb") as f:
        f.seek(start)
        got = _read_into(f, memoryview(buf))
    if got != len(buf):
        raise OSError(f"{path}: {got} bytes at offset {start} where {len(buf)} were: did it change while read?")
    return buf


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill `view` from `f`; how many bytes were read (fewer only at the end of `f`)."""
    got = 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    return got


def cut(f: BinaryIO, offset: int, last: int, quote: bytes | None) -> Iterator[tuple[int, int, bytearray]]:
    """The blocks before block `last` of the rows read from `f`, positioned at byte `offset`
    (a row's start): `(k, offset, bytes)` per block that starts a row, `bytes` ending at a
    row's end. `quote`: rows may hold line breaks inside such quotes (`f` must then be
    positioned at its first row, so that quotes pair up). Each block is read into its own buffer;
    only the few bytes read past its end are copied to the next."""
    rest, more = b"", True
    while (k := offset // GRID) < last:
        target = (k + 1) * GRID - 1 - offset  # the block ends at the first row end from here on
        buf = bytearray(max(target + _LOOKAHEAD, len(rest)))
        buf[: len(rest)] = rest
        filled = len(rest) + (_read_into(f, memoryview(buf)[len(rest) :]) if more else 0)
        more = more and filled == len(buf)
        del buf[filled:]
        end = _row_end(buf, target, quote) if len(buf) > target else -1
        while end < 0 and more:  # a long row: read on to its end
            searched = len(buf)
            chunk = f.read(_LOOKAHEAD)
            more = bool(chunk)
            buf += chunk
            end = _row_end(buf, max(target, searched), quote) if len(buf) > target else -1
        if end < 0:
            end = len(buf)  # the last row, without a line break
        if not end:
            return
        rest = bytes(buf[end:])
        del buf[end:]
        yield k, offset, buf
        offset += end
