"""Native embedding parameter store of Trillium (Rust, PyO3), the embedding worker's
per-batch dedup, routing, pooling and gradient scatter (`PoolingLayout`), and a model
replica's serving store (`ServingTables`, fed by `StoreCapture.write_values`).

Everything batched releases the GIL and runs on the store's own thread pool.
Ids are `numpy.uint64` arrays; rows are `float32` (or `float16`) arrays.
See `native/README.md` for semantics, the snapshot and the values-file formats.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, NotRequired, Self, Sequence, TypedDict

import numpy as np
import numpy.typing as npt

__version__: str
SNAPSHOT_FORMAT_VERSION: int
VALUES_FORMAT_VERSION: int

DType = Literal["fp32", "fp16", "bf16"]
Optimizer = Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]
Admission = Literal["off", "probability", "threshold"]
Initializer = Literal["uniform", "normal"]

class TableStats(TypedDict):
    rows: int
    memory_bytes: int
    admitted: int
    not_admitted: int
    evicted: int
    expired: int
    nan_grads_skipped: int
    lookups: int
    updates: int
    dropped_grads: int
    update_batches: int
    forgotten: int  # rows removed by `forget` (not in snapshots: 0 again in a new process)
    version: int
    internal_shards: int
    # Only for a table with a disk tier (memory_budget_bytes and disk):
    disk_rows: NotRequired[int]  # rows spilled to disk (counted in `rows` too)
    disk_bytes: NotRequired[int]  # bytes of the spill files
    disk_reads: NotRequired[int]  # records read back
    disk_writes: NotRequired[int]  # records spilled
    disk_lookup_hits: NotRequired[int]  # looked-up ids read from disk (of `lookups`)
    resident_rows: NotRequired[int]
    budget_rows: NotRequired[int]  # resident rows the budget allows
    disk_rows_per_shard: NotRequired[list[int]]
    disk_bytes_per_shard: NotRequired[list[int]]
    resident_rows_per_shard: NotRequired[list[int]]
    disk_error: NotRequired[str | None]

class TableConfig(TypedDict):
    name: str
    dim: int
    dtype: str
    initializer: str
    init_low: float
    init_high: float
    init_mean: float
    init_std: float
    seed: int
    optimizer: str
    lr: float
    weight_decay: float
    eps: float
    beta1: float
    beta2: float
    initial_accumulator: float
    ftrl_alpha: float
    ftrl_beta: float
    ftrl_l1: float
    ftrl_l2: float
    weight_bound: float | None
    admission: str
    admission_probability: float
    admission_threshold: int
    admission_sketch_width: int
    admission_sketch_depth: int
    capacity: int | None
    ttl_seconds: int | None
    ttl_updates: int | None
    memory_budget_bytes: int | None
    disk: str | None

def apply_gradients(store: EmbeddingStore, steps: list[list[bytes]]) -> int:
    """A PS shard's steps of gradient messages (`trillium.wire.codec.encode_gradients` frames),
    each step's in rank order, applied in order: per table, one optimizer update with every
    message's rows of it (duplicate IDs summed in that order), fp16 widened by its scale; the
    rows updated. Every message is checked first (ValueError: none of the steps is applied),
    and each step whole before any of its tables is; a failed disk tier is an OSError. GIL
    released."""

def shard_of(ids: npt.NDArray[np.uint64], num_shards: int) -> npt.NDArray[np.uint32]:
    """Owning parameter-server shard of each id: `splitmix64_mix(id) % num_shards`.

    `splitmix64_mix(z)`: `z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9`;
    `z = (z ^ (z >> 27)) * 0x94D049BB133111EB`; `z ^ (z >> 31)` (mod 2**64).
    This is THE ownership function of the system; it never changes.
    Raises TypeError unless `ids` is a 1-D uint64 array; ValueError if
    `num_shards` is not in [1, 2**32).
    """

def hash_ids(namespace: str, values: Sequence[str | bytes]) -> npt.NDArray[np.uint64]:
    """Stable 64-bit ids of raw categorical values within a per-slot namespace.

    `id = xxh3_64(utf8(namespace) + b"\\x00" + utf8(value))` (seed 0); bytes
    values are hashed as given. Identical across processes, runs and machines.
    """

def kafka_partitions(keys: list[bytes], partitions: int) -> npt.NDArray[np.uint32]:
    """The partition Kafka's default partitioner gives each key: `(murmur2(key) & 0x7fffffff)
    % partitions`, murmur2 as Java's `Utils.murmur2` (aiokafka's and librdkafka's agree).
    Raises TypeError for a key that is not bytes; ValueError unless `partitions` is in [1, 2**31).
    """

def json_rows(
    template: list[bytes | int],
    columns: list[tuple[list[str | bytes | None], bool] | tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]],
) -> list[bytes]:
    """Row i's JSON text: the template's `bytes` literals, and at each `int` c column c's row i.
    A column `(cells, empty_is_null)` is text, each cell a JSON string (`"` and `\\` escaped,
    control characters as `\\n`-style or `\\u00XX` escapes, the rest as it is), null where None
    (or "" with `empty_is_null`); `(values, missing)` is numbers in their shortest round-trip form,
    null where `missing` (NaN and the infinities as `json.dumps` writes them). Raises TypeError
    for a cell, a template piece or a column of another kind; ValueError for columns of
    different lengths or a template naming a column that is not there.
    """

def hash_ints(namespace: str, values: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Like `hash_ids` over the canonical decimal text of each integer.

    `hash_ints(ns, np.array([42]))[0] == hash_ids(ns, ["42"])[0]`.
    Accepts int64 (also int32, uint64, uint32) 1-D arrays.
    """

