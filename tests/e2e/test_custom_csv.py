"""A CSV in a layout no preset knows trains end to end through the stack (real Kafka, gRPC, Redis)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from pipeline_helpers import run_to_end

from trillium.data import load_job
from trillium.data.features import BatchBuilder

SITES = [f"site-{i}.example" for i in range(40)]
TAGS = list("abcdefghij")


def write_clicks(path: Path, rows: int, seed: int) -> None:
    """Clicks from a planted logistic model over a site, a numeric-looking ID, tags and a price;
    with missing values, quoted cells holding the delimiter, and two malformed rows (lines 11, 21)."""
    rng = np.random.default_rng(seed)
    site_w = rng.normal(0, 1.2, len(SITES))
    c14_w = rng.normal(0, 0.8, 25)
    tag_w = rng.normal(0, 0.8, len(TAGS))
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["id", "click", "hour", "site_id", "C14", "tags", "price", "note"])
        for i in range(rows):
            site, c14 = rng.integers(len(SITES)), rng.integers(25)
            tags = rng.choice(len(TAGS), rng.integers(0, 4), replace=False)
            price = rng.lognormal(1, 0.5)
            logit = site_w[site] + c14_w[c14] + tag_w[tags].sum() + 0.5 * (price - 3)
            click = int(rng.random() < 1 / (1 + np.exp(-logit)))
            row = [
                f"imp{i}",
                str(click),
                str(14102100 + 100 * (i * 10 // rows)),
                SITES[site] if i % 9 else "",
                str(15000 + c14),
                "|".join(TAGS[t] for t in tags),
                f"{price:.3f}" if i % 7 else "",
                f"from {SITES[site]}, slot {c14}",
            ]
            if i == 9:
                row = row[:5]  # wrong field count
            elif i == 19:
                row[6] = "free"  # no number
            out.writerow(row)


def test_a_csv_with_its_own_header_trains_end_to_end(training_stack: Path, tmp_path: Path) -> None:
    write_clicks(tmp_path / "clicks.csv", 4000, seed=1)
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "clicks",
                "data": {"source": "csv", "train": "clicks.csv", "split": {"by": "hour", "test_from": 14103000}},
                "slots": [
                    {"name": "site", "column": "site_id"},
                    {"name": "c14", "column": "C14"},
                    {"name": "tags", "column": "tags", "separator": "|", "max_len": 3, "pooling": "mean"},
                    {"name": "note", "column": "note"},
                ],
                "tables": {
                    name: {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.2}}
                    for name in ("site", "c14", "tags", "note")
                },
                "dense": [{"column": "price", "normalization": "standard"}],
                "label": {"column": "click", "positive": "1", "negative": "0"},
                "model": {
                    "cls": "trillium.models:DNN",
                    "kwargs": {"num_dense": 1, "embedding_dims": [4, 4, 4, 4], "hidden": [16]},
                },
                "training": {
                    "batch_size": 64,
                    "epochs": 2,
                    "staleness_bound": 1,
                    "dense_optimizer": {"name": "sgd", "lr": 0.1},
                    "seed": 2,
                    "shuffle_buffer": 1000,
                },
                "topology": {"nn_ranks": 2, "ps_shards": 2, "embedding_workers": 1},
            }
        )
    )
    job = load_job(tmp_path / "job.yaml")
    builder = BatchBuilder(job)
    train = builder.split("train")
    assert (train.rows, builder.split("test").rows) == (3600 - 2, 400)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    results = view["results"]
    for epoch in range(2):
        assert sum(r["epochs"][epoch]["samples"] for r in results.values()) == train.rows
        assert sum(r["epochs"][epoch]["label_sum"] for r in results.values()) == pytest.approx(train.labels.sum())
    assert report["auc"] > 0.65
    quarantine = training_stack / "quarantine" / f"{view['job']['id']}.jsonl"
    entries = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [(e["file"], e["line"], e["reason"]) for e in entries] == [
        (str(tmp_path / "clicks.csv"), 11, "expected 8 fields, got 5"),
        (str(tmp_path / "clicks.csv"), 21, "price: non-numeric value 'free'"),
    ]
