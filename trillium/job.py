"""The job configuration schema: one YAML file (or the same document as JSON to the REST API).

Every model forbids unknown keys, so a misspelt key fails naming the field; enumerations are
`Literal`s, so a bad value fails listing the allowed ones; cross-field checks (tables exist,
columns exist in the source's schema, ...) name the slot or field at fault. Relative data paths
are resolved against the YAML file's directory by `load_job`, which also checks the columns the
job names against the headers (or Parquet schemas) of its files when they can be read there.

This module is configuration: it imports pydantic, yaml and the presets' column lists
(`trillium.sources.presets`, constants); only `load_job` reaches for the readers, to check the
files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trillium.sources.presets import PRESET_COLUMNS

__all__ = [
    "AdmissionConfig",
    "CheckpointConfig",
    "ColumnSplit",
    "CsvData",
    "DataConfig",
    "DenseColumn",
    "DenseOptimizerConfig",
    "EmbeddingOptimizerConfig",
    "FeatureSlot",
    "InitFrom",
    "JoinConfig",
    "KafkaData",
    "FractionSplit",
    "JobConfig",
    "LabelConfig",
    "ModelSpec",
    "ParquetData",
    "SplitPolicy",
    "TableConfig",
    "TopologyConfig",
    "TrainingConfig",
    "load_job",
]

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0, lt=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- data ------------------------------------------------------------------------------------


class FractionSplit(_Strict):
    """The test split is a stable pseudo-random `test_fraction` of the rows, drawn per row from
    `seed` and the row's place in its file (see `trillium.sources.split`); the rest is train."""

    by: Literal["fraction"]
    test_fraction: Annotated[float, Field(gt=0, lt=1)]
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0


class ColumnSplit(_Strict):
    """A cut on a column, e.g. time: rows whose `by` column is >= `test_from` are the test
    split, the others train. A number compares numerically (the column must hold numbers), a
    string as text (ISO dates sort as text)."""

    by: Annotated[str, Field(min_length=1)]  # the column's name
    test_from: int | float | str


def _split_kind(value: Any) -> str:
    by = value.get("by") if isinstance(value, dict) else getattr(value, "by", None)
    return "fraction" if by == "fraction" else "column"


# `by` is "fraction" or the name of the column to cut on (the issue's `{by: hour, ...}`).
SplitPolicy = Annotated[
    Annotated[FractionSplit, Tag("fraction")] | Annotated[ColumnSplit, Tag("column")],
    Discriminator(_split_kind),
]
# One file, or several; a path may be a glob (`data/day_*.csv.gz`), expanded in sorted order.
Paths = Path | Annotated[list[Path], Field(min_length=1)]


class _FileData(_Strict):
    """Files per split: `test` files, or a `split` policy cutting the `train` files in two,
    or neither (no test split)."""

    source: str  # each kind narrows it to its Literal
    train: Paths
    test: Paths | None = None
    split: SplitPolicy | None = None

    @field_validator("train", "test")
    @classmethod
    def _resolve(cls, paths: Path | list[Path] | None, info: ValidationInfo) -> Path | list[Path] | None:
        base = (info.context or {}).get("base_dir")
        if paths is None or base is None:
            return paths
        if isinstance(paths, list):
            return [p if p.is_absolute() else Path(base) / p for p in paths]
        return paths if paths.is_absolute() else Path(base) / paths

    @model_validator(mode="after")
    def _one_test_split(self) -> _FileData:
        if self.test is not None and self.split is not None:
            raise ValueError("data: give test files or a split policy, not both")
        return self

    def schema_columns(self) -> tuple[str, ...] | None:
        """The columns a job may name when the job file alone tells (None: the files' headers
        do, and `load_job` checks them there)."""
        return PRESET_COLUMNS.get(self.source)


class AdultData(_FileData):
    """UCI Adult CSV (`adult.data` / `adult.test`), a preset of the CSV reader."""

    source: Literal["adult"]


class CriteoData(_FileData):
    """Criteo-format TSV: label, I1..I13, C1..C26, tab-separated; a preset of the CSV reader."""

    source: Literal["criteo"]