def hash_cells(
    namespace: str, cells: Sequence[str | None], separator: str | None = None, max_len: int | None = None
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint64]]:
    """A column of text cells as a slot's IDs: `(lengths, ids)`, `lengths[i]` IDs for cell `i`,
    in order. A cell that is None or "" has none; otherwise it is one ID (`hash_ids` of the
    text), or with a `separator` each of its non-empty parts is, the first `max_len` of them.
    Raises ValueError for an empty separator, TypeError for a cell not str or None.
    """

def parse_floats(cells: Sequence[str | None]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """A column of text cells as numbers: `(values, odd)`, NaN where a cell is None or "". `odd`
    lists the other cells left NaN: those Rust's float grammar does not read, or reads as not
    finite (`inf`, `nan`): the caller reads them as it must (Python's `float` takes more: spaces,
    underscores, other scripts' digits).
    """

def row_cells(
    texts: list[str],
    separator: str,
    fields: int,
    slots: list[tuple[str, int, str | None, int | None]],
    dense: list[int],
) -> tuple[npt.NDArray[np.int32], list[npt.NDArray[np.uint64]], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Rows given as one text each, their `fields` cells joined by `separator` (a stream's
    events), read in one pass: `(lengths[len(slots), rows], ids per slot, values[rows, len(dense)],
    odd[n, 2])`. Each slot, (namespace, field, separator, max_len), reads its field as
    `hash_cells` reads a column; each dense field as `parse_floats` does, `odd` giving (row,
    dense column) of the cells it leaves to the caller. Raises ValueError for a row of another
    number of fields, a field out of range or an empty separator; TypeError for a text not str.
    """

class CaptureMark:
    """Where a capture stood (`StoreCapture.mark`): the version clock, and per table its
    counters and how many rows had left it. Small; it outlives the capture's release."""

class StoreCapture:
    """A point-in-time copy of an `EmbeddingStore`, from `EmbeddingStore.capture`.

    Holds its memory until `release` (or the object dies); usable as a context manager
    that releases on exit. Takes no lock of the store: any number of writes may run while
    the store trains.
    """

    def write(self, path: str | os.PathLike[str]) -> tuple[int, str]:
        """Write the capture to `path` in the snapshot format of `EmbeddingStore.dump`
        (readable by `EmbeddingStore.load`), atomically (temp file + fsync + rename +
        fsync of the directory), GIL released. Returns ``(bytes written, sha256 hex digest of
        the file)``, the digest computed over the bytes as they are written. The same capture
        always writes the same bytes. Raises ValueError once released, OSError on I/O errors.
        """
    def write_values(self, path: str | os.PathLike[str], dtype: Literal["fp16", "fp32"] = "fp16") -> tuple[int, str]:
        """Write a *values file* for serving (`ServingTables.apply`): every captured table's
        IDs and weights only (no optimizer state, versions or TTL stamps), rows sorted by ID,
        weights converted to `dtype` exactly as `EmbeddingStore.lookup(..., out_dtype=...)`
        converts them (so a served value equals a read-only lookup's, bit for bit), full or
        delta as the capture is (`delta`). Format: native/README.md ("Values file format");
        the trailer's CRC-32 lets a reader detect truncation and corruption on its own.
        Atomic like `write` (temp file + fsync + rename + fsync of the directory), GIL
        released. Returns ``(bytes written, sha256 hex digest of the file)``. Raises
        ValueError for another `dtype` or once released, OSError on I/O errors.
        """
    @property
    def delta(self) -> bool:
        """True when only the rows changed since the `since` mark were copied: load its file
        after the file of the capture that mark came from."""
    @property
    def mark(self) -> CaptureMark:
        """Where this capture stood, for a later `EmbeddingStore.capture(since=mark)`."""
    @property
    def rows(self) -> int:
        """Number of rows captured, over all tables. Raises ValueError once released."""
    @property
    def memory_bytes(self) -> int:
        """Bytes held by the copy; 0 once released."""
    def tables(self) -> list[str]:
        """Names of the captured tables, in creation order. Raises ValueError once released."""
    def release(self) -> None:
        """Free the copy now (a write in progress finishes first). Idempotent."""
    def __enter__(self) -> StoreCapture: ...
    def __exit__(self, *exc: object) -> bool: ...

def hash_strings(
    namespace: str, data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]:
    """`hash_ids` of every value of an Arrow-layout string column, without a Python
    object per value: value `i` is `data[offsets[i]:offsets[i + 1]]` (`len(offsets) - 1`
    values; `offsets` may start above 0, as in a sliced column). Pass an Arrow `StringArray`'s
    data and offsets buffers as numpy views. The GIL is released while hashing.
    Raises TypeError for other dtypes; ValueError if `offsets` is empty, decreases, or points
    past `data` (the first bad offset is named).
    """

def to_fp16_scaled(values: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float16], float]:
    """`values` times a power of two (the scale returned) that brings the largest magnitude near
    2^14, rounded to float16 (ties to even); scale 1.0 when a value is not finite. F16C, GIL
    released."""

def from_fp16_scaled(values: npt.NDArray[np.float16], scale: float) -> npt.NDArray[np.float32]:
    """`to_fp16_scaled`'s values back as float32 (divided by `scale`: exact for a power of two)."""

def forget_in_snapshot(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], ids: dict[str, npt.NDArray[np.uint64]]
) -> tuple[int, int, str]:
    """Rewrite the snapshot `src` (a `dump` or `StoreCapture.write` file, full or delta) to
    `dst` without the rows of `ids` (table name -> uint64 IDs; a table the file lacks is
    fine, tables not named are copied whole). Returns `(rows removed, bytes written, sha256
    hex of dst)`, as `StoreCapture.write` returns `(bytes, sha256)`.

    Everything else is kept exactly: header flags (a delta stays a delta) and creation
    time, the version clock, each table's configuration and counters, the admission sketch,
    every column of every kept row; forgetting nothing writes the source's bytes again.
    Streams one row block at a time. The source is verified as it is read (checksums,
    structure): a corrupt or truncated one raises ValueError, as `load` does, and nothing is
    written to `dst`. `dst` is written atomically (temp file, fsync, rename) and may be
    `src`. GIL released.

    Example: `forget_in_snapshot("ckpt/s0.snap", "ckpt/s0.snap", {"user": np.array([42],
    dtype=np.uint64)})` -> `(1, n_bytes, sha256_hex)` when the file held user 42.
    """

