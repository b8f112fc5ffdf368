from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

import trillium_native
from trillium.data import load_job
from trillium.job import JobConfig, TableConfig
from trillium.job.data import ADULT_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
ADULT_JOB = ROOT / "examples" / "adult" / "job.yaml"
TINY_JOB = ROOT / "tests" / "data" / "tiny_job.yaml"


@pytest.fixture
def raw() -> dict[str, Any]:
    return yaml.safe_load(ADULT_JOB.read_text())


def errors(raw: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(raw)
    return str(info.value)


@pytest.mark.parametrize("path", [ADULT_JOB, TINY_JOB])
def test_shipped_jobs_load_with_paths_next_to_the_yaml(path: Path) -> None:
    job = load_job(path)
    assert job.data.train.is_absolute() and job.data.train.exists()
    assert job.data.test is not None and job.data.test.exists()
    assert job.data.train.is_relative_to(path.parent)


def test_adult_job_matches_persia_example() -> None:
    job = load_job(ADULT_JOB)
    assert [s.name for s in job.slots] == [
        "workclass",
        "education",
        "marital_status",
        "occupation",
        "relationship",
        "race",
        "sex",
        "native_country",
    ]
    assert job.embedding_dims == [8] * 8
    assert {t.optimizer.name for t in job.tables.values()} == {"adagrad"}
    assert {t.optimizer.lr for t in job.tables.values()} == {0.01}
    assert len(job.dense) == 5 and "fnlwgt" not in [d.column for d in job.dense]
    assert job.training.dense_optimizer.name == "sgd" and job.training.dense_optimizer.lr == 0.1
    assert (job.training.batch_size, job.training.epochs) == (128, 1)
    assert (job.topology.nn_ranks, job.topology.ps_shards, job.topology.embedding_workers) == (2, 2, 1)
    assert job.training.precision == "fp32"  # bf16 only when asked for


def test_json_round_trip() -> None:
    job = load_job(TINY_JOB)
    document = json.loads(json.dumps(job.model_dump(mode="json")))
    assert JobConfig.model_validate(document) == job


def test_unknown_column_names_the_slot_and_lists_columns(raw: dict[str, Any]) -> None:
    raw["slots"][3]["column"] = "ocupation"
    message = errors(raw)
    assert "slots[3] 'occupation': unknown column 'ocupation' for source 'adult'" in message
    assert "known columns: " + ", ".join(ADULT_COLUMNS) in message


def test_evaluation_groups_by_a_slot_and_names_a_wrong_one(raw: dict[str, Any]) -> None:
    assert JobConfig.model_validate(raw).evaluation.group_by is None  # no GAUC unless asked
    raw["evaluation"] = {"group_by": "occupation"}
    assert JobConfig.model_validate(raw).evaluation.group_by == "occupation"
    raw["evaluation"] = {"group_by": "user"}
    assert "evaluation.group_by: 'user' is no slot; slots: workclass, education," in errors(raw)
    raw["evaluation"] = {"group": "occupation"}
    assert "evaluation.group" in errors(raw) and "Extra inputs are not permitted" in errors(raw)


def test_unknown_dense_and_label_columns(raw: dict[str, Any]) -> None:
    bad = copy.deepcopy(raw)
    bad["dense"][1]["column"] = "years"
    assert "dense[1]: unknown column 'years'" in errors(bad)
    bad = copy.deepcopy(raw)
    bad["label"]["column"] = "income"
    assert "label: unknown column 'income'" in errors(bad)


@pytest.mark.parametrize(
    ("path", "value", "location", "allowed"),
    [
        (("slots", 0, "pooling"), "max", "slots.0.pooling", "'sum', 'mean' or 'none'"),
        (("tables", "race", "dtype"), "fp64", "tables.race.dtype", "'fp32', 'fp16' or 'bf16'"),
        (
            ("tables", "race", "optimizer", "name"),
            "adamw",
            "tables.race.optimizer",
            "'sgd', 'adagrad', 'rowwise_adagrad', 'adam', 'ftrl'",
        ),
        (("data", "source"), "tsv", "data", "'adult', 'criteo', 'csv', 'parquet', 'synthetic'"),
        (("dense", 0, "normalization"), "zscore", "dense.0.normalization", "'standard', 'log1p'"),
        (("training", "precision"), "fp16", "training.precision", "'fp32' or 'bf16'"),
    ],
)
def test_bad_enum_lists_allowed_values(raw, path, value, location, allowed) -> None:
    raw["tables"] = {name: dict(table) for name, table in raw["tables"].items()}  # unshare anchors
    raw["tables"]["race"]["optimizer"] = dict(raw["tables"]["race"]["optimizer"])
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    message = errors(raw)
    assert location in message and allowed in message


@pytest.mark.parametrize(
    ("path", "key", "location"),
    [
        ((), "trainig", "trainig"),
        (("training",), "batchsize", "training.batchsize"),
        (("slots", 0), "colum", "slots.0.colum"),
        (("tables", "sex"), "dimension", "tables.sex.dimension"),
        (("tables", "sex", "optimizer"), "beta1", "tables.sex.optimizer.adagrad.beta1"),
    ],
)
def test_unknown_key_names_the_field(raw, path, key, location) -> None:
    raw["tables"] = {name: copy.deepcopy(table) for name, table in raw["tables"].items()}
    node = raw
    for part in path:
        node = node[part]
    node[key] = 1
    message = errors(raw)
    assert location in message and "Extra inputs are not permitted" in message


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r["slots"][0].update(table="nope"), "slots[0] 'workclass': table 'nope' is not defined"),
        (lambda r: r["slots"].append(dict(r["slots"][0])), "slots[8] 'workclass': duplicate slot name"),
        (lambda r: r["tables"].update(extra={"dim": 4}), "tables ['extra'] are used by no slot"),
        (lambda r: r["slots"][0].update(pooling="none"), "pooling 'none' (a sequence) needs max_len"),
        (lambda r: r["dense"].append({"column": "age"}), "dense[5]: column 'age' is listed twice"),
        (lambda r: r["slots"][0].update(column="income_bracket"), "label column 'income_bracket' is also"),
        (lambda r: r["dense"][0].update(mean=1.0), "give both mean and std"),
        (
            lambda r: r["dense"][2].update(normalization="log1p", mean=1.0, std=2.0),
            "mean/std apply to 'standard' only",
        ),
        (lambda r: r["label"].update(negative=">50K"), "both positive and negative"),
        (lambda r: r["model"].update(cls="trillium.models.DNN"), "String should match pattern"),
        (lambda r: r["training"].pop("staleness_bound"), "training.staleness_bound\n  Field required"),
        (lambda r: r["training"].update(staleness_bound=-1), "greater than or equal to 0"),
        (lambda r: r["training"].update(eval_batch_size=1 << 22), "training.eval_batch_size: 4194304 samples of"),
        (lambda r: r["training"].update(batch_size=1 << 22), "exceed a gRPC message (64 MiB); at most"),
        (lambda r: r.update(slots=[]), "at least 1 item"),
        (lambda r: next(iter(r["tables"].values())).update(memory_budget_gb=1.0), "memory_budget_gb needs disk"),
        (lambda r: next(iter(r["tables"].values())).update(disk="/ssd"), "disk needs memory_budget_gb"),
        (
            lambda r: next(iter(r["tables"].values())).update(memory_budget_gb=0, disk="/ssd"),
            "memory_budget_gb\n  Input should be greater than 0",
        ),
    ],
)
def test_cross_field_errors(raw, mutate, message) -> None:
    mutate(raw)
    assert message in errors(raw)


