"""The preset sources' layouts, beside the reader that reads them (`delimited.py`); their column
names are the job schema's (`trillium.job.data`), which validates preset jobs against them. `adult` and `criteo` are dialects of the generic
delimited-text reader, kept bit for bit to the readers they replace (the golden digests in
`tests/data/golden_batches.json`); `synthetic` rows are Criteo-format text read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from trillium.job.data import ADULT_COLUMNS, CRITEO_COLUMNS

__all__ = ["ADULT", "CRITEO", "Dialect"]


@dataclass(frozen=True)
class Dialect:
    """How a delimited text file is written."""

    delimiter: str
    quote: str | None  # None: quotes are ordinary characters
    header: bool  # the first line of every file is a header, not a row
    columns: tuple[str, ...] | None  # the column names; None: the header's
    quoted_newlines: bool = False  # a quoted value may hold line breaks
    # UCI Adult's quirks: cells padded with spaces, lines of whitespace and adult.test's
    # "|1x3 Cross validator" line are no rows, and adult.test's labels end with a ".".
    strip: bool = False  # trim ASCII whitespace around every cell; a line of whitespace is no row
    skip_prefix: str | None = None  # a line starting with this is no row
    drop_final_dot: bool = False  # one trailing "." of the last column's cells is dropped


# Neither preset quotes: a quote character is an ordinary one, as in the files they come from.
ADULT = Dialect(",", None, False, ADULT_COLUMNS, strip=True, skip_prefix="|", drop_final_dot=True)
CRITEO = Dialect("\t", None, False, CRITEO_COLUMNS)
