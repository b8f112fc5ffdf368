"""A job: its data, feature slots and tables, dense columns and label, model, training,
topology and checkpoints (`JobConfig`), read from YAML by `read_job`.

Cross-field checks (tables exist, columns exist in the source's schema, ...) name the slot or
field at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from trillium.config import GRPC_MAX_MESSAGE_BYTES, RoleCounts

from .base import NAME_PATTERN, NonNegativeFloat, PositiveFloat, PositiveInt, Probability, Strict
from .data import ColumnSplit, DataConfig, KafkaData
from .tables import TableConfig
from .tasks import LabelConfig, TaskConfig, check_joined_tasks, check_tasks


class FeatureSlot(Strict):
    """One categorical input: the cell of `column` hashed into IDs looked up in `table`."""

    name: Annotated[str, Field(min_length=1)]
    """The slot's name: the model's input, in slot order."""
    column: str
    """The column (a file's) or field (an event's, by dotted path) it reads."""
    table: str
    """The embedding table its IDs look up (default: the slot's name); slots may share one."""
    pooling: Literal["sum", "mean", "none"] = "sum"
    """A sample's several IDs become one vector by `sum` or `mean`, or stay a sequence (`none`)."""
    max_len: PositiveInt | None = None
    """Keep at most this many IDs per sample (the first ones); required for a sequence (pooling
    `none`), which is padded to it."""
    separator: Annotated[str, Field(min_length=1)] | None = None
    """Split the cell on this string into several IDs (multi-hot, or a sequence); null: one ID a cell."""

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
    """The numeric column (or event field) it reads."""
    normalization: Literal["none", "standard", "log1p", "minmax"] = "none"
    """How its value is scaled before the model sees it."""
    mean: float | None = None
    """`standard`'s mean (with `std`); default: the train split's."""
    std: PositiveFloat | None = None
    """`standard`'s standard deviation (with `mean`); default: the train split's."""
    min: float | None = None
    """`minmax`'s minimum (with `max`); default: the train split's."""
    max: float | None = None
    """`minmax`'s maximum (with `min`); default: the train split's."""

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


class EvaluationConfig(Strict):
    """How the job's test split is scored, beyond AUC and log loss."""

    group_by: str | None = None
    """The slot whose ID groups the test samples for GAUC, e.g. the user's: the AUC of each group
    holding both classes, averaged weighted by the group's samples (a feed ranks items within a
    user's list, never users against each other). A sample with no ID in the slot is in no
    group; a multi-valued slot groups by its first ID. null: no GAUC."""


# --- model, training, topology ---------------------------------------------------------------


class ModelSpec(Strict):
    """`cls`: `"package.module:Class"`, an `nn.Module` subclass, built as `Class(**kwargs)`
    (see `trillium.models.load_model`)."""

    cls: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
    """`package.module:Class`, from a module `TRILLIUM_MODEL_MODULES` lists (docs/operations.md)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The class's keyword arguments."""


class DenseSgd(Strict):
    """torch.optim.SGD for the dense network."""

    name: Literal["sgd"]
    """`sgd`."""
    lr: PositiveFloat = 0.01
    """The learning rate."""
    momentum: Annotated[float, Field(ge=0)] = 0.0
    """The momentum factor."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


class DenseAdam(Strict):
    name: Literal["adam"]
    """`adam`."""
    lr: PositiveFloat = 0.001
    """The learning rate."""
    beta1: Probability = 0.9
    """The decay of the gradient's running mean."""
    beta2: Probability = 0.999
    """The decay of the squared gradient's running mean."""
    eps: PositiveFloat = 1e-8
    """Added to the denominator."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


class DenseAdagrad(Strict):
    """torch.optim.Adagrad for the dense network."""

    name: Literal["adagrad"]
    """`adagrad`."""
    lr: PositiveFloat = 0.01
    """The learning rate."""
    eps: PositiveFloat = 1e-10
    """Added to the denominator."""
    initial_accumulator: NonNegativeFloat = 0.0
    """The squared-gradient sum's starting value."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


DenseOptimizerConfig = Annotated[DenseSgd | DenseAdam | DenseAdagrad, Field(discriminator="name")]


class TrainingConfig(Strict):
    """How the job trains: batches, epochs, the staleness bound, the dense optimizer."""

    batch_size: PositiveInt
    """Samples a step per NN rank."""
    epochs: Annotated[int, Field(ge=0)] | None = 1
    """Passes over the train split. 0: no training, only the evaluation of a warm start
    (`init_from`): a checkpoint's test metrics. null: a continuous job, trained from a stream
    until stopped (the kafka source)."""
    staleness_bound: Annotated[int, Field(ge=0)] | Literal["auto"] | None
    """How many earlier steps may still have embedding gradients not applied on the PS when a
    step's embeddings are looked up: 0 is synchronous SGD, null unbounded (asynchronous), `auto`
    the smallest that keeps the NN ranks from waiting, measured as the job runs."""
    dense_optimizer: DenseOptimizerConfig
    """The dense network's optimizer, by `name`: `sgd`, `adam` or `adagrad`."""
    seed: int = 0
    """Seeds the dense initialization and the shuffle."""
    eval_batch_size: PositiveInt = 1024
    """Samples an evaluation batch."""
    shuffle_buffer: Annotated[int, Field(ge=0)] = 0
    """Shuffle the train rows through a buffer of this many rows, anew every epoch (a function of
    seed, epoch and loader); 0 keeps file order. The buffer bounds memory, not the randomness: a
    row moves at most about as far as the buffer is long."""
    progressive_samples: PositiveInt = 100_000
    """Progressive validation (every batch scored before it is trained on): the rolling AUC and
    log loss are over this many latest samples."""
    progressive_window_seconds: PositiveFloat = 60.0
    """Progressive validation's windows of event time, each with its own AUC and log loss."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """The NN ranks' forward arithmetic: `bf16` runs it under torch.autocast (matmuls in bfloat16,
    on a GPU or the CPU); the loss, the gradients handed back and the optimizer stay fp32."""
    wire_dtype: Literal["fp32", "fp16"] = "fp16"
    """The embeddings and their gradients on the wire between the PS shards, the embedding workers
    and the NN ranks, and the gradients on Kafka: fp16 halves their bytes (the gradients scaled
    per message so that none underflows); the PS keeps and accumulates fp32 either way. fp32 is
    exact (a one-rank sync job then equals the single-process reference to rounding)."""


class TopologyConfig(RoleCounts, Strict):
    """The workers a job uses: instances 0..n-1 of each role (`count`, `workers`)."""

    nn_ranks: PositiveInt = 1
    """NN workers training the dense network in sync (one all-reduce a step)."""
    ps_shards: PositiveInt = 1
    """Embedding PS shards the tables are split over."""
    embedding_workers: PositiveInt = 1
    """Embedding workers between the NN ranks and the PS shards."""
    data_loaders: PositiveInt = 1
    """Loader i reads share i of the input and feeds NN ranks i, i + N, ...: at most one per rank."""

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

    model: Annotated[str, Field(pattern=NAME_PATTERN, max_length=128)] | None = None
    """The model's name, stable across attempts and resumes; default: the job's name."""
    every_seconds: PositiveFloat | None = 5.0
    """A running job's versions; null: only at the end (and at checkpoints, with `at_checkpoints`)."""
    at_checkpoints: bool = False
    """A version at every checkpoint too."""
    full_every: PositiveInt = 100
    """Every this-many-th version whole; those between: the rows changed since, and the dense weights."""
    dtype: Literal["fp16", "fp32"] = "fp16"
    """The values as served: fp16 (2 bytes a value), or fp32. The job's own evaluation reads its
    rows in this dtype too, so that what it measures is what replicas answer."""
    dir: Annotated[str, Field(min_length=1)] | None = None
    """A directory or an fsspec URL (s3://bucket/prefix), under `TRILLIUM_ALLOWED_PATHS`; default
    <run-dir>/models. A model's versions are <dir>/<model>/versions/<n>.json, their files beside."""
    keep_last: PositiveInt = 20
    """Versions kept to roll back to (and every version a kept one is loaded on top of)."""


