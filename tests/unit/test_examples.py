"""The example job files of public CTR data sets in their own layouts (examples/avazu,
examples/criteo) validate, read a few rows in that layout, and train: their data is not shipped,
so each runs on generated rows written the way the real files are."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from trillium.data import load_job
from trillium.data.features import BatchBuilder
from trillium.data.sources.datagen import generate_criteo
from trillium.data.sources.datagen_multitask import generate_multitask
from trillium.train.reference import train_baseline

ROOT = Path(__file__).resolve().parents[2]
AVAZU_HEADER = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,"
    "device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
)


def job_in(tmp_path: Path, example: str, name: str = "job.yaml") -> Path:
    shutil.copy(ROOT / "examples" / example / name, tmp_path / name)
    (tmp_path / "data").mkdir()
    return tmp_path / name


def test_avazu_job_reads_avazus_gzipped_csv_and_trains(tmp_path: Path) -> None:
    path = job_in(tmp_path, "avazu")
    rng = np.random.default_rng(0)
    with gzip.open(tmp_path / "data" / "train.gz", "wt") as f:
        f.write(AVAZU_HEADER + "\n")
        for i in range(3000):
            hour = 14102100 + 100 * (i * 10 // 3000)  # ten days, in time order
            ids = [f"{rng.integers(1 << 32):08x}" for _ in range(9)]  # site_id .. device_model
            numbers = [str(rng.integers(1000, 1010))] + [str(rng.integers(0, 7)) for _ in range(11)]
            f.write(
                ",".join([str(10**18 + i), str(int(rng.random() < 0.17)), str(hour), *numbers[:2], *ids, *numbers[2:]])
                + "\n"
            )
    job = load_job(path)
    builder = BatchBuilder(job)
    assert (builder.split("train").rows, builder.split("test").rows) == (2700, 300)
    assert builder.malformed == {}
    assert len(next(builder.batches()).ids.keys) == 21
    result = train_baseline(job)
    assert result.examples == 2700 and result.test_auc is not None


def test_criteo_job_reads_criteos_tsv_and_trains(tmp_path: Path) -> None:
    path = job_in(tmp_path, "criteo")
    generate_criteo(tmp_path / "data" / "train.txt", 5000, seed=1)
    job = load_job(path)
    builder = BatchBuilder(job)
    train, test = builder.split("train").rows, builder.split("test").rows
    assert train + test == 5000 and 400 < test < 600
    result = train_baseline(job)
    assert result.examples == train and result.test_auc is not None


@pytest.mark.parametrize("name", ["job.yaml", "esmm.yaml", "ple.yaml"])  # MMoE, ESMM, PLE
def test_the_multitask_jobs_read_datagens_feed_and_train_every_task(tmp_path: Path, name: str) -> None:
    """examples/multitask on `trillium datagen --multitask` rows (a few thousand, not its 10M):
    three tasks read from their columns, trained, each scored."""
    path = job_in(tmp_path, "multitask", name)
    generate_multitask(tmp_path / "data" / "train.csv", 3000, 1, users=200, items=500)
    generate_multitask(tmp_path / "data" / "test.csv", 500, 1, split="test", users=200, items=500)
    job = load_job(path)
    builder = BatchBuilder(job)
    labels = builder.split("train").labels
    assert labels.shape == (3000, 3) and builder.malformed == {} and not np.isnan(labels).any()
    result = train_baseline(job, builder=builder)
    assert result.examples == 3000 and result.test_tasks is not None
    assert set(result.test_tasks) == {"click", "watch_time", "conversion"}
    assert result.test_tasks["watch_time"]["mse"] > 0 and result.test_tasks["click"]["auc"] is not None
