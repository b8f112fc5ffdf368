"""The batches of an epoch, streamed: a split's blocks encoded in order (skipping what a resumed
epoch has produced), through an optional shuffle buffer, cut into batches (`epoch_batches`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from trillium.data.sources import RowBlock, Split, open_source
from trillium.job import JobConfig
from trillium.wire.batch import Batch, KeyedIds

from .encode import DenseStats, EncodedBlock, Encoder, _Checked, in_order
from .quarantine import Quarantine


def _encoded(
    job: JobConfig,
    split: Split,
    encoder: Encoder,
    *,
    part: int,
    parts: int,
    skip_rows: int,
    quarantine: Quarantine | None,
) -> Iterator[EncodedBlock]:
    """The encoded rows of a split, block by block, but the first `skip_rows` well-formed rows,
    which are checked (to count them) but not encoded."""
    skipping = [skip_rows > 0]  # read by the workers: encode only past the skipped rows

    def work(block: RowBlock) -> tuple[RowBlock | None, _Checked, EncodedBlock | None]:
        checked = encoder.check(block)
        if skipping[0]:
            return block, checked, None
        return None, checked, encoder.encode(block, checked)

    remaining = skip_rows
    tasks = open_source(job.data).blocks(split, encoder.columns, part=part, parts=parts)
    for block, checked, encoded in in_order(tasks, work):
        if quarantine is not None:
            quarantine.add(checked.bad)
        if remaining:
            good = int(checked.keep.sum())
            if good <= remaining:
                remaining -= good
                continue
            assert block is not None  # checked while skipping
            encoded, remaining = encoder.encode(block, checked, skip=remaining), 0
            skipping[0] = False
        elif encoded is None:  # read while the flag was still up
            assert block is not None
            encoded = encoder.encode(block, checked)
        if encoded.rows:
            yield encoded


def _shuffle(
    blocks: Iterable[EncodedBlock], size: int, rng: np.random.Generator, skip_rows: int
) -> Iterator[EncodedBlock]:
    """The rows of `blocks` through a shuffle buffer of `size` rows (see the module docstring),
    but the first `skip_rows` rows out, which are drawn but not gathered."""
    alive: dict[int, EncodedBlock] = {}  # blocks holding rows of the buffer, by id
    pool_block, pool_row = np.zeros(0, np.int64), np.zeros(0, np.int64)  # the buffer's rows
    emitted = 0

    def gather(block_ids: np.ndarray, rows: np.ndarray) -> EncodedBlock:
        parts, order = [], []
        for b in np.unique(block_ids):
            picked = np.flatnonzero(block_ids == b)
            parts.append(alive[int(b)].take(rows[picked]))
            order.append(picked)
        merged = EncodedBlock.concat(parts)
        return merged.take(np.argsort(np.concatenate(order)))  # back to the drawn order

    def emit(block_ids: np.ndarray, rows: np.ndarray) -> EncodedBlock | None:
        nonlocal emitted
        drop = min(len(rows), max(0, skip_rows - emitted))
        emitted += len(rows)
        return gather(block_ids[drop:], rows[drop:]) if drop < len(rows) else None

    for next_id, block in enumerate(blocks):
        alive[next_id] = block
        window_block = np.concatenate([pool_block, np.full(block.rows, next_id)])
        window_row = np.concatenate([pool_row, np.arange(block.rows)])
        leaving = len(window_row) - size
        if leaving > 0:
            out = rng.choice(len(window_row), leaving, replace=False)
            stay = np.ones(len(window_row), bool)
            stay[out] = False
            if (emitted_rows := emit(window_block[out], window_row[out])) is not None:
                yield emitted_rows
            window_block, window_row = window_block[stay], window_row[stay]
        pool_block, pool_row = window_block, window_row
        live = np.bincount(pool_block, minlength=next_id + 1)
        for b in [b for b in alive if not live[b]]:
            del alive[b]
        if sum(b.rows for b in alive.values()) > 2 * size + block.rows:  # compact the buffer
            alive = {next_id: gather(pool_block, pool_row)}
            pool_block, pool_row = np.full(len(pool_row), next_id), np.arange(len(pool_row))
    if len(pool_row):
        order = rng.permutation(len(pool_row))
        if (rest := emit(pool_block[order], pool_row[order])) is not None:
            yield rest


def _batches(blocks: Iterable[EncodedBlock], job: JobConfig, size: int, epoch: int, first_id: int) -> Iterator[Batch]:
    """Consecutive rows of `blocks` cut into batches of `size` (the last may be smaller),
    numbered from `first_id`; batch `b` is for NN rank `b % topology.nn_ranks`."""
    keys = tuple(s.name for s in job.slots)
    ranks = job.topology.nn_ranks
    pieces: list[tuple[EncodedBlock, int, int]] = []
    have, batch_id = 0, first_id

    def batch() -> Batch:
        lengths = np.concatenate([b.lengths(i, j) for b, i, j in pieces], axis=1)
        values = np.concatenate(
            [b.values[k][b.offsets[k, i] : b.offsets[k, j]] for k in range(len(keys)) for b, i, j in pieces]
        )
        return Batch(
            batch_id=batch_id,
            epoch=epoch,
            rank=batch_id % ranks,
            ids=KeyedIds(keys=keys, values=values, lengths=lengths.ravel()),
            dense=np.concatenate([b.dense[i:j] for b, i, j in pieces]),
            labels=np.concatenate([b.labels[i:j] for b, i, j in pieces]),
        )

    for block in blocks:
        start = 0
        while start < block.rows:
            take = min(size - have, block.rows - start)
            pieces.append((block, start, start + take))
            have, start = have + take, start + take
            if have == size:
                yield batch()
                pieces, have, batch_id = [], 0, batch_id + 1
    if have:
        yield batch()


def _batch_size(job: JobConfig, split: Split) -> int:
    return job.training.batch_size if split == "train" else job.training.eval_batch_size


def _epoch(
    job: JobConfig, split: Split, epoch: int, part: int, skip: int, read: Callable[[int], Iterable[EncodedBlock]]
) -> Iterator[Batch]:
    """The batches of an epoch from `read(skip_rows)`'s blocks: shuffled or not, cut."""
    size = _batch_size(job, split)
    buffer = job.training.shuffle_buffer if split == "train" else 0
    if not buffer:
        return _batches(read(skip * size), job, size, epoch, skip)
    rng = np.random.default_rng((job.training.seed, epoch, part))
    return _batches(_shuffle(read(0), buffer, rng, skip * size), job, size, epoch, skip)


def epoch_batches(
    job: JobConfig,
    split: Split,
    *,
    stats: DenseStats,
    epoch: int = 0,
    part: int = 0,
    parts: int = 1,
    skip: int = 0,
    quarantine: Quarantine | None = None,
) -> Iterator[Batch]:
    """The batches of one epoch of a split, streamed: `part` of `parts` disjoint shares of the
    input (their union is every row once), numbered 0, 1, ... within the share and the epoch
    (`rank` = `batch_id % nn_ranks`; renumbering across shares and epochs is the loader's).

    `stats`: from `dense_stats`. `skip=k` starts at batch `k` (resuming an epoch): without a
    shuffle buffer, the rows of the skipped batches are parsed and checked but not encoded; with
    one, they are encoded (the buffer must see them) but not gathered into batches. Malformed rows
    of the whole share, skipped batches included, go to `quarantine` (pass None for an epoch
    whose rows were reported already)."""
    encoder = Encoder(job, stats)

    def read(skip_rows: int) -> Iterator[EncodedBlock]:
        return _encoded(job, split, encoder, part=part, parts=parts, skip_rows=skip_rows, quarantine=quarantine)

    return _epoch(job, split, epoch, part, skip, read)