def forget_in_values(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], ids: dict[str, npt.NDArray[np.uint64]]
) -> tuple[int, int, str]:
    """Rewrite the values file `src` (`StoreCapture.write_values`) to `dst` without the rows
    of `ids` (table name -> uint64 IDs), keeping its dtype, delta flag, store version and
    table order, the kept values byte for byte. Returns `(rows removed, bytes written,
    sha256 hex of dst)`. The source gets `ServingTables.apply`'s checks as it streams (sizes,
    CRC-32, IDs ascending): a bad one raises ValueError naming it (OSError for I/O errors) and
    nothing is written. `dst` is written atomically and may be `src`. A replica that applied
    a file keeps a forgotten row until it applies a full file without it. GIL released.
    """

class ShardServer:
    """A PS shard's `EmbeddingParameterServer` (proto/embedding.proto: `Lookups`, `Stats`)
    served natively: tonic on a thread of its own, the stack's token checked on every call
    (UNAUTHENTICATED without it), TLS when `tls_cert` and `tls_key` (PEM) are given, a request
    that does not parse INVALID_ARGUMENT. A stream's lookups are answered in order, its first
    error ending it; the rows are read from the store `serve` was given into the answer's
    frame, without Python. Binding `host:port` fails at once (OSError) if it cannot."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        name: str,
        shard: int,
        on_failure: Callable[[str], object],
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_message_bytes: int,
        keepalive_s: float,
        keepalive_timeout_s: float,
    ) -> None: ...
    @property
    def port(self) -> int:
        """The port it listens on."""
    def serve(self, store: EmbeddingStore, *, job_id: str, attempt: int) -> None:
        """Serve `store`'s tables to the lookups of attempt `attempt` of job `job_id` from now on:
        an earlier attempt's are FAILED_PRECONDITION, a later one's or another job's UNAVAILABLE."""
    def clear(self) -> None:
        """Serve no tables from now on: lookups are UNAVAILABLE."""
    def lookup_metrics(self) -> tuple[int, float, list[int]]:
        """(lookups answered, their seconds in all, each latency bucket's count, +Inf last)."""
    @staticmethod
    def buckets() -> list[float]:
        """The latency buckets' upper bounds in seconds (prometheus_client's default)."""
    def ended(self) -> bool:
        """Whether the server's thread has ended."""
    def stop(self) -> None:
        """Stop serving and wait for the server's thread; idempotent. GIL released."""

