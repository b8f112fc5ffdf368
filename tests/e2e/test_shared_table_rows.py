"""One ID, one row across the slots of a table, through the stack: the tiny multi-task job's
`history` (a sequence of items) and `item` (the candidate) read table `item`. Shared (the
default), an item is one ID whichever slot reads it: the PS's final checkpoint and the model's
final version hold exactly the IDs of the items seen in either column, hashed in the table's
name, and the replica serving it as many rows. Per slot, each column's items are hashed in the
slot's own name: as many rows as items of each column, counted apart. The oracle is the training
file's own columns and the documented hash, not the encoder."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import DATA, run_to_end
from replica import Replica, newest_version
from waiting import wait_until

import trillium_native
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.runtime.checkpoint import JobCheckpoints
from trillium.runtime.model_store import ModelStore


def _job(ids: str) -> JobConfig:
    raw = load_job(DATA / "tiny_multitask_job.yaml").model_dump(mode="json")
    raw["name"] = f"id-space-{ids.replace('_', '-')}"
    raw["tables"]["item"]["ids"] = ids
    raw["training"]["epochs"] = 1
    raw["checkpoint"] = {"every_steps": None, "every_seconds": None, "full_every": 1}  # the final one, full
    raw["publish"] = {"every_seconds": None, "full_every": 1}  # the final version, full
    return JobConfig.model_validate(raw, context={"base_dir": DATA})


def _expected_ids(ids: str) -> np.ndarray:
    """The IDs table `item` must hold after an epoch: every item of the training file's `item` and
    `history` columns (no admission policy: a row at first sight), in the slots' ID space."""
    rows = list(csv.DictReader((DATA / "tiny_multitask" / "train.csv").open()))
    items = {r["item"] for r in rows if r["item"]}
    history = {v for r in rows for v in r["history"].split("|")[:5] if v}
    if ids == "shared":
        hashed = trillium_native.hash_ids("item", sorted(items | history))
    else:
        hashed = np.concatenate(
            [trillium_native.hash_ids("item", sorted(items)), trillium_native.hash_ids("history", sorted(history))]
        )
    assert len(np.unique(hashed)) == len(hashed)  # no two values share a 64-bit hash here
    return np.unique(hashed)


@pytest.mark.parametrize("ids", ["shared", "per_slot"])
def test_the_slots_of_a_table_share_its_rows_through_the_ps_a_checkpoint_and_serving(training_stack, ids) -> None:
    job = _job(ids)
    expected = _expected_ids(ids)
    view, _ = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]

    # The PS's rows as the final checkpoint holds them: exactly the expected IDs.
    checkpoints = JobCheckpoints.of(job, view["job"]["id"], str(training_stack))
    final = checkpoints.complete()[-1]
    assert all(f.delta_of is None for f in final.files)
    store = trillium_native.EmbeddingStore()
    for entry in final.files:
        if entry.name.endswith(".snap"):
            store.load(Path(checkpoints.dir(final.step).path) / entry.name)
    assert store.num_rows("item") == len(expected)
    assert all(store.get_row("item", int(i)) is not None for i in expected)

    # The model's final version holds the same rows, and so does the replica serving it.
    version = newest_version(training_stack, job)
    models = ModelStore.of(job, training_stack)
    dims = {name: table.dim for name, table in job.tables.items()}
    tables = trillium_native.ServingTables(dims, job.topology.ps_shards, version.dtype)
    with contextlib.ExitStack() as files:
        parts = models.parts(version.parts)
        paths = [(f.shard, files.enter_context(parts.reading(f.name))) for f in version.values]
        tables.apply(paths, version.version)
    _, _, misses = tables.lookup([("item", expected)])
    assert misses == [0] and tables.stats()["item"]["rows"] == len(expected)
    replica = Replica(training_stack)
    replica.wait_for(job.name, version.version)
    served = wait_until(lambda: replica.view(job.name).get("tables", {}).get("item"), "the replica's item table", 30)
    assert served["rows"] == len(expected)
    print(f"\nids {ids}: {len(expected)} rows of table item in the checkpoint, the version and the replica")
