"""A table's ID space (`tables.X.ids`) as stored things read it: jobs, checkpoints and model
versions written before the setting existed hashed every slot within the slot, so they read as
`per_slot` and keep finding their rows; a warm start into the other ID space is refused naming the
table and the setting. The oracle is the checkpoint fixture of format 4 (tests/data, written by
the code of its day, which hashed every slot in its own name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trillium.job import JobConfig, stored_config
from trillium.job.record import IllegalTransition, JobRecord
from trillium.runtime.checkpoint import Manifest
from trillium.runtime.model_store import VersionManifest
from trillium.services.coordinator.jobs import JobStore

DATA = Path(__file__).resolve().parents[1] / "data"
V4 = DATA / "checkpoint-v4"
(V4_JOB,) = [p for p in V4.iterdir() if p.is_dir()]
(V4_STEP,) = [p for p in V4_JOB.iterdir() if p.is_dir()]


def _v4_manifest() -> dict:
    return json.loads((V4_STEP / "manifest.json").read_text())


def test_a_config_stored_before_ids_existed_reads_per_slot_and_one_stored_since_as_written() -> None:
    old = _v4_manifest()["config"]
    assert all("ids" not in t for t in old["tables"].values())
    assert {t["ids"] for t in stored_config(old)["tables"].values()} == {"per_slot"}
    new = JobConfig.model_validate(old).model_dump(mode="json")  # today's schema: shared by default
    assert {t["ids"] for t in new["tables"].values()} == {"shared"}
    assert stored_config(new) == new
    mixed = new | {"tables": new["tables"] | {"item": new["tables"]["item"] | {"ids": "per_slot"}}}
    assert stored_config(mixed) == mixed


def test_checkpoints_versions_and_records_of_earlier_formats_hash_as_they_trained() -> None:
    raw = _v4_manifest()
    manifest = Manifest.model_validate(raw)
    assert manifest.format == 4
    history = next(s for s in manifest.config.slots if s.name == "history")
    assert history.table == "item" and manifest.config.id_space(history) == "history"  # as it trained

    # Today's job of the same file shares the item table's IDs between its slots.
    today = JobConfig.model_validate(raw["config"])
    assert today.id_space(history) == "item" != manifest.config.id_space(history)

    record = {
        "id": "j",
        "state": "running",
        "config": raw["config"],
        "topics": {"samples": "s", "eval": "e", "gradients": "g"},
        "created_at": 0.0,
        "updated_at": 0.0,
    }
    assert JobRecord.model_validate(record).config.tables["item"].ids == "per_slot"
    version = {
        "format": 1,
        "model": "m",
        "version": 1,
        "job_id": "j",
        "attempt": 0,
        "step": 1,
        "epoch": 0,
        "cut_at": 0.0,
        "created_at": 0.0,
        "kind": "full",
        "parts": "v1",
        "files": [],
        "dtype": "fp16",
        "config": raw["config"],
        "dense_stats": {},
    }
    assert VersionManifest.model_validate(version).config.tables["item"].ids == "per_slot"


def _warm_from_v4(**item: str) -> JobConfig:
    raw = _v4_manifest()["config"]
    tables = raw["tables"] | {"item": raw["tables"]["item"] | item}
    others = {name: t | {"ids": "per_slot"} for name, t in tables.items() if name != "item"}
    return JobConfig.model_validate(
        raw
        | {
            "tables": tables | others,
            "data": raw["data"]
            | {"train": str(DATA / "tiny_multitask" / "train.csv"), "test": str(DATA / "tiny_multitask" / "test.csv")},
            "init_from": {"job": V4_JOB.name, "step": int(V4_STEP.name), "dir": str(V4)},
        }
    )


def test_a_warm_start_into_the_other_id_space_is_refused_naming_the_table(tmp_path: Path) -> None:
    jobs = JobStore(None, str(tmp_path), None)  # type: ignore[arg-type] (a warm start reads no Redis)
    refused = r"table 'item' .* ids: per_slot, this job's ids: shared.*set tables\.item\.ids: per_slot"
    with pytest.raises(IllegalTransition, match=refused):
        jobs._warm_start(_warm_from_v4())
    ref = jobs._warm_start(_warm_from_v4(ids="per_slot"))
    assert ref is not None and ref.step == int(V4_STEP.name)