class WorkerServer:
    """An embedding worker's `EmbeddingWorker` (proto/embedding.proto: `LookupBatches`,
    `PushGradients`) served natively, as `ShardServer` is (token, TLS, limits, a stream's first
    error ending it): a lookup waits for the staleness gate, is planned, masked, asked of every
    owning PS shard at once (one bidi stream each, with `ps_token`, over TLS with `ps_tls_ca`)
    and pooled into the answer's frames; a push is scattered and held until every rank served
    has pushed its step, whose gradient frames (one per PS shard, `codec.encode_gradients`'
    format) go to `on_step(attempt, step, epoch, publish, key_rank, frames)`, called from the
    server's thread in step order; the step's pushes are answered once `step_sent` (or failed
    with `step_failed`'s error) says so. Without Python on the path."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        name: str,
        on_step: Callable[[int, int, int, bool, int, list[bytes]], object],
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_message_bytes: int,
        keepalive_s: float,
        keepalive_timeout_s: float,
    ) -> None: ...
    @property
    def port(self) -> int:
        """The port it listens on."""
    def start_job(
        self,
        *,
        job_id: str,
        attempt: int,
        nn_ranks: int,
        ranks: list[int],
        layout: PoolingLayout,
        shards: list[str],
        served_fp16: bool,
        gradients_fp16: bool,
        forgotten: list[tuple[int, dict[str, list[int]]]],
        ps_token: str,
        ps_tls_ca: bytes | None = None,
        max_message_bytes: int,
        keepalive_s: float,
        keepalive_timeout_s: float,
    ) -> None:
        """Serve a job from now on (the one before ends, its waiting calls failing): `ranks` the
        NN ranks served, `shards` the PS shards' addresses in shard order, `forgotten` the
        forget masks as (through_batch, {table: IDs})."""
    def end_job(self) -> None:
        """Serve no job: lookups are UNAVAILABLE, every call waiting fails."""
    def set_watermark(self, attempt: int, steps: int, bound: int | None, loaded: bool) -> None:
        """The steps applied on every PS shard, the live bound (None: none), whether both are known."""
    def step_sent(self, attempt: int, step: int, messages: int) -> None:
        """The step's messages are durable: its pushes are answered."""
    def step_failed(self, attempt: int, step: int, error: str) -> None:
        """The step's messages could not be sent: its pushes fail (UNAVAILABLE) with `error`."""
    def pending(self) -> tuple[int, int]:
        """(plans held for gradients not pushed yet, plans dropped because none came)."""
    def metrics(self) -> dict[str, tuple[int, float, list[int]]]:
        """{"lookup" | "staleness_wait" | "push": (count, seconds, each of `ShardServer.buckets()`' counts, +Inf last)}."""
    def ended(self) -> bool:
        """Whether the server's thread has ended."""
    def stop(self) -> None:
        """End the job, stop serving and wait for the server's thread; idempotent. GIL released."""