class CsvData(_FileData):
    """Delimited text (CSV, TSV, ...), each file plain or compressed (`.gz`, `.zst`: by its
    extension). Every cell is read as text; an empty cell is a missing value."""

    source: Literal["csv"]
    delimiter: Annotated[str, Field(min_length=1, max_length=1)] = ","
    quote: Annotated[str, Field(min_length=1, max_length=1)] | None = '"'  # None: no quoting
    header: bool = True  # the first line of every file names its columns
    # The column names in file order: needed without a header; with one, they replace its names.
    columns: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    # Quoted values may contain line breaks (a quote then only opens or closes a quoted cell, as
    # RFC 4180 writes them). Such files are read whole by one loader: a byte range cannot tell a
    # line break inside quotes from a row's end.
    quoted_newlines: bool = False

    @model_validator(mode="after")
    def _dialect(self) -> CsvData:
        if not self.header and self.columns is None:
            raise ValueError("data: without a header line (header: false), list the columns")
        if self.delimiter in "\r\n" or self.delimiter == self.quote:
            raise ValueError(f"data.delimiter {self.delimiter!r} cannot be a line break or the quote")
        if self.quote is not None and self.quote in "\r\n":
            raise ValueError(f"data.quote {self.quote!r} cannot be a line break")
        if self.quoted_newlines and self.quote is None:
            raise ValueError("data.quoted_newlines needs a quote character")
        if self.columns is not None and len(set(self.columns)) != len(self.columns):
            raise ValueError(f"data.columns: names must be unique, got {self.columns}")
        return self

    def schema_columns(self) -> tuple[str, ...] | None:
        return tuple(self.columns) if self.columns is not None else None


class ParquetData(_FileData):
    """Parquet files; categorical columns of any type are read as text (an integer ID as its
    decimal digits, as in a CSV file)."""

    source: Literal["parquet"]


class SyntheticData(_Strict):
    """Criteo-format rows drawn in process from a planted logistic model (trillium.datagen)."""

    source: Literal["synthetic"]
    rows: PositiveInt
    test_rows: Annotated[int, Field(ge=0)] = 0
    seed: int = 0
    vocab_sizes: Annotated[list[PositiveInt], Field(min_length=26, max_length=26)] | None = None

    def schema_columns(self) -> tuple[str, ...]:
        return PRESET_COLUMNS["synthetic"]


FieldPath = Annotated[str, Field(min_length=1, pattern=r"^[^.]+(\.[^.]+)*$")]  # dotted: "user.id"
TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]


class JoinConfig(_Strict):
    """Impressions joined with their labels (clicks) by key, in event time.

    An impression waits up to `window_seconds` (event time) for a label with its key: a label
    inside the window makes it a positive sample; the window closing (the watermark, the least
    event time over the loader's input partitions less `allowed_lateness_seconds`, passing its
    end) makes it a negative. Samples leave in event-time order of these decisions, each once the
    watermark passes it. A label later than that is counted as late and, with
    `late_labels: correct`, sent as a positive correction sample. Open impressions per input
    partition are capped: over the cap the oldest close early (counted). The two topics must be
    co-partitioned by the key (same partition count, keyed producers), as Kafka Streams requires.
    """

    impressions: TopicName
    labels: TopicName
    key: FieldPath
    window_seconds: PositiveFloat
    allowed_lateness_seconds: NonNegativeFloat = 0.0
    late_labels: Literal["count", "correct"] = "count"
    max_open_per_partition: PositiveInt = 1_000_000


class KafkaData(_Strict):
    """Events from Kafka, trained continuously (`training.epochs: null`). An event is a JSON
    object or a msgpack map per message; the slots, dense columns and the label name its fields by
    dotted path (`user.recent_items`); a list value is a multi-valued slot. Events either carry
    their label (`topics`) or are impressions joined with label events (`join`; the joiner
    sets the label field to "1" or "0"). A message that cannot be a sample goes to the dead-letter
    topic `trillium.<job>.dlq` with the reason and where it came from."""

    source: Literal["kafka"]
    bootstrap: Annotated[str, Field(min_length=1)] | None = None  # default: the stack's cluster
    topics: Annotated[list[TopicName], Field(min_length=1)] | None = None
    join: JoinConfig | None = None
    format: Literal["json", "msgpack"] = "json"
    key: FieldPath | None = None  # the event's identity (its sample id); with a join, the join key
    # The consumer group the loaders commit the input offsets to, for outside lag monitors (a
    # restart resumes from the job's checkpoint, not from these): default trillium.<job>.input.
    group: Annotated[str, Field(min_length=1)] | None = None
    event_time: FieldPath  # seconds since the UNIX epoch, a number
    start: Literal["earliest", "latest"] = "earliest"  # where a new job starts reading
    max_message_bytes: Annotated[int, Field(ge=64, le=1 << 26)] = 1 << 20
    # A partial step goes out after this long without enough events to fill it: the delay from an
    # event to its training stays bounded when the stream is slow.
    batch_timeout_seconds: PositiveFloat = 1.0
    # Steps the loaders may produce ahead of training: beyond it they stop reading and the input's
    # lag grows (nothing is buffered without bound).
    max_steps_ahead: PositiveInt = 64

    @model_validator(mode="after")
    def _topics_or_join(self) -> KafkaData:
        if (self.topics is None) == (self.join is None):
            raise ValueError("data: give `topics` (events with their label) or `join` (impressions and labels)")
        if self.join is not None and self.key is not None and self.key != self.join.key:
            raise ValueError("data.key: with a join, the event's key is join.key")
        return self

    def schema_columns(self) -> None:
        return None  # any field of the events

    @property
    def input_topics(self) -> list[str]:
        return [self.join.impressions, self.join.labels] if self.join is not None else list(self.topics or [])

    @property
    def event_key(self) -> str | None:
        return self.join.key if self.join is not None else self.key


