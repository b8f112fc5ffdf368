"""Prediction instances become the batches training makes of the same rows and events: one
transform, and a clear error naming the instance and the field for what cannot be a sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trillium.data import load_job
from trillium.data.features import BatchBuilder
from trillium.data.instances import BadInstance, InstanceEncoder
from trillium.data.sources.presets import ADULT
from trillium.job import ADULT_COLUMNS, JobConfig

ROOT = Path(__file__).resolve().parents[2]
ADULT_JOB = ROOT / "examples" / "adult" / "job.yaml"
ONLINE_JOB = ROOT / "examples" / "online" / "job.yaml"


def _adult_rows(n: int) -> list[dict[str, str]]:
    """The first rows of adult.test as a file job's instances: column -> cell, as the file has it."""
    rows = []
    for line in (ROOT / "examples/adult/data/adult.test").read_text().splitlines():
        cells = [c.strip() for c in line.split(ADULT.delimiter)]
        if len(cells) != len(ADULT_COLUMNS):
            continue
        rows.append(dict(zip(ADULT_COLUMNS, cells, strict=True)))
        if len(rows) == n:
            break
    return rows


def test_a_file_jobs_rows_encode_as_its_test_split() -> None:
    job = load_job(ADULT_JOB)
    builder = BatchBuilder(job)
    want = next(builder.batches("test"))
    instances = _adult_rows(want.batch_size)
    got = InstanceEncoder(job, builder.dense_stats).batch(instances)
    assert got.ids == want.ids
    np.testing.assert_array_equal(got.dense, want.dense)


def test_numbers_hash_as_their_digits_and_missing_fields_are_missing_values() -> None:
    job = load_job(ADULT_JOB)
    stats = BatchBuilder(job).dense_stats
    encoder = InstanceEncoder(job, stats)
    row = _adult_rows(1)[0]
    as_numbers = dict(row, age=int(row["age"]), capital_gain=float(row["capital_gain"]))
    assert encoder.batch([as_numbers]).ids == encoder.batch([row]).ids
    np.testing.assert_array_equal(encoder.batch([as_numbers]).dense, encoder.batch([row]).dense)
    empty = {column: "" for column in ADULT_COLUMNS}
    missing = encoder.batch([{}])
    assert missing.ids == encoder.batch([empty]).ids  # an absent field is an empty cell
    np.testing.assert_array_equal(missing.dense, np.zeros_like(missing.dense))  # missing dense values are 0


def _online() -> JobConfig:
    return JobConfig.model_validate(load_job(ONLINE_JOB).model_dump(mode="json"))


def test_a_streams_events_take_dotted_paths_and_lists() -> None:
    job = _online()
    stats = {d.column: {"mean": 0.0, "std": 1.0} for d in job.dense if d.normalization == "standard"}
    stats |= {d.column: {"min": 0.0, "max": 1.0} for d in job.dense if d.normalization == "minmax"}
    encoder = InstanceEncoder(job, stats)
    slot = job.slots[0]
    event: dict = {}
    node = event
    *parents, leaf = slot.column.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = ["a", "b", "c"]
    batch = encoder.batch([event, {}])
    values, lengths = batch.ids.slot(slot.name)
    assert lengths[0] == min(3, slot.max_len or 3) and lengths[1] == 0
    assert len(set(values.tolist())) == lengths[0]


@pytest.mark.parametrize(
    ("instance", "where"),
    [
        ("not an object", "instances[1]:"),
        ({"age": {"nested": 1}}, "instances[1].age:"),
        ({"age": "abc"}, "instances[1].age:"),
        ({"age": float("nan")}, "instances[1].age:"),
        ({"workclass": ["a", "b"]}, "instances[1].workclass:"),
        ({"workclass": "x" * 70_000}, "instances[1].workclass:"),
    ],
)
def test_what_cannot_be_a_sample_names_the_instance_and_the_field(instance, where) -> None:
    job = load_job(ADULT_JOB)
    encoder = InstanceEncoder(job, BatchBuilder(job).dense_stats)
    with pytest.raises(BadInstance) as err:
        encoder.batch([_adult_rows(1)[0], instance])
    assert str(err.value).startswith(where), str(err.value)
    assert err.value.index == 1
