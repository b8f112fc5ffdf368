"""A job: its data, feature slots and tables, dense columns and label, model, training,
topology and checkpoints (`JobConfig`), read from YAML by `read_job`.

Cross-field checks (tables exist, columns exist in the source's schema, ...) name the slot or
field at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from trillium.config import GRPC_MAX_MESSAGE_BYTES, RoleCounts

from .base import NAME_PATTERN, NonNegativeFloat, PositiveFloat, PositiveInt, Probability, Strict
from .data import ColumnSplit, DataConfig, KafkaData
from .tables import TableConfig


class FeatureSlot(Strict):
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


class DenseColumn(Strict):
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


class LabelConfig(Strict):
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


class ModelSpec(Strict):
    """`cls`: `"package.module:Class"`, an `nn.Module` subclass, built as `Class(**kwargs)`
    (see `trillium.models.load_model`)."""

    cls: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
    kwargs: dict[str, Any] = Field(default_factory=dict)


class DenseSgd(Strict):
    name: Literal["sgd"]
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0)] = 0.0
    weight_decay: NonNegativeFloat = 0.0


class DenseAdam(Strict):
    name: Literal["adam"]
    lr: PositiveFloat = 0.001
    beta1: Probability = 0.9
    beta2: Probability = 0.999
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


class DenseAdagrad(Strict):
    name: Literal["adagrad"]
    lr: PositiveFloat = 0.01
    eps: PositiveFloat = 1e-10
    initial_accumulator: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0


DenseOptimizerConfig = Annotated[DenseSgd | DenseAdam | DenseAdagrad, Field(discriminator="name")]


class TrainingConfig(Strict):
    batch_size: PositiveInt
    # 0: no training, only the evaluation of a warm start (`init_from`): a checkpoint's test metrics.
    # null: a continuous job, trained from a stream until stopped (the kafka source).
    epochs: Annotated[int, Field(ge=0)] | None = 1
    # How many earlier steps may still have embedding gradients not applied on the PS when a
    # step's embeddings are looked up (see trillium.runtime.progress): 0 is synchronous, null
    # unbounded, "auto" the smallest that keeps the NN ranks from waiting, measured
    # (trillium.runtime.autobound).
    staleness_bound: Annotated[int, Field(ge=0)] | Literal["auto"] | None
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
    # The embeddings and their gradients on the wire between the PS shards, the embedding workers
    # and the NN ranks, and the gradients on Kafka: fp16 halves their bytes (the gradients scaled
    # per message so that none underflows); the PS keeps and accumulates fp32 either way. fp32
    # is exact (a one-rank sync job then equals the single-process reference to rounding).
    wire_dtype: Literal["fp32", "fp16"] = "fp16"


class TopologyConfig(RoleCounts, Strict):
    """The workers a job uses: instances 0..n-1 of each role (`count`, `workers`)."""

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


class PublishConfig(Strict):
    """Where and how often a job publishes its model for serving (services/coordinator/publish.py).

    A running job publishes a version every `every_seconds` (at a step cut, without holding
    training), at its checkpoints when `at_checkpoints`, and after its last step: whole every
    `full_every`-th version, else the rows changed since the version before plus the dense
    weights. Replicas serve the newest; `keep_last` versions stay to roll back to.
    """

    model: Annotated[str, Field(pattern=NAME_PATTERN, max_length=128)] | None = None  # default: name
    every_seconds: PositiveFloat | None = 5.0
    at_checkpoints: bool = False
    full_every: PositiveInt = 100
    # The values as served: fp16 (2 bytes a value), or fp32. The job's own evaluation reads its rows
    # in this dtype too, so that what it measures is what replicas answer.
    dtype: Literal["fp16", "fp32"] = "fp16"
    # A directory or an fsspec URL (s3://bucket/prefix): default <run-dir>/models. A model's versions
    # are <dir>/<model>/versions/<n>.json, their files beside them (trillium.runtime.model_store).
    dir: Annotated[str, Field(min_length=1)] | None = None
    keep_last: PositiveInt = 20  # and every version a kept one is loaded on top of


class CheckpointConfig(Strict):
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
    # A checkpoint whose parts are not all written by then is abandoned (the job goes on).
    write_timeout_seconds: PositiveFloat = 600.0
    # Trim the job's samples and gradients topics behind the oldest checkpoint kept, as no
    # recovery reads there again; false keeps every record (to audit them) until the job is deleted.
    trim_topics: bool = True
    max_recoveries: Annotated[int, Field(ge=0)] = 3  # recoveries before the job fails for good


class InitFrom(Strict):
    """A warm start: the embedding tables (resharded to this job's PS shards) and the dense model
    and optimizer of another job's checkpoint. Nothing of its input position is taken."""

    job: Annotated[str, Field(pattern=NAME_PATTERN, max_length=160)]  # a job id: it names a directory
    step: Annotated[int, Field(ge=0)] | None = None  # null: its latest complete checkpoint
    dir: Annotated[str, Field(min_length=1)] | None = None  # where it is, if not this job's checkpoint dir


class JobConfig(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=128)]
    data: DataConfig
    slots: Annotated[list[FeatureSlot], Field(min_length=1)]
    tables: Annotated[dict[str, TableConfig], Field(min_length=1)]
    dense: list[DenseColumn] = Field(default_factory=list)
    label: LabelConfig
    model: ModelSpec
    training: TrainingConfig
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig | None = Field(default_factory=CheckpointConfig)  # null: no checkpoints
    publish: PublishConfig | None = Field(default_factory=PublishConfig)  # null: serves nothing
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
        self._check_batch_fits_a_message()
        dense_columns = [d.column for d in self.dense]
        for i, column in enumerate(dense_columns):
            if column in dense_columns[:i]:
                raise ValueError(f"dense[{i}]: column {column!r} is listed twice")
        if self.label.column in dense_columns or any(s.column == self.label.column for s in self.slots):
            raise ValueError(f"label column {self.label.column!r} is also used as a feature")
        return self

    @property
    def embedding_values(self) -> int:
        """A sample's embedding values: each slot's dim (times its max_len for a sequence)."""
        return sum(self.tables[s.table].dim * (s.max_len if s.pooling == "none" else 1) for s in self.slots)

    def embedding_batch_bytes(self, *, evaluation: bool) -> int:
        """One batch's embeddings as its lookup answer carries them to an NN rank: a training
        batch in the wire dtype, the evaluation's in fp32."""
        if evaluation:
            return self.training.eval_batch_size * self.embedding_values * 4
        return self.training.batch_size * self.embedding_values * (2 if self.training.wire_dtype == "fp16" else 4)

    def _check_batch_fits_a_message(self) -> None:
        """A batch's embeddings go to its NN rank in one gRPC answer: one over the message limit
        would fail the job at its first batch of that size (the evaluation's, often) instead."""
        for field, evaluation, dtype in (
            ("batch_size", False, self.training.wire_dtype),
            ("eval_batch_size", True, "fp32"),
        ):
            batch, size = getattr(self.training, field), self.embedding_batch_bytes(evaluation=evaluation)
            if size > GRPC_MAX_MESSAGE_BYTES:
                raise ValueError(
                    f"training.{field}: {batch} samples of {self.embedding_values} embedding values in {dtype} "
                    f"exceed a gRPC message ({GRPC_MAX_MESSAGE_BYTES >> 20} MiB); "
                    f"at most {GRPC_MAX_MESSAGE_BYTES * batch // size}"
                )

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


def read_job(path: str | Path) -> JobConfig:
    """Read and validate a job YAML file; relative data paths are taken from its directory.
    `trillium.data.load_job` also checks the columns against the files."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a job file must be a YAML mapping, got {type(raw).__name__}")
    return JobConfig.model_validate(raw, context={"base_dir": path.parent.absolute()})