class EmbeddingStore:
    """A set of named embedding tables (u64 id -> row of `dim` floats).

    Args:
        num_internal_shards: lock shards per table (default `max(16, 4*threads)`
            rounded up to a power of two). Tables with a capacity use at most
            `capacity // 1024` (>= 1) shards. A `threads=1` store runs every call
            inline on the calling thread.
        threads: size of the store's private thread pool (default: the
            `RAYON_NUM_THREADS` environment variable, else all cores).
    """

    def __init__(self, num_internal_shards: int | None = None, threads: int | None = None) -> None: ...
    @property
    def version(self) -> int:
        """Current store version: every update batch with a version <= this has completed."""
    @property
    def threads(self) -> int:
        """Size of the store's thread pool."""
    @property
    def num_internal_shards(self) -> int:
        """Default number of internal shards per table."""
    def create_table(
        self,
        name: str,
        dim: int,
        *,
        dtype: DType = "fp32",
        initializer: Initializer = "uniform",
        init_low: float = -0.01,
        init_high: float = 0.01,
        init_mean: float = 0.0,
        init_std: float = 0.01,
        seed: int = 0,
        optimizer: Optimizer = "sgd",
        lr: float = 0.01,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        beta1: float = 0.9,
        beta2: float = 0.999,
        initial_accumulator: float = 0.0,
        ftrl_alpha: float = 0.05,
        ftrl_beta: float = 1.0,
        ftrl_l1: float = 0.0,
        ftrl_l2: float = 0.0,
        weight_bound: float | None = None,
        admission: Admission = "off",
        admission_probability: float = 1.0,
        admission_threshold: int = 0,
        admission_sketch_width: int = 1048576,
        admission_sketch_depth: int = 4,
        capacity: int | None = None,
        ttl_seconds: int | None = None,
        ttl_updates: int | None = None,
        memory_budget_bytes: int | None = None,
        disk: str | os.PathLike[str] | None = None,
    ) -> None:
        """Create a table. Rows are created lazily by `lookup`.

        * `dtype`: weight storage precision (arithmetic is always fp32).
        * `initializer`: `uniform(init_low, init_high)` or
          `normal(init_mean, init_std)`, deterministic per `(seed, id)`.
        * `optimizer`: `sgd` (lr, weight_decay), `adagrad` (element-wise),
          `rowwise_adagrad` (one accumulator per row += mean(g**2)), `adam`
          (per-row step counts), `ftrl` (FTRL-Proximal: ftrl_alpha/beta/l1/l2).
          `weight_decay` is L2 added to the gradient (not supported with ftrl).
          `initial_accumulator` seeds Adagrad accumulators and FTRL `n`.
        * `weight_bound`: clip every weight to [-b, b] after each update.
        * `admission`: `off`; `probability` (an id is admitted iff a
          deterministic hash draw of `(seed, id)` is < admission_probability);
          `threshold` (admitted once a count-min sketch has seen it
          `admission_threshold` times in `create=True` lookups).
        * `capacity`: max rows; approximate LRU eviction by last lookup (exact
          when an internal shard holds <= 64 rows, else oldest of 16 samples). `ttl_seconds` / `ttl_updates`: rows not
          updated for that long expire lazily on lookup or via `expire`.
        * `memory_budget_bytes` and `disk` (both or neither): a disk tier. At most the
          budget's rows stay in RAM (divided over the internal shards); the least recently
          looked-up rows beyond it are spilled, with their optimizer state, to a spill file
          per internal shard in the directory `disk` (unlinked once open, so that no crash leaves
          one behind; `stats` gives its size), and read
          back by the calls that need them. Answers, snapshots, eviction and TTL are those
          of the same table all in RAM. The files are mapped (a row read or written is a
          copy, no syscall) and grow an eighth at a time, their blocks allocated first: a full
          disk raises OSError naming the table and the file, from then on for every call on
          the table (the rows it could not spill stay in RAM). A capture pins the records it
          holds in the files until it is released, and reads them when it is written.

        Raises ValueError for a duplicate name, `dim < 1`, unknown enum strings
        or out-of-range hyper-parameters.
        """
    def drop_table(self, name: str) -> None:
        """Remove a table. Raises KeyError if unknown."""
    def tables(self) -> list[str]:
        """Table names in creation order."""
    def __contains__(self, name: str) -> bool: ...
    def __len__(self) -> int:
        """Total number of rows over all tables."""
    def num_rows(self, table: str) -> int:
        """Number of rows of `table`."""
    def memory_bytes(self, table: str | None = None) -> int:
        """Bytes allocated (capacities of the actual allocations) by one table or all."""
    def lookup(
        self,
        table: str,
        ids: npt.NDArray[np.uint64],
        *,
        create: bool = True,
        out_dtype: Literal["float32", "float16"] = "float32",
    ) -> npt.NDArray[np.float32] | npt.NDArray[np.float16]:
        """Rows of `ids` as a new `(len(ids), dim)` array.

        With `create=True` missing ids are admitted per the table's policy and
        initialized; non-admitted (or, with `create=False`, missing) ids read as
        zeros and are not inserted. All occurrences of an id in one call get the
        same answer. Raises KeyError (unknown table), TypeError (ids not uint64),
        ValueError (ids not 1-D, bad out_dtype).
        """
    def update(self, table: str, ids: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32]) -> int:
        """Apply the table's optimizer in place; returns the number of rows updated.

        `grads` must be float32 of shape `(len(ids), dim)`. Gradients of
        duplicate ids are summed first. Ids without a row (never admitted,
        evicted) are dropped without affecting other rows (`dropped_grads`).
        Rows whose summed gradient has NaN/inf are skipped (`nan_grads_skipped`).
        Each call is one update batch: it takes the next store version.
        """
    def get_row(self, table: str, id: int) -> npt.NDArray[np.float32] | None:
        """Weights of one row as float32, or None if absent (no side effects)."""
    def get_row_state(self, table: str, id: int) -> dict[str, object] | None:
        """Weights plus optimizer state (`accumulator` / `m`, `v`, `step` /
        `z`, `n`), `version` and TTL stamps of one row, or None."""
    def set_row(self, table: str, id: int, values: npt.ArrayLike) -> None:
        """Overwrite (or create, bypassing admission) the weights of one row.

        A new row gets fresh optimizer state; an existing row keeps it (FTRL's
        `z` is recomputed so the weights are reproduced). Takes a new version.
        """
    def capture(self, since: CaptureMark | None = None) -> StoreCapture:
        """A point-in-time copy of the whole store, to write later (a checkpoint at a step cut:
        stop applying updates, capture, resume at once, `write` in the background).

        With `since` (an earlier capture's mark) a **delta**: only the rows created or
        updated since that capture, and the event counters' increments (`update_batches`
        whole); loading the earlier file and then the delta's gives this store. When a row may
        have left the store since the mark (an eviction, a TTL expiry) or the tables differ,
        a row would come back from the older file: the capture is then full (`delta` False).
        A row is never missed; one created by a lookup since the last update may be in both.

        Copies every table's config, counters, admission sketch and live rows (weights,
        optimizer state, versions, TTL stamps) and the version clock; internal shards are
        copied whole (a memcpy per column) in parallel on the store's pool, GIL released.
        Costs about the rows' memory again (`StoreCapture.memory_bytes`) until released.

        Consistent (one instant for the whole store) when no `update`/`set_row` runs
        meanwhile; lookups may run, and rows they create in a shard before it is copied
        are included.

        **Locking behaviour:** each internal shard's *read* lock in turn, for as long as
        copying that shard takes (a few ms); lookups of existing rows proceed, while a lookup
        that creates rows in that shard, or an update to it, waits for its copy.
        """
    def dump(self, path: str | os.PathLike[str]) -> tuple[int, str]:
        """Write all tables (config, rows, optimizer state, counters, sketch) to `path`
        atomically (temp file + fsync + rename + fsync of the directory), streaming from the
        live store without a copy. Returns `(bytes written, sha256 hex digest of the file)`,
        the digest computed over the bytes as they are written.

        **Locking behaviour:** each internal shard's *read* lock in turn, held while that
        shard's rows are written (as long as the file system takes): lookups that create rows
        in that shard, and updates to it, wait meanwhile. So each internal shard is captured
        at one instant; different shards may reflect different moments of concurrent updates
        (use `capture` for one instant without holding locks during the write).
        """
    def load(self, path: str | os.PathLike[str], shard_index: int | None = None, num_shards: int | None = None) -> None:
        """Merge a snapshot into this store (tables are created as needed).

        With `shard_index`/`num_shards` only rows with
        `shard_of(id, num_shards) == shard_index` are kept: a checkpoint of S PS shards is
        loaded into T by each new shard `t` loading every old file with `(t, T)`. Rows
        overwrite rows with the same id; the store version advances to the file's if
        larger; event counters add this shard's share (the T shares of a file's counter add
        up to it exactly); `update_batches` becomes the largest seen and every row keeps
        its age in update batches; admission sketches merge by element-wise max. A delta
        (`StoreCapture.delta`) loads on top of its base the same way, but the rows already
        here keep their update-batch stamps (the delta continues the base's count).
        The file is fully verified before anything is applied: a corrupted, truncated or
        unsupported file raises ValueError and leaves the store unchanged.

        **Locking behaviour:** verifying takes no shard lock; applying takes the write lock of
        each internal shard receiving rows, per block of rows (and, when a table's
        `update_batches` moves up, each shard's write lock in turn to shift its stamps).
        """
    def export_delta(
        self, table: str, since_version: int
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32], int]:
        """Rows changed after `since_version`: `(ids, rows, current_version)`.

        Call again with `since_version=current_version` to get the next delta;
        no change is ever missed (a row may be returned twice). Rows created by
        a lookup count as changed at the next update version.
        """
    def expire(self, table: str | None = None, *, now: float | None = None) -> int:
        """Remove rows past their TTL (one table or all); returns how many.
        `now` overrides the current UNIX time (seconds)."""
    def forget(self, table: str, ids: npt.NDArray[np.uint64]) -> int:
        """Remove the rows of `ids` from `table` wherever they are, in RAM or in the disk
        tier's spill file (a right to be forgotten, GDPR Art. 17); returns how many rows were
        removed (IDs the table lacks, and repeats, are skipped). A forgotten ID looked up
        again with `create=True` is a new row: its initial value, fresh optimizer state.

        The next `capture(since=mark)` is then a full one (`delta` False): a delta cannot say
        that a row is gone. The persisted counters do not move; `stats(table)["forgotten"]`
        counts the rows removed (not saved in snapshots). The admission sketch keeps its
        counts (hashed and shared by many IDs). GIL released, runs on the store's pool.

        Example: `s.forget("user", np.array([42, 7], dtype=np.uint64))` -> 2 if both had rows.

        **Locking behaviour:** one task per internal shard with IDs in `ids`, each under that
        shard's *write* lock. Raises KeyError (unknown table), TypeError (ids not uint64),
        ValueError (not 1-D).
        """
    def stats(self, table: str) -> TableStats:
        """Row count, memory and counters of a table."""
    def table_config(self, table: str) -> TableConfig:
        """The table's configuration as given to `create_table`."""