DataConfig = Annotated[
    AdultData | CriteoData | CsvData | ParquetData | SyntheticData | KafkaData, Field(discriminator="source")
]


# --- features --------------------------------------------------------------------------------


class FeatureSlot(_Strict):
    """One categorical input: the cell of `column` hashed into IDs looked up in `table`."""

    name: Annotated[str, Field(min_length=1)]
    column: str
    table: str  # defaults to the slot's name
    pooling: Literal["sum", "mean", "none"] = "sum"
    # Keep at most max_len IDs per sample (the first ones); required for sequence slots
    # (pooling "none"), which are padded to it.
    max_len: PositiveInt | None = None
    # Split the cell on this string into several IDs (multi-hot / sequence); None: one ID per cell.
    separator: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_table(cls, data: Any) -> Any:
        if isinstance(data, dict) and "table" not in data and "name" in data:
            return {**data, "table": data["name"]}
        return data

    @model_validator(mode="after")
    def _sequence_needs_max_len(self) -> FeatureSlot:
        if self.pooling == "none" and self.max_len is None:
            raise ValueError(f"slot {self.name!r}: pooling 'none' (a sequence) needs max_len")
        return self


class SgdConfig(_Strict):
    name: Literal["sgd"]
    lr: NonNegativeFloat = 0.01
    weight_decay: NonNegativeFloat = 0.0


class AdagradConfig(_Strict):
    """`acc += g*g; w -= lr * g / (sqrt(acc) + eps)`; rowwise: `acc += mean(g*g)` per row."""

    name: Literal["adagrad", "rowwise_adagrad"]
    lr: NonNegativeFloat = 0.01
    eps: PositiveFloat = 1e-8
    initial_accumulator: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0


class AdamConfig(_Strict):
    """Adam with a per-row step count for the bias corrections (rows are updated sparsely)."""

    name: Literal["adam"]
    lr: NonNegativeFloat = 0.001
    beta1: Probability = 0.9
    beta2: Probability = 0.999
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


class FtrlConfig(_Strict):
    """FTRL-Proximal (McMahan et al. 2013); `alpha` is the learning rate."""

    name: Literal["ftrl"]
    alpha: PositiveFloat = 0.05
    beta: NonNegativeFloat = 1.0
    l1: NonNegativeFloat = 0.0
    l2: NonNegativeFloat = 0.0
    initial_accumulator: NonNegativeFloat = 0.0


EmbeddingOptimizerConfig = Annotated[SgdConfig | AdagradConfig | AdamConfig | FtrlConfig, Field(discriminator="name")]


class AdmissionOff(_Strict):
    policy: Literal["off"]


class AdmissionProbability(_Strict):
    """Admit a new ID into the table with this probability per sighting."""

    policy: Literal["probability"]
    probability: Annotated[float, Field(ge=0, le=1)]


class AdmissionThreshold(_Strict):
    """Admit a new ID once a count-min sketch has seen it `threshold` times."""

    policy: Literal["threshold"]
    threshold: PositiveInt
    sketch_width: PositiveInt = 1 << 20
    sketch_depth: Annotated[int, Field(ge=1, le=16)] = 4


AdmissionConfig = Annotated[AdmissionOff | AdmissionProbability | AdmissionThreshold, Field(discriminator="policy")]


