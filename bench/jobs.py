"""The synthetic Criteo-layout job the stack benchmarks train: ID slots from the planted model's
categorical columns, its 13 counts as log1p dense columns, the default DNN (128, 64), one epoch
at batch 512 per rank, hybrid (k = 4). A benchmark names its data, tables and slots."""

from __future__ import annotations

from typing import Any

from trillium.config import StackTopology
from trillium.job import JobConfig


def criteo_layout_job(
    name: str,
    data: dict[str, Any],
    tables: dict[str, dict[str, Any]],
    slot_tables: list[str],
    dim: int,
    topology: StackTopology,
    training: dict[str, Any] | None = None,
    **extra: Any,
) -> JobConfig:
    """Slot `c{i}` (column `C{i}`) reads into table `slot_tables[i - 1]`, each of `dim` values."""
    return JobConfig.model_validate(
        {
            "name": name,
            "data": data,
            "slots": [{"name": f"c{i}", "column": f"C{i}", "table": t} for i, t in enumerate(slot_tables, start=1)],
            "tables": tables,
            "dense": [{"column": f"I{i}", "normalization": "log1p"} for i in range(1, 14)],
            "label": {"column": "label", "positive": "1", "negative": "0"},
            "model": {
                "cls": "trillium.models:DNN",
                "kwargs": {"num_dense": 13, "embedding_dims": [dim] * len(slot_tables), "hidden": [128, 64]},
            },
            "training": {
                "batch_size": 512,
                "epochs": 1,
                "staleness_bound": 4,
                "dense_optimizer": {"name": "sgd", "lr": 0.1},
                "seed": 0,
                "eval_batch_size": 4096,
                **(training or {}),
            },
            "topology": topology.model_dump(include={"nn_ranks", "ps_shards", "embedding_workers"}),
            **extra,
        }
    )
