"""Features: blocks of rows (`trillium.data.sources`) -> `Batch`es.

For each block, in worker threads: the dense columns are parsed as numbers and the label checked
(`Encoder.check`); the well-formed rows are then encoded (`Encoder.encode`): each slot's cells
hashed to u64 IDs in the slot's ID space (`JobConfig.id_space`) by `trillium_native.hash_strings` straight from the
Arrow buffers (jagged: int32 lengths per row; a multi-valued slot splits its cells on its separator
and keeps the first `max_len` non-empty values), dense values normalized to float32 (missing = 0),
labels 0/1 as float32. The blocks then pass, in order, through an optional shuffle buffer and are
cut into batches numbered 0, 1, ... within the epoch (`epoch_batches`).

Malformed rows (a wrong field count, a dense cell that is no finite number, an unknown label, a
split column without a value) are skipped, counted and reported to a `Quarantine`: logged with
file and line (the first 100 of a split one by one, then a total) and appended to a JSONL file,
`{"file", "line", "reason", "raw"}`; the job goes on.

**Dense statistics** (`standard`/`minmax` columns whose mean/std or min/max the job does not
give) come from one streaming pass over the train split before training (`dense_stats`), not
from a sample: a pass costs one read of the file, and exact statistics keep the presets' batches
identical to those of the readers this module replaced. The result is a small dict,
`{column: {"mean", "std"} | {"min", "max"}}`, that a loader can store in a checkpoint and hand
back (`stats=`) instead of reading the split again.

**Shuffling** (`training.shuffle_buffer` rows; 0 keeps file order): each block's rows join a
buffer of at most that many rows, and as many rows as overflow it leave, drawn uniformly from the
buffer and the block; the rest leave, shuffled, at the end of the epoch. The draws are a function
of (seed, epoch, part), so an epoch regenerates identically.

`BatchBuilder` is the in-memory convenience over the same code (the reference trainer, tests,
benchmarks): it encodes a split once and replays its batches.

Modules, imports running one way: `quarantine` (malformed rows) and `encode` (a block -> encoded
rows -> a batch) <- `stats` (dense statistics, files and streams) and `epochs` (shuffle and
cutting) <- `builder` (in memory).
"""

from .builder import BatchBuilder, EncodedSplit
from .encode import DenseStats, EncodedBlock, Encoder, TextCells, batch_of
from .epochs import epoch_batches
from .quarantine import Quarantine
from .stats import OnlineStats, dense_stats, given_stats, stats_from_data

__all__ = [
    "BatchBuilder",
    "DenseStats",
    "EncodedBlock",
    "EncodedSplit",
    "Encoder",
    "OnlineStats",
    "Quarantine",
    "TextCells",
    "batch_of",
    "dense_stats",
    "epoch_batches",
    "given_stats",
    "stats_from_data",
]