class TableConfig(_Strict):
    """An embedding table on the parameter servers (rows created on first sight of an ID)."""

    dim: Annotated[int, Field(ge=1, le=1 << 16)]
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    initializer: Literal["uniform", "normal"] = "uniform"
    init_low: float = -0.01
    init_high: float = 0.01
    init_mean: float = 0.0
    init_std: NonNegativeFloat = 0.01
    optimizer: EmbeddingOptimizerConfig = Field(default_factory=lambda: SgdConfig(name="sgd"))
    weight_bound: PositiveFloat | None = None  # clip weights to [-bound, bound] after each update
    admission: AdmissionConfig = Field(default_factory=lambda: AdmissionOff(policy="off"))
    capacity: PositiveInt | None = None  # rows kept per table (least recently used evicted)
    ttl_seconds: Annotated[int, Field(ge=1, lt=1 << 31)] | None = None  # evict rows idle this long
    ttl_updates: Annotated[int, Field(ge=1, le=1 << 31)] | None = None  # ... or this many updates

    @model_validator(mode="after")
    def _bounds(self) -> TableConfig:
        if self.init_low > self.init_high:
            raise ValueError(f"init_low ({self.init_low}) must be <= init_high ({self.init_high})")
        return self

    def store_kwargs(self, seed: int) -> dict[str, Any]:
        """Keyword arguments of `trillium_native.EmbeddingStore.create_table(name, **kwargs)`."""
        kwargs: dict[str, Any] = {
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer,
            "init_low": self.init_low,
            "init_high": self.init_high,
            "init_mean": self.init_mean,
            "init_std": self.init_std,
            "seed": seed,
            "optimizer": self.optimizer.name,
            "weight_bound": self.weight_bound,
            "admission": self.admission.policy,
            "capacity": self.capacity,
            "ttl_seconds": self.ttl_seconds,
            "ttl_updates": self.ttl_updates,
        }
        opt = self.optimizer
        if isinstance(opt, FtrlConfig):
            kwargs.update(
                ftrl_alpha=opt.alpha,
                ftrl_beta=opt.beta,
                ftrl_l1=opt.l1,
                ftrl_l2=opt.l2,
                initial_accumulator=opt.initial_accumulator,
            )
        else:
            kwargs.update(opt.model_dump(exclude={"name"}))
        adm = self.admission
        if isinstance(adm, AdmissionProbability):
            kwargs["admission_probability"] = adm.probability
        elif isinstance(adm, AdmissionThreshold):
            kwargs.update(
                admission_threshold=adm.threshold,
                admission_sketch_width=adm.sketch_width,
                admission_sketch_depth=adm.sketch_depth,
            )
        return kwargs


class DenseColumn(_Strict):
    """A numeric input column. An empty cell is a missing value: 0 after normalization.

    `standard`: (x - mean) / std; `minmax`: (x - min) / (max - min); both take their statistics
    from the train split unless given. `log1p`: sign(x) * log(1 + |x|) (log1p for the
    non-negative counts it is meant for, still defined for negatives).
    """

    column: str
    normalization: Literal["none", "standard", "log1p", "minmax"] = "none"
    mean: float | None = None
    std: PositiveFloat | None = None
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _stats_match_normalization(self) -> DenseColumn:
        for kind, (a, b) in {"standard": ("mean", "std"), "minmax": ("min", "max")}.items():
            given = [getattr(self, a) is not None, getattr(self, b) is not None]
            if any(given) and self.normalization != kind:
                raise ValueError(f"dense column {self.column!r}: {a}/{b} apply to {kind!r} only")
            if given[0] != given[1]:
                raise ValueError(f"dense column {self.column!r}: give both {a} and {b}, or neither")
        if self.min is not None and self.max is not None and self.min >= self.max:
            raise ValueError(f"dense column {self.column!r}: min must be < max")
        return self


class LabelConfig(_Strict):
    """The label column: values in `positive` are 1, those in `negative` 0. Without
    `negative`, every other non-empty value is 0; with it, any other value is a malformed row."""

    column: str
    positive: Annotated[list[str], Field(min_length=1)]
    negative: Annotated[list[str], Field(min_length=1)] | None = None

    @field_validator("positive", "negative", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _disjoint(self) -> LabelConfig:
        both = set(self.positive) & set(self.negative or ())
        if both:
            raise ValueError(f"label values {sorted(both)} are both positive and negative")
        return self


# --- model, training, topology ---------------------------------------------------------------


class ModelSpec(_Strict):
    """`cls`: `"package.module:Class"`, an `nn.Module` subclass, built as `Class(**kwargs)`
    (see `trillium.models.load_model`)."""

    cls: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
    kwargs: dict[str, Any] = Field(default_factory=dict)


class DenseSgd(_Strict):
    name: Literal["sgd"]
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0)] = 0.0
    weight_decay: NonNegativeFloat = 0.0