PoolingKind = Literal["sum", "mean", "none"]

class PoolingLayout:
    """The embedding worker's feature slots over its tables and PS shards, built once per job
    (`services/embedding_worker/pooling.py` wraps it).

    Args:
        slots: `(name, table, pooling, max_len)` per slot, in the model's order; pooling
            `"sum"` / `"mean"` (pooled slots) or `"none"` (a sequence padded to
            `max_len`, which it then needs).
        dims: the dim of each table (by name).
        num_shards: PS shards, for `shard_of`.

    Raises ValueError (a slot given twice, an unknown pooling, `max_len` missing,
    `num_shards` out of [1, 2**32)), KeyError (a slot's table not in `dims`).
    """

    def __init__(
        self, slots: Sequence[tuple[str, str, PoolingKind, int | None]], dims: dict[str, int], num_shards: int
    ) -> None: ...
    @property
    def width(self) -> int:
        """P: columns of the pooled output, the pooled slots' dims added up."""
    @property
    def columns(self) -> list[tuple[int, int] | None]:
        """Per slot: its `(start, stop)` columns in the pooled output, or None (a sequence slot)."""
    @property
    def tables(self) -> list[str]:
        """The tables the slots read, in order of first use: the order of
        `PoolingPlan.ids` and of the rows given to `PoolingPlan.pool`."""
    def plan(self, keys: Sequence[str], values: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int32]) -> PoolingPlan:
        """Plan a batch from its `KeyedIds` arrays: `values` key-major, `lengths[k * B + i]`
        IDs of sample `i` under `keys[k]` (keys in any order; keys no slot reads are
        ignored). Dedups each table's IDs (slots sharing a table share rows) and groups the
        unique IDs by owning shard (`shard_of`; within a shard, in order of first
        appearance). GIL released. Raises KeyError (a slot missing from `keys`),
        TypeError (dtypes), ValueError (lengths inconsistent with values, or a sequence
        slot's sample holding more than `max_len` IDs).
        """