class CheckpointConfig(Strict):
    """When a running job is checkpointed, where to, and how many checkpoints are kept.

    A checkpoint is taken at a step cut (every NN rank has finished step s, every PS shard has
    applied every gradient up to s): on this schedule, on request (the REST API), and after the
    last step. The job recovers from the latest one when any of its processes dies.
    """

    every_steps: PositiveInt | None = None
    """A checkpoint every this many steps; null: none by steps."""
    every_seconds: PositiveFloat | None = 600.0
    """A checkpoint every this many seconds; null: none by time."""
    keep_last: PositiveInt = 3
    """Complete checkpoints kept (and every one a kept one is loaded on top of)."""
    full_every: PositiveInt = 10
    """Every this-many-th checkpoint holds the whole embedding tables; those between only the rows
    changed since the one before (a chain the restore loads oldest first). 1: all full."""
    dir: Annotated[str, Field(min_length=1)] | None = None
    """A directory or an fsspec URL (s3://bucket/prefix), under `TRILLIUM_ALLOWED_PATHS`; default
    <run-dir>/checkpoints. Each checkpoint is <dir>/<job id>/<step>/."""
    evaluate: bool = False
    """Score the test split at each cut; the metrics go into the manifest."""
    write_timeout_seconds: PositiveFloat = 600.0
    """A checkpoint whose parts are not all written by then is abandoned (the job goes on)."""
    trim_topics: bool = True
    """Trim the job's samples and gradients topics behind the oldest checkpoint kept, as no
    recovery reads there again; false keeps every record (to audit them) until the job is deleted."""
    max_recoveries: Annotated[int, Field(ge=0)] = 3
    """Recoveries before the job fails for good (a start over, when a process is lost before the
    first checkpoint, is one)."""


