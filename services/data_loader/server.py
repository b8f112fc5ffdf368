"""The data_loader service: reads the job's source, builds batches, and produces them
to Kafka — train batches to the `samples` topic, test batches to `eval`, partition =
the NN rank a batch is for — with an idempotent, acks=all producer.

Batch ids run on across epochs, and every epoch is padded with empty batches to a
whole number of steps, so all ranks take the same number of steps (DDP needs that) and
a rank's step is `batch_id // nn_ranks` everywhere. Malformed rows are counted, logged
with file and line, and quarantined to `<run_dir>/quarantine/<job>.jsonl`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from trillium import codec, kafka
from trillium.batch import Batch, KeyedIds
from trillium.features import BatchBuilder
from trillium.job import JobRecord
from trillium.service import Service, run_service


def _empty_batch(like: Batch, batch_id: int, rank: int) -> Batch:
    keys = like.ids.keys
    return Batch(batch_id=batch_id, epoch=like.epoch, rank=rank,
                 ids=KeyedIds(keys=keys, values=np.zeros(0, np.uint64), lengths=np.zeros(0, np.int32)),
                 dense=np.zeros((0, like.dense.shape[1]), np.float32), labels=np.zeros(0, np.float32))


def numbered(batches: Iterator[Batch], first_id: int, ranks: int) -> Iterator[Batch]:
    """Renumber an epoch's batches from `first_id` and pad them to a multiple of `ranks`."""
    batch_id, last = first_id, None
    for batch in batches:
        last = dataclasses.replace(batch, batch_id=batch_id, rank=batch_id % ranks)
        yield last
        batch_id += 1
    while last is not None and batch_id % ranks:
        yield _empty_batch(last, batch_id, batch_id % ranks)
        batch_id += 1


class DataLoader(Service):
    role = "data_loader"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.counts: dict[str, Any] = {}

    def health(self) -> dict[str, Any]:
        return {"produced": self.counts}

    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        ranks = config.topology.nn_ranks
        quarantine = self.settings.run_dir / "quarantine" / f"{job.id}.jsonl"
        quarantine.parent.mkdir(parents=True, exist_ok=True)
        builder = BatchBuilder(config, quarantine=quarantine)
        # Reading and encoding the source is CPU work: keep the event loop (heartbeats) free.
        await asyncio.to_thread(builder.split, "train")
        producer = kafka.producer(self.settings.kafka_bootstrap)
        await producer.start()
        self.set_job_phase("ready")
        self.counts = {"train_batches": 0, "train_samples": 0, "eval_batches": 0, "eval_samples": 0}
        try:
            next_id = 0
            for epoch in range(config.training.epochs):
                batches = await asyncio.to_thread(lambda e=epoch, n=next_id: list(
                    numbered(builder.batches("train", e), n, ranks)))
                await self._produce(producer, job.topics.samples, batches, epoch, ranks, "train")
                next_id += len(batches)
            batches = await asyncio.to_thread(lambda: list(numbered(builder.batches("test"), 0, ranks)))
            await self._produce(producer, job.topics.eval, batches, 0, ranks, "eval")
        finally:
            await producer.stop()
        self.counts["malformed_rows"] = builder.malformed
        self.set_job_phase("done")
        await asyncio.Event().wait()  # keep reporting "done" until the job ends

    async def _produce(self, producer, topic: str, batches: list[Batch], epoch: int, ranks: int, kind: str) -> None:
        deliveries = [await producer.send(topic, codec.encode_batch(b), partition=b.rank) for b in batches]
        deliveries += [await producer.send(topic, b"", partition=r, headers=kafka.epoch_end_headers(epoch))
                       for r in range(ranks)]
        await asyncio.gather(*deliveries)
        self.counts[f"{kind}_batches"] += len(batches)
        self.counts[f"{kind}_samples"] += sum(b.batch_size for b in batches)


def main() -> None:
    run_service(DataLoader)