class PoolingPlan:
    """One batch's plan (from `PoolingLayout.plan`); read-only, so `pool` and
    `scatter` may run on several threads. Sums run in ID-occurrence order from zero in
    float32 (as `torch.index_add_` did); a mean divides by the sample's ID count (an empty
    sample pools to zeros)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def ids(self) -> list[npt.NDArray[np.uint64]]:
        """Per table (`PoolingLayout.tables` order): its unique IDs, grouped by owning shard."""
    @property
    def shard_offsets(self) -> list[npt.NDArray[np.int64]]:
        """Per table: `int64[num_shards + 1]`; shard `s` owns `ids[t][o[s]:o[s + 1]]`, and the
        same rows of the looked-up rows and of the gradients: one contiguous range per shard."""
    def pool(
        self, rows: Sequence[npt.NDArray[np.float32]], *, out_dtype: Literal["float32", "float16"] = "float32"
    ) -> tuple[npt.NDArray[np.float32], list[tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]]]:
        """Pool the looked-up rows (per table, float32 `[len(ids[t]), dim]` in plan order) into
        `(pooled [B, width], [(values [B, max_len, dim], mask [B, max_len]) per sequence slot])`:
        pooled slots side by side in slot order, sequences zero-padded with a bool mask.
        float16 output rounds the float32 results to nearest even. GIL released. Raises
        ValueError (shapes, out_dtype), TypeError (dtypes).
        """
    def scatter(
        self, pooled_grad: npt.NDArray[np.float32], sequence_grads: Sequence[npt.NDArray[np.float32]]
    ) -> list[npt.NDArray[np.float32]]:
        """The gradient of `pool`'s output (`pooled_grad` float32 `[B, width]`, one float32
        `[B, max_len, dim]` per sequence slot) -> per table, float32 `[len(ids[t]), dim]` in
        plan order: each unique ID's gradient summed over its occurrences (a mean slot's
        gradient divided by the sample's ID count first); positions past a sample's IDs are
        ignored. GIL released. Raises ValueError (shapes), TypeError (dtypes).
        """

class ServingTableStats(TypedDict):
    rows: int
    overlay_rows: int
    memory_bytes: int
    lookups: int
    misses: int

class ApplyReport(TypedDict):
    version: int
    files: int
    bytes: int
    rows: int
    parts_replaced: int
    parts_merged: int
    rows_updated: int
    rows_inserted: int
    read_s: float
    build_s: float
    lock_wait_s: float
    lock_hold_s: float
    total_s: float

class ServingTables:
    """A model replica's embedding tables: values only (no optimizer state), fp16 by
    default, applied version by version from the values files training publishes
    (`StoreCapture.write_values`) while lookups go on.

    Each table is kept as one part per training PS shard (`shards`): a file written by
    shard `i` holds only IDs with `shard_of(id, shards) == i`. A **full** file replaces
    every row shard `i` owns in each table it lists; a **delta** file upserts its rows.
    A serving shard keeps a `slice` of the rows, `(index, count)`: those with
    `shard_of(id, count) == index`, the others dropped as the files are read (any count,
    whatever `shards` is). Memory: about 2.1 bytes per value at dim 64 in fp16, index included (see
    native/README.md, "Serving store"). Safe to share between threads: any number of
    lookups at once, one apply at a time (others wait).
    """

    def __init__(
        self,
        tables: dict[str, int],
        shards: int,
        dtype: Literal["fp16", "fp32"] = "fp16",
        threads: int | None = None,
        *,
        slice: tuple[int, int] = (0, 1),
    ) -> None:
        """`tables`: name -> dim. `shards`: the training job's PS shard count. `dtype`: the
        values as stored, which every applied file must hold. `threads`: the pool applies use
        to read files and build indexes (default `RAYON_NUM_THREADS`, else all cores; 1 runs
        them on the calling thread). `slice`: the rows kept (default all). Raises ValueError
        (dim < 1, shards < 1, a dtype other than fp16/fp32, a slice's index not below its
        count), TypeError."""
    def apply(self, parts: Sequence[tuple[int, str | os.PathLike[str]]], version: int) -> ApplyReport:
        """Apply `[(training shard, values-file path)]` as `version` (greater than the current
        one), all at once: a concurrent `lookup` sees every table before or after, never in
        between. Every file is read and checked first (format and CRC, dtype, every table
        served with the same dim, IDs sorted and owned by the file's shard); a failure raises
        ValueError naming the file and the problem (OSError for I/O errors) and changes
        nothing: the previous version goes on serving. Files of one shard apply in list order
        (a full one replaces what came before it). The write lock is held only to swap new
        structures in and copy updated rows (`lock_hold_s` in the returned report; a
        100k-row delta ~1.5 ms). GIL released."""
    def lookup(
        self, requests: Sequence[tuple[str, npt.NDArray[np.uint64]]]
    ) -> tuple[list[npt.NDArray[np.float32]], int, list[int]]:
        """`[(table, uint64 ids)]` -> `(float32 [len(ids), dim] per request, the version they
        were read at, misses per request)`. Every request of the call is read under one read
        lock, at one version. An ID not present reads as zeros (as an ID never admitted in
        training does) and counts as a miss. Runs on the calling thread, keeping the GIL
        (the work is microseconds) unless the call has 16384 IDs or more. Raises KeyError
        (unknown table), TypeError (ids not a uint64 array), ValueError (not 1-D)."""
    @property
    def version(self) -> int:
        """The last applied version (0 before any)."""
    @property
    def shards(self) -> int: ...
    @property
    def slice(self) -> tuple[int, int]:
        """`(index, count)`: the rows kept are those with `shard_of(id, count) == index`."""
    @property
    def dtype(self) -> str: ...
    @property
    def threads(self) -> int: ...
    @property
    def tables(self) -> dict[str, int]:
        """Table name -> dim, in the order given."""
    def stats(self) -> dict[str, ServingTableStats]:
        """Per table: `rows`, `overlay_rows` (rows new since their part's base was built),
        `memory_bytes` (capacities of the actual allocations), and the lifetime counters
        `lookups` (IDs looked up) and `misses`."""
    def memory_bytes(self) -> int:
        """Bytes allocated by every table, index included (capacities of the allocations)."""

class EventDecoder:
    """The stream loader's JSON fast path (trillium/data/sources/events.py). `fields`: (dotted
    path, kind) with kind "slot", "dense" or "label"; each accepted message gives every field as
    the text Python's `scalar_text` makes of it. A message it is not sure of (malformed, or read
    differently by `json.loads`) is left to the Python reference decoder. `event_type`: a
    subclass of tuple made in Python (a named tuple), of (values, key, time)."""

    def __init__(
        self,
        fields: list[tuple[str, str]],
        event_time: str,
        event_key: str | None,
        max_message_bytes: int,
        max_value_bytes: int,
        event_type: type[tuple[str, str | None, float]],
    ) -> None: ...
    def decode(self, messages: list[bytes | None], with_fields: bool) -> tuple[list[Any], list[int]]:
        """(events, undecided): per message an `event_type` of (values, key, event time), or None
        where it is left to the reference (`undecided`: their indices). The values are one text:
        each field's, in the order of `fields`, joined by "\\x1e" (a missing value is empty);
        without `with_fields`, empty. Raises TypeError (an item not bytes/None)."""

class EventJoin:
    """The stream loader's joiner core (trillium/data/sources/joiner.py subclasses it as
    `PartitionJoin`): a partition's impressions and labels joined by key in event time. Events
    are (values, key, time) tuples, kept as they are; counts are in the order of joiner.py's
    COUNTS."""

    def __new__(cls, window_seconds: float, correct_late_labels: bool, max_open: int) -> Self: ...
    def impression(self, event: tuple[str, str | None, float]) -> None:
        """An impression (ValueError: it has no key)."""
    def label(self, key: str, time: float) -> None: ...
    def take(
        self,
        decoder: EventDecoder,
        messages: list[bytes | None],
        start: int,
        impressions: bool,
        earliest: float,
        newest: float,
    ) -> tuple[int, float]:
        """(stop, latest): the messages from `start` on decoded as `decoder.decode` does and
        joined, as impressions or as labels, in order, up to the first one left to the caller:
        one the decoder leaves to the reference, one without a key, or one whose event time is
        outside [earliest, newest]. `stop` is its index (len(messages): none); `latest` the
        newest event time joined (-inf: none)."""
    def advance(self, watermark: float) -> tuple[list[Any], list[bool], list[float], list[str]]:
        """(events, positive, times, kinds) of the samples decided at or before the watermark, in
        the order of their decisions."""
    def count_values(self) -> list[int]: ...
    @property
    def open_count(self) -> int: ...
    def parts(
        self,
    ) -> tuple[
        list[Any],
        list[tuple[str, float]],
        list[tuple[str, tuple[Any | None, bool, float]]],
        tuple[list[Any], list[bool], list[float], list[str]],
    ]:
        """The state but its counts: open events (in the order their windows end), held labels
        (key, time), recently closed impressions (key, (event kept to correct it, positive,
        window end)), oldest first, and the decided samples as `advance` gives them."""
    def restore_open(self, event: tuple[str, str | None, float]) -> None: ...
    def restore_held(self, key: str, time: float) -> None: ...
    def restore_closed(self, key: str, event: Any | None, positive: bool, end: float) -> None: ...
    def restore_decided(self, event: Any, positive: bool, time: float, kind: str) -> None: ...
    def restore_counts(self, values: list[int]) -> None: ...

class TaskJoin:
    """A multi-task job's joiner core (trillium/data/sources/task_joiner.py subclasses it as
    `PartitionTaskJoin`): a partition's impressions and the labels of several tasks, a window
    each, joined by key in event time. Labels are "1", "0" or "" (none), a text per task; counts
    are in the orders of task_joiner.py's COUNTS and TASK_COUNTS."""

    def __new__(cls, windows: list[float], correct_late_labels: bool, max_open: int) -> Self: ...
    def impression(self, event: tuple[str, str | None, float]) -> None:
        """An impression (ValueError: it has no key)."""
    def label(self, task: int, key: str, time: float) -> None: ...
    def take(
        self,
        decoder: EventDecoder,
        messages: list[bytes | None],
        start: int,
        task: int | None,
        earliest: float,
        newest: float,
    ) -> tuple[int, float]:
        """As `EventJoin.take`: the messages as impressions (`task` None) or labels of `task`."""
    def advance(self, watermark: float) -> tuple[list[Any], list[tuple[str, ...]], list[float], list[bool]]:
        """(events, labels, times, corrections) of the samples decided at or before the
        watermark, in the order of their decisions."""
    def count_values(self) -> list[int]: ...
    def task_count_values(self) -> list[list[int]]: ...
    @property
    def tracked_count(self) -> int: ...
    def parts(
        self,
    ) -> tuple[
        list[tuple[Any, list[float], bool]],
        list[list[tuple[str, float]]],
        tuple[list[Any], list[tuple[str, ...]], list[float], list[bool]],
    ]:
        """The state but its counts: the tracked impressions (event, each task's label time or
        NaN, emitted) in the order their horizons end, each task's held labels (key, time), and
        the decided samples as `advance` gives them."""
    def restore_tracked(self, event: tuple[str, str | None, float], labels: list[float], emitted: bool) -> None: ...
    def restore_held(self, task: int, key: str, time: float) -> None: ...
    def restore_decided(self, event: Any, labels: list[str], time: float, correction: bool) -> None: ...
    def restore_counts(self, values: list[int], task_values: list[list[int]]) -> None: ...
