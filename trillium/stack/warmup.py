"""The warm-up job `trillium up` runs before it returns.

What the first job after a start would pay once — the NN ranks' first torch steps, autograd and
process group, the embedding workers' and PS shards' first gRPC calls and table code, the Kafka
broker's JIT on its produce and fetch paths — is paid here, not by the user's first job. It trains
a few steps of a small synthetic job on every process of the stack (no files, no checkpoint, no
model published) and is then deleted with its Redis keys and topics.
"""

from __future__ import annotations

import logging
import time

from trillium.config import StackTopology
from trillium.job import JobConfig
from trillium.stack.client import CoordinatorClient

logger = logging.getLogger("trillium.stack.warmup")

ROWS = 20_000  # enough steps for the broker's C1 compiler and torch's first-call paths
TIMEOUT_S = 300.0


def warmup_job(topology: StackTopology) -> JobConfig:
    slots = [{"name": f"c{i}", "column": f"C{i}", "table": f"c{i}"} for i in range(1, 27)]
    return JobConfig.model_validate(
        {
            "name": "trillium-warmup",
            "data": {"source": "synthetic", "rows": ROWS, "test_rows": 1000, "vocab_sizes": [1000] * 26},
            "slots": slots,
            "tables": {f"c{i}": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.05}} for i in range(1, 27)},
            "dense": [{"column": f"I{i}", "normalization": "log1p"} for i in range(1, 14)],
            "label": {"column": "label", "positive": "1", "negative": "0"},
            "model": {
                "cls": "trillium.models:DNN",
                "kwargs": {"num_dense": 13, "embedding_dims": [8] * 26, "hidden": [32]},
            },
            "training": {
                "batch_size": 256,
                "epochs": 1,
                "staleness_bound": 2,
                "dense_optimizer": {"name": "sgd", "lr": 0.1},
                "eval_batch_size": 1000,
            },
            "topology": topology.model_dump(include={"nn_ranks", "ps_shards", "embedding_workers", "data_loaders"}),
            "checkpoint": None,
            "publish": None,
        }
    )


def warm_up(client: CoordinatorClient, topology: StackTopology) -> float:
    """Run the warm-up job to its end and delete it; returns its seconds. A warm-up that fails
    raises: a stack that cannot train a tiny job is not ready."""
    started = time.monotonic()
    job_id = client.submit(warmup_job(topology))["id"]
    view = client.follow(job_id, timeout_s=TIMEOUT_S)
    if view["job"]["state"] != "finished":
        raise RuntimeError(f"the warm-up job {job_id} ended {view['job']['state']}: {view['job']['error']}")
    client.delete(job_id)
    seconds = time.monotonic() - started
    logger.info("warm-up job trained", extra={"job": job_id, "seconds": round(seconds, 1)})
    return seconds