class DenseAdam(_Strict):
    name: Literal["adam"]
    lr: PositiveFloat = 0.001
    beta1: Probability = 0.9
    beta2: Probability = 0.999
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


class DenseAdagrad(_Strict):
    name: Literal["adagrad"]
    lr: PositiveFloat = 0.01
    eps: PositiveFloat = 1e-10
    initial_accumulator: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0


DenseOptimizerConfig = Annotated[DenseSgd | DenseAdam | DenseAdagrad, Field(discriminator="name")]


class TrainingConfig(_Strict):
    batch_size: PositiveInt
    # 0: no training, only the evaluation of a warm start (`init_from`): a checkpoint's test metrics.
    # null: a continuous job, trained from a stream until stopped (the kafka source).
    epochs: Annotated[int, Field(ge=0)] | None = 1
    # How many earlier steps may still have embedding gradients not applied on the PS when a
    # step's embeddings are looked up (see trillium.progress): 0 is synchronous, null unbounded.
    staleness_bound: Annotated[int, Field(ge=0)] | None
    dense_optimizer: DenseOptimizerConfig
    seed: int = 0
    eval_batch_size: PositiveInt = 1024
    # Shuffle the train rows through a buffer of this many rows, anew every epoch (a function of
    # seed, epoch and loader); 0 keeps file order. The buffer bounds memory, not the randomness:
    # a row moves at most about as far as the buffer is long.
    shuffle_buffer: Annotated[int, Field(ge=0)] = 0
    # Progressive validation: every batch is scored before it is trained on; the rolling AUC and
    # log loss are over this many latest samples, and also kept per window of event time.
    progressive_samples: PositiveInt = 100_000
    progressive_window_seconds: PositiveFloat = 60.0
    # The NN ranks' forward arithmetic: bf16 runs it under torch.autocast (matmuls in bfloat16, on
    # a GPU or the CPU); the loss, the gradients handed back and the optimizer stay fp32.
    precision: Literal["fp32", "bf16"] = "fp32"


class TopologyConfig(_Strict):
    nn_ranks: PositiveInt = 1
    ps_shards: PositiveInt = 1
    embedding_workers: PositiveInt = 1
    # Loader i reads share i of the input and feeds NN ranks i, i + N, ...: at most one per rank.
    data_loaders: PositiveInt = 1

    @model_validator(mode="after")
    def _a_rank_per_loader(self) -> TopologyConfig:
        if self.data_loaders > self.nn_ranks:
            raise ValueError(
                f"data_loaders ({self.data_loaders}) must not exceed nn_ranks ({self.nn_ranks}): "
                "each loader feeds ranks of its own"
            )
        return self


class CheckpointConfig(_Strict):
    """When a running job is checkpointed, where to, and how many checkpoints are kept.

    A checkpoint is taken at a step cut (every NN rank has finished step s, every PS shard has
    applied every gradient up to s): on this schedule, on request (the REST API), and after the
    last step. The job recovers from the latest one when any of its processes dies.
    """

    every_steps: PositiveInt | None = None
    every_seconds: PositiveFloat | None = 600.0
    keep_last: PositiveInt = 3
    # Every full_every-th checkpoint holds the whole embedding tables; those between hold only
    # the rows changed since the one before (a chain the restore loads oldest first). 1: all full.
    full_every: PositiveInt = 10
    # A directory or an fsspec URL (s3://bucket/prefix, with s3fs installed); default
    # <run-dir>/checkpoints. Each checkpoint is <dir>/<job id>/<step>/.
    dir: Annotated[str, Field(min_length=1)] | None = None
    evaluate: bool = False  # score the test split at each cut; the metrics go into the manifest
    max_recoveries: Annotated[int, Field(ge=0)] = 3  # recoveries before the job fails for good


