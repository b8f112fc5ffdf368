"""Where a data loader's batches go: the NN ranks it feeds, and each batch's step and rank.

Loader i of N feeds ranks i, i + N, ... (each rank's partition has one writer, in step order);
its j-th batch of an epoch goes to rank `ranks[j mod k]` at step `first_step + j div k` (k: its
ranks), batch id `step * nn_ranks + rank` everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trillium.job import JobConfig
from trillium.wire import codec
from trillium.wire.batch import Batch, KeyedIds


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    value: bytes
    samples: int  # 0 for an epoch's end marker
    epoch_end: int | None = None


class Share:
    """Which ranks a loader feeds, and where its j-th batch of an epoch goes."""

    def __init__(self, config: JobConfig, index: int) -> None:
        topo = config.topology
        self.config = config
        self.ranks = list(range(index, topo.nn_ranks, topo.data_loaders))
        self.world = topo.nn_ranks

    def place(self, batch: Batch, j: int, first_step: int) -> Batch:
        rank = self.ranks[j % len(self.ranks)]
        step = first_step + j // len(self.ranks)
        return dataclasses.replace(batch, batch_id=step * self.world + rank, rank=rank)

    def steps(self, batches: int) -> int:
        return math.ceil(batches / len(self.ranks))

    def padding(self, epoch: int, batches: int, steps: int, first_step: int) -> Iterator[Batch]:
        """Empty batches giving each of our ranks `steps` batches of the epoch."""
        slots = tuple(s.name for s in self.config.slots)
        for j in range(batches, steps * len(self.ranks)):
            empty = Batch(
                batch_id=0,
                epoch=epoch,
                rank=0,
                ids=KeyedIds(keys=slots, values=np.zeros(0, np.uint64), lengths=np.zeros(0, np.int32)),
                dense=np.zeros((0, len(self.config.dense)), np.float32),
                labels=np.zeros((0, *self.config.label_shape), np.float32),
            )
            yield self.place(empty, j, first_step)

    def records(self, topic: str, batches: Iterator[Batch], first_j: int, first_step: int) -> Iterator[Record]:
        """Placed and encoded, on the reader's thread: the event loop only hands them on."""
        for j, batch in enumerate(batches, first_j):
            placed = self.place(batch, j, first_step)
            yield Record(topic, placed.rank, codec.encode_batch(placed), placed.batch_size)
