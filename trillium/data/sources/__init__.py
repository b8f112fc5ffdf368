"""Sources: a job's data, bytes -> blocks of rows (`RowBlock`: Arrow columns plus where each row
came from), split by split, in file order, in disjoint shares for several loaders.

- `delimited.py`: CSV/TSV files (`csv`; the `adult` and `criteo` presets, whose layouts
  are in `presets.py`), plain or compressed, parsed by pyarrow's CSV reader block by block.
- `parquet.py`: Parquet files, record batch by record batch.
- `synthetic.py`: rows drawn from trillium.data.sources.datagen's planted model.
- `files.py`: globs, compression, blocks on a byte grid, shares; `split.py`: split policies;
  `cells.py`: Arrow columns read as text or numbers; `rows.py`: the vocabulary.

`trillium.data.features` turns the blocks into batches. `trillium.job` imports `presets` (to
validate preset column names), so nothing in this package imports `trillium.job` at run time
(the config classes appear in annotations only, and a source tells kinds apart by their tags,
`data.source` and `split.by`), and importing the package loads no reader: `open_source`
does, so that the coordinator and the command line, which validate jobs, never load pyarrow or
the synthetic data generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trillium.data.sources.rows import (
    DENSE_VALUE,
    FIELD_COUNT,
    LABEL,
    SPLIT_VALUE,
    BlockTask,
    Malformed,
    RowBlock,
    Source,
    Split,
)

if TYPE_CHECKING:
    from trillium.job import DataConfig, JobConfig

__all__ = [
    "DENSE_VALUE",
    "FIELD_COUNT",
    "LABEL",
    "SPLIT_VALUE",
    "BlockTask",
    "Malformed",
    "RowBlock",
    "Source",
    "Split",
    "check_columns",
    "open_source",
]


def open_source(data: DataConfig) -> Source:
    """The source of a job's `data` section."""
    # The readers are imported here, not above (see the module docstring).
    if data.source == "parquet":
        from trillium.data.sources.parquet import ParquetSource

        return ParquetSource(data)
    if data.source == "synthetic":
        from trillium.data.sources.synthetic import SyntheticSource

        return SyntheticSource(data)
    from trillium.data.sources.delimited import DelimitedSource

    return DelimitedSource(data)


def check_columns(job: JobConfig, *, missing_files_ok: bool = False) -> None:
    """Fail (`ValueError`) naming a column the job uses that one of its files lacks, the file,
    and the columns that file has; or naming a file or glob that matches nothing, unless
    `missing_files_ok` (the files may be where the loaders run, not where the job is checked)."""
    if job.data.source == "kafka":
        return  # events have no header: a message lacking a mapped field goes to the dead-letter topic
    open_source(job.data).check(job, missing_files_ok=missing_files_ok)