def test_unbounded_staleness_and_defaults(raw: dict[str, Any]) -> None:
    raw["training"]["staleness_bound"] = None
    del raw["topology"]
    job = JobConfig.model_validate(raw)
    assert job.training.staleness_bound is None
    assert (job.topology.nn_ranks, job.topology.ps_shards) == (1, 1)
    assert job.slots[0].table == "workclass"  # a slot's table defaults to its name


def test_relative_paths_stay_relative_without_a_yaml_file(raw: dict[str, Any]) -> None:
    assert JobConfig.model_validate(raw).data.train == Path("data/adult.data")


def test_load_job_rejects_a_non_mapping(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        load_job(path)


def test_a_disk_tier_is_a_per_shard_budget_and_a_directory_apart_from_the_table(tmp_path: Path) -> None:
    config = TableConfig.model_validate({"dim": 4, "memory_budget_gb": 0.5, "disk": str(tmp_path)})
    assert config.tier_kwargs() == {"memory_budget_bytes": 1 << 29, "disk": str(tmp_path)}
    assert "disk" not in config.store_kwargs(seed=1)  # what a row holds does not depend on where it is
    assert TableConfig.model_validate({"dim": 4}).tier_kwargs() == {}
    store = trillium_native.EmbeddingStore()
    store.create_table("t", **config.store_kwargs(seed=5), **config.tier_kwargs())
    assert store.table_config("t")["memory_budget_bytes"] == 1 << 29


@pytest.mark.parametrize(
    "table",
    [
        {"dim": 4},
        {"dim": 4, "dtype": "fp16", "optimizer": {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.1}},
        {"dim": 4, "dtype": "bf16", "optimizer": {"name": "rowwise_adagrad"}, "weight_bound": 1.0},
        {"dim": 4, "initializer": "normal", "init_std": 0.1, "optimizer": {"name": "adam", "beta1": 0.8}},
        {"dim": 4, "optimizer": {"name": "ftrl", "alpha": 0.1, "l1": 0.01}, "capacity": 100},
        {"dim": 4, "admission": {"policy": "probability", "probability": 0.5}, "ttl_seconds": 60},
        {"dim": 4, "admission": {"policy": "threshold", "threshold": 2, "sketch_width": 1024}, "ttl_updates": 9},
    ],
)
def test_store_kwargs_are_what_the_native_store_accepts(table: dict[str, Any]) -> None:
    config = TableConfig.model_validate(table)
    store = trillium_native.EmbeddingStore()
    store.create_table("t", **config.store_kwargs(seed=5))
    rows = store.lookup("t", np.arange(3, dtype=np.uint64))
    assert rows.shape == (3, 4)
    # Same settings and seed: the same initial rows.
    again = trillium_native.EmbeddingStore()
    again.create_table("t", **config.store_kwargs(seed=5))
    np.testing.assert_array_equal(again.lookup("t", np.arange(3, dtype=np.uint64)), rows)


@pytest.mark.parametrize(
    ("key", "value"), [("fetch_min_bytes", 0), ("fetch_max_wait_ms", -1), ("fetch_max_wait_ms", 60_000)]
)
def test_a_streams_fetch_settings_out_of_range_name_the_field(key: str, value: int) -> None:
    raw = yaml.safe_load((ROOT / "examples" / "online" / "job.yaml").read_text())
    assert JobConfig.model_validate(raw).data.fetch_max_wait_ms == 50  # the default: a slow stream waits this long
    raw["data"][key] = value
    assert f"data.kafka.{key}" in errors(raw)
