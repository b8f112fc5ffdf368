"""The `adult`, `criteo` and `synthetic` presets give bit-identical batches to the readers
they replaced (`trillium/data.py` at commit dbcb0e3).

The oracle is `tests/data/golden_batches.json`: the SHA-256 digest (`digest` below) of every
batch of each split of the jobs `CASES` builds, computed by running this module's `CASES` and
`digest` against that commit's `trillium.data.BatchBuilder(job).batches(split)`, and, for a
Criteo file with malformed rows, that reader's quarantine records. A batch digest covers the slot
keys, the IDs, the lengths, the dense values and the labels, with their dtypes and shapes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trillium.data import load_job
from trillium.data.features import BatchBuilder
from trillium.job import JobConfig
from trillium.wire.batch import Batch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "data" / "golden_batches.json").read_text())["cases"]


def digest(batch: Batch) -> str:
    h = hashlib.sha256()
    h.update("\0".join(batch.ids.keys).encode())
    for a in (batch.ids.values, batch.ids.lengths, batch.dense, batch.labels):
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def tiny() -> JobConfig:
    return load_job(ROOT / "tests" / "data" / "tiny_job.yaml")


def synthetic() -> JobConfig:
    document = tiny().model_dump(mode="json")
    document["data"] = {"source": "synthetic", "rows": 3000, "test_rows": 700, "seed": 4, "vocab_sizes": [50] * 26}
    return JobConfig.model_validate(document)


def tiny_multivalued() -> JobConfig:
    document = tiny().model_dump(mode="json")
    document["slots"][0] = {"name": "c1", "column": "C1", "table": "a", "separator": "a", "max_len": 2}
    document["slots"][4] = {"name": "c5", "column": "C5", "table": "a", "separator": "0", "pooling": "mean"}
    return JobConfig.model_validate(document)


CASES: dict[str, Callable[[], JobConfig]] = {
    "tiny": tiny,  # criteo: feature groups, missing values, every normalization
    "adult": lambda: load_job(ROOT / "examples" / "adult" / "job.yaml"),  # adult.test's quirks
    "synthetic": synthetic,
    "tiny_multivalued": tiny_multivalued,  # separators, max_len
}


@pytest.mark.parametrize("case", list(CASES))
def test_preset_batches_are_bit_identical_to_the_replaced_readers(case: str) -> None:
    builder = BatchBuilder(CASES[case]())
    for split in ("train", "test"):
        assert [digest(b) for b in builder.batches(split)] == GOLDEN[case][split], split


def malformed_tiny_file(directory: Path) -> Path:
    """tiny/train.tsv with four malformed rows and a blank line."""
    lines = (ROOT / "tests" / "data" / "tiny" / "train.tsv").read_text().splitlines()
    for index, field, value in [(16, 1, "not-a-number"), (39, 3, "inf"), (49, 0, "2")]:
        fields = lines[index].split("\t")
        fields[field] = value
        lines[index] = "\t".join(fields)
    lines[4] = "only\tthree\tfields"
    lines.insert(29, "")
    path = directory / "train.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def records(path: Path) -> Iterator[dict]:
    for line in path.read_text().splitlines():
        yield {**json.loads(line), "file": Path(json.loads(line)["file"]).name}


def test_malformed_rows_are_skipped_and_quarantined_as_before(tmp_path: Path) -> None:
    document = tiny().model_dump(mode="json")
    document["data"] = {"source": "criteo", "train": str(malformed_tiny_file(tmp_path))}
    builder = BatchBuilder(JobConfig.model_validate(document), quarantine=tmp_path / "q.jsonl")
    assert [digest(b) for b in builder.batches("train")] == GOLDEN["tiny_malformed"]["train"]
    assert list(records(tmp_path / "q.jsonl")) == GOLDEN["tiny_malformed"]["quarantine"]
