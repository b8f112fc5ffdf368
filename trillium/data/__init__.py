"""A job's data: files and streams read as blocks of rows (`sources/`), rows turned into batches
(`features`), and a data set replayed as a live stream (`replay`).

Imports run one way: `trillium.job` (the schema) and `trillium.wire` (the batch) <- `sources` <-
`features` <- `replay`.
"""

from __future__ import annotations

from pathlib import Path

from trillium.data.sources import check_columns
from trillium.job import JobConfig, read_job

__all__ = ["load_job"]


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job YAML file (`trillium.job.read_job`), then check the columns it names
    against its files' headers (`trillium.data.sources`): a `ValueError` names the column, the
    file and the columns it has. Files not found here may be where the loaders run: they check
    again when they open them."""
    job = read_job(path)
    check_columns(job, missing_files_ok=True)
    return job
