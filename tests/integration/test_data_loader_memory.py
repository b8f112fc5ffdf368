"""The loader streams: reading a 2 GB file into batches, its memory stays flat (resident set growth
< 200 MB from before the first read to the end, measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trillium.data.sources.datagen import PlantedModel

FILE_BYTES = 2 << 30
GROWTH_LIMIT_MB = 200

# Runs in a fresh process: the resident set is read from /proc before reading, then every 50
# batches to the end.
MEASURE = """
import json, sys
from trillium.data.features import epoch_batches
from trillium.job import JobConfig

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

job = JobConfig.model_validate({
    "name": "memory", "data": {"source": "criteo", "train": sys.argv[1]},
    "slots": [{"name": f"c{i}", "column": f"C{i}"} for i in range(1, 27)],
    "tables": {f"c{i}": {"dim": 4} for i in range(1, 27)},
    "dense": [{"column": f"I{i}", "normalization": "log1p"} for i in range(1, 14)],
    "label": {"column": "label", "positive": "1", "negative": "0"},
    "model": {"cls": "trillium.models:DNN"},
    "training": {"batch_size": 1024, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
})
rows, start, peak = 0, rss_mb(), 0.0
for i, batch in enumerate(epoch_batches(job, "train", stats={})):
    rows += batch.batch_size
    if i % 50 == 0:
        peak = max(peak, rss_mb())
print(json.dumps({"rows": rows, "start_mb": start, "peak_mb": max(peak, rss_mb())}))
"""


def test_rss_stays_flat_reading_a_2gb_file(tmp_path: Path) -> None:
    block = b"".join(b.to_tsv() for b in PlantedModel.create(3).sample(40_000))  # ~9 MB of rows
    path = tmp_path / "big.tsv"
    with open(path, "wb") as f:
        for _ in range(-(-FILE_BYTES // len(block))):
            f.write(block)
    try:
        rows = path.stat().st_size // len(block) * 40_000
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, timeout=900, check=True
        )
        result = json.loads(out.stdout)
        assert result["rows"] == rows
        assert result["peak_mb"] - result["start_mb"] < GROWTH_LIMIT_MB, result
    finally:
        path.unlink()