class InitFrom(Strict):
    """A warm start: the embedding tables (resharded to this job's PS shards) and the dense model
    and optimizer of another job's checkpoint. Nothing of its input position is taken."""

    job: Annotated[str, Field(pattern=NAME_PATTERN, max_length=160)]
    """The other job's id (it names a directory)."""
    step: Annotated[int, Field(ge=0)] | None = None
    """Its checkpoint's step; null: its latest complete checkpoint."""
    dir: Annotated[str, Field(min_length=1)] | None = None
    """Where its checkpoints are, if not in this job's checkpoint directory."""


class JobConfig(Strict):
    """A job file: what to train on, the model, and how."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=128)]
    """The job's name: its id is the name and a suffix, and its model is named after it."""
    data: DataConfig
    """Where the samples come from, by `source`: `csv`, `parquet`, `adult`, `criteo`, `synthetic`
    or `kafka`."""
    slots: Annotated[list[FeatureSlot], Field(min_length=1)]
    """The categorical inputs, each looked up in a table, in the model's input order."""
    tables: Annotated[dict[str, TableConfig], Field(min_length=1)]
    """The embedding tables, by name."""
    dense: list[DenseColumn] = Field(default_factory=list)
    """The numeric inputs, in the model's input order."""
    label: LabelConfig | None = None
    """The label and which of its values are positive: one binary task, named "label" (or give
    `labels`)."""
    labels: Annotated[list[TaskConfig], Field(min_length=1)] | None = None
    """Several tasks trained together (multi-task): the model returns (B, T), column k for
    task k. Instead of `label`."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """How the test split is scored: AUC and log loss always, GAUC with `group_by`."""
    model: ModelSpec
    """The dense network: a torch.nn.Module called as model(dense, embeddings)."""
    training: TrainingConfig
    """How it trains."""
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    """How many of each worker it uses."""
    checkpoint: CheckpointConfig | None = Field(default_factory=CheckpointConfig)
    """When and where it is checkpointed; null: never (and it cannot recover)."""
    publish: PublishConfig | None = Field(default_factory=PublishConfig)
    """When and where its model is published for serving; null: never."""
    init_from: InitFrom | None = None
    """A warm start from another job's checkpoint."""

    @model_validator(mode="after")
    def _cross_check(self) -> JobConfig:
        self._check_tasks()
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
            and self.label is not None
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
        group_by = self.evaluation.group_by
        if group_by is not None and group_by not in seen:
            raise ValueError(
                f"evaluation.group_by: {group_by!r} is no slot; slots: {', '.join(x.name for x in self.slots)}"
            )
        unused = set(self.tables) - {s.table for s in self.slots}
        if unused:
            raise ValueError(f"tables {sorted(unused)} are used by no slot")
        self._check_batch_fits_a_message()
        dense_columns = [d.column for d in self.dense]
        for i, column in enumerate(dense_columns):
            if column in dense_columns[:i]:
                raise ValueError(f"dense[{i}]: column {column!r} is listed twice")
        for task in self.tasks:
            where = "label" if self.label is not None else f"labels: task {task.name!r}:"
            for column in (task.column, task.mask):
                if column in dense_columns or any(s.column == column for s in self.slots):
                    raise ValueError(f"{where} column {column!r} is also used as a feature")
        return self

    def _check_tasks(self) -> None:
        if (self.label is None) == (self.labels is None):
            raise ValueError("give `label` (one task) or `labels` (several), not both or neither")
        if self.labels is None:
            if isinstance(self.data, KafkaData) and self.data.join is not None and self.data.join.per_task:
                raise ValueError(
                    "data.join.labels: a topic per task is for a multi-task job (`labels:`); a "
                    "one-label job names its label topic"
                )
            return
        check_tasks(self.labels)
        if isinstance(self.data, KafkaData) and self.data.join is not None:
            check_joined_tasks(self.labels, self.data.join)

    @property
    def tasks(self) -> list[TaskConfig]:
        """The job's tasks in the model's output order: `labels`, or `label` as one binary task."""
        if self.labels is not None:
            return list(self.labels)
        assert self.label is not None
        return [TaskConfig.of_label(self.label)]

    @property
    def label_shape(self) -> tuple[int, ...]:
        """A sample's labels in a batch: () for one label, (T,) for several tasks."""
        return (len(self.labels),) if self.labels is not None else ()

    @property
    def multitask(self) -> bool:
        """Whether the job gives `labels`: its batches carry labels (B, T), NaN where a row has no
        label for a task, and its model returns (B, T)."""
        return self.labels is not None

    def id_space(self, slot: FeatureSlot) -> str:
        """The namespace `slot`'s values are hashed in: its table's name where the table's slots
        share its IDs (`ids: shared`, the default), else the slot's own (`per_slot`). A table read
        by one slot of its name hashes as it always did."""
        return slot.table if self.tables[slot.table].ids == "shared" else slot.name

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
        if self.label is not None:
            uses.append(("label", self.label.column))
        for i, task in enumerate(self.labels or ()):
            uses += [(f"labels[{i}] {task.name!r}", column) for column in (task.column, task.mask) if column]
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