class InitFrom(_Strict):
    """A warm start: the embedding tables (resharded to this job's PS shards) and the dense model
    and optimizer of another job's checkpoint. Nothing of its input position is taken."""

    job: Annotated[str, Field(min_length=1)]
    step: Annotated[int, Field(ge=0)] | None = None  # null: its latest complete checkpoint
    dir: Annotated[str, Field(min_length=1)] | None = None  # where it is, if not this job's checkpoint dir


class JobConfig(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)]
    data: DataConfig
    slots: Annotated[list[FeatureSlot], Field(min_length=1)]
    tables: Annotated[dict[str, TableConfig], Field(min_length=1)]
    dense: list[DenseColumn] = Field(default_factory=list)
    label: LabelConfig
    model: ModelSpec
    training: TrainingConfig
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig | None = Field(default_factory=CheckpointConfig)  # null: no checkpoints
    init_from: InitFrom | None = None

    @model_validator(mode="after")
    def _cross_check(self) -> JobConfig:
        if self.training.epochs == 0 and self.init_from is None:
            raise ValueError("training.epochs: 0 (evaluation only) needs init_from: a checkpoint to evaluate")
        streaming = isinstance(self.data, KafkaData)
        if streaming != (self.training.epochs is None):
            raise ValueError(
                "training.epochs: null (a continuous job) goes with data.source: kafka, and a "
                "kafka source with epochs: null"
            )
        if (
            streaming
            and self.data.join is not None
            and (self.label.positive != ["1"] or self.label.negative not in (None, ["0"]))
        ):
            raise ValueError(
                'label: with a join the joiner sets the label field to "1" (a label event in the '
                'window) or "0": use positive: "1" (and negative: "0")'
            )
        columns = self.data.schema_columns()
        if columns is not None:
            for where, column in self.column_uses():
                if column not in columns:
                    raise ValueError(
                        f"{where}: unknown column {column!r} for source {self.data.source!r}; "
                        f"known columns: {', '.join(columns)}"
                    )
        seen: set[str] = set()
        for i, slot in enumerate(self.slots):
            where = f"slots[{i}] {slot.name!r}"
            if slot.name in seen:
                raise ValueError(f"{where}: duplicate slot name")
            seen.add(slot.name)
            if slot.table not in self.tables:
                raise ValueError(f"{where}: table {slot.table!r} is not defined; tables: {', '.join(self.tables)}")
        unused = set(self.tables) - {s.table for s in self.slots}
        if unused:
            raise ValueError(f"tables {sorted(unused)} are used by no slot")
        dense_columns = [d.column for d in self.dense]
        for i, column in enumerate(dense_columns):
            if column in dense_columns[:i]:
                raise ValueError(f"dense[{i}]: column {column!r} is listed twice")
        if self.label.column in dense_columns or any(s.column == self.label.column for s in self.slots):
            raise ValueError(f"label column {self.label.column!r} is also used as a feature")
        return self

    def column_uses(self) -> list[tuple[str, str]]:
        """`(where, column)` for every column the job names, `where` as errors name it."""
        uses = [(f"slots[{i}] {slot.name!r}", slot.column) for i, slot in enumerate(self.slots)]
        uses += [(f"dense[{i}]", d.column) for i, d in enumerate(self.dense)]
        uses.append(("label", self.label.column))
        split = getattr(self.data, "split", None)
        if isinstance(split, ColumnSplit):
            uses.append(("data.split.by", split.by))
        return uses

    @property
    def embedding_dims(self) -> list[int]:
        """Each slot's embedding dim, in slot order."""
        return [self.tables[s.table].dim for s in self.slots]

    @property
    def embedding_shapes(self) -> list[tuple[int, ...]]:
        """Each slot's model input per sample, in slot order: (dim,) pooled, (max_len, dim) a sequence."""
        return [
            (s.max_len, dim) if s.pooling == "none" and s.max_len else (dim,)
            for s, dim in zip(self.slots, self.embedding_dims, strict=True)
        ]


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job YAML file; relative data paths are taken from its directory. The
    columns the job names are checked against its files' headers (`trillium.sources`): a
    `ValueError` names the column, the file and the columns it has."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a job file must be a YAML mapping, got {type(raw).__name__}")
    job = JobConfig.model_validate(raw, context={"base_dir": path.parent.absolute()})
    # Imported here: the schema above needs nothing but pydantic, yaml and the presets' constants;
    # only this check opens files. Files not found here may be where the loaders run: they check
    # again when they open them.
    from trillium.sources import check_columns

    check_columns(job, missing_files_ok=True)
    return job
