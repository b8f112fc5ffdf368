"""Where a job's data comes from: files per split (CSV/TSV, Parquet, the `adult` and `criteo`
presets), rows drawn from a planted model (`synthetic`), or Kafka events (`kafka`, with a join of
impressions and labels). The column names of the presets are part of the schema: a preset job's
columns are checked against them when it is validated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from .base import NonNegativeFloat, PositiveFloat, PositiveInt, Strict

# adult.names order; the label column is named as in the data set's SOURCE.md.
ADULT_COLUMNS: tuple[str, ...] = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education_num",
    "marital_status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital_gain",
    "capital_loss",
    "hours_per_week",
    "native_country",
    "income_bracket",
)
CRITEO_COLUMNS: tuple[str, ...] = (
    "label",
    *(f"I{i}" for i in range(1, 14)),
    *(f"C{i}" for i in range(1, 27)),
)
# The synthetic source generates Criteo-format rows in process (see trillium.data.sources.datagen).
PRESET_COLUMNS: dict[str, tuple[str, ...]] = {
    "adult": ADULT_COLUMNS,
    "criteo": CRITEO_COLUMNS,
    "synthetic": CRITEO_COLUMNS,
}


class FractionSplit(Strict):
    """The test split is a stable pseudo-random `test_fraction` of the rows, drawn per row from
    `seed` and the row's place in its file (see `trillium.data.sources.split`); the rest is train."""

    by: Literal["fraction"]
    """`fraction`: a share of the rows, drawn at random per row."""
    test_fraction: Annotated[float, Field(gt=0, lt=1)]
    """The share of the rows in the test split."""
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    """Draws the rows of the test split: the same seed, the same split."""


class ColumnSplit(Strict):
    """A cut on a column, e.g. time: rows whose `by` column is >= `test_from` are the test
    split, the others train. A number compares numerically (the column must hold numbers), a
    string as text (ISO dates sort as text)."""

    by: Annotated[str, Field(min_length=1)]
    """The column cut on."""
    test_from: int | float | str
    """Rows whose column is at least this are the test split."""


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


class _FileData(Strict):
    """Files per split: `test` files, or a `split` policy cutting the `train` files in two,
    or neither (no test split)."""

    source: str  # each kind narrows it to its Literal
    train: Paths
    """The train split's files: a path, a glob (`data/day_*.csv.gz`, expanded in sorted order) or
    a list of them; relative to the job file, and under `TRILLIUM_ALLOWED_PATHS` (every match of a
    glob too, where the loader reads it)."""
    test: Paths | None = None
    """The test split's files, as `train`; or give a `split`, or neither (no test split)."""
    split: SplitPolicy | None = None
    """Cuts the train files into train and test: `{by: fraction, test_fraction: 0.1}`, or a
    column and where its test rows start (`{by: hour, test_from: 14102900}`)."""

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
    """`adult`: UCI Adult's CSV layout."""


class CriteoData(_FileData):
    """Criteo-format TSV: label, I1..I13, C1..C26, tab-separated; a preset of the CSV reader."""

    source: Literal["criteo"]
    """`criteo`: Criteo's TSV layout."""


class CsvData(_FileData):
    """Delimited text (CSV, TSV, ...), each file plain or compressed (`.gz`, `.zst`: by its
    extension). Every cell is read as text; an empty cell is a missing value."""

    source: Literal["csv"]
    """`csv`: delimited text of your own."""
    delimiter: Annotated[str, Field(min_length=1, max_length=1)] = ","
    """The one character between cells (`"\\t"` for TSV)."""
    quote: Annotated[str, Field(min_length=1, max_length=1)] | None = '"'
    """The character that quotes a cell; null: no quoting."""
    header: bool = True
    """The first line of every file names its columns."""
    columns: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    """The column names in file order: needed without a header; with one, they replace its names."""
    quoted_newlines: bool = False
    """Quoted values may contain line breaks (a quote then only opens or closes a quoted cell, as
    RFC 4180 writes them). Such files are read whole by one loader: a byte range cannot tell a
    line break inside quotes from a row's end."""

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
    """`parquet`: Parquet files of your own."""


class SyntheticData(Strict):
    """Criteo-format rows drawn in process from a planted logistic model (trillium.data.sources.datagen)."""

    source: Literal["synthetic"]
    """`synthetic`: rows drawn in process, no files."""
    rows: PositiveInt
    """Train rows."""
    test_rows: Annotated[int, Field(ge=0)] = 0
    """Test rows, drawn from the same model."""
    seed: int = 0
    """Draws the planted model and the rows."""
    vocab_sizes: Annotated[list[PositiveInt], Field(min_length=26, max_length=26)] | None = None
    """The distinct IDs of each of the 26 categorical columns (default: datagen's)."""
    zipf_exponent: Annotated[float, Field(ge=0)] = 1.1
    """The power law of ID popularity within a slot (density rank^-a; 0: uniform; below 1: a
    large vocabulary's tail is reached in few rows, as a scale run needs)."""

    @field_validator("zipf_exponent")
    @classmethod
    def _not_one(cls, a: float) -> float:
        if a == 1.0:
            raise ValueError("zipf_exponent 1 has no power-law inverse CDF here: take 0.99 or 1.01")
        return a

    def schema_columns(self) -> tuple[str, ...]:
        return PRESET_COLUMNS["synthetic"]


FieldPath = Annotated[str, Field(min_length=1, pattern=r"^[^.]+(\.[^.]+)*$")]  # dotted: "user.id"
TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]


class JoinedLabels(Strict):
    """A task's label events, on a topic of their own, joined to the impressions (an entry of a
    multi-task job's `data.join.labels`): each event is a positive of `task` for the impression
    with its key, taken up to `window_seconds` (event time) after the impression."""

    topic: TopicName
    """The topic of this task's label events (clicks, conversions)."""
    task: str
    """The binary task of the job's `labels` these events are positives of."""
    window_seconds: PositiveFloat
    """How long (event time) after its impression a label of this task is taken."""


class JoinConfig(Strict):
    """Impressions joined with their labels by key, in event time.

    **One label topic** (`labels: <topic>`, a `label:` job): an impression waits up to
    `window_seconds` (event time) for a label with its key: a label inside the window makes it a
    positive sample; the window closing (the watermark, the least event time over the loader's
    input partitions less `allowed_lateness_seconds`, passing its end) makes it a negative.
    Samples leave in event-time order of these decisions, each once the watermark passes it. A
    label later than that is counted as late and, with `late_labels: correct`, sent as a positive
    correction sample.

    **A topic per task** (`labels: [{topic, task, window_seconds}, ...]`, a `labels:` job of
    binary tasks): each task's labels come from their topic with their own window (a click within
    10 minutes, a conversion within 24 hours). The sample leaves when the shortest window closes,
    with every task's label known then (a task without one is 0); a later label inside its task's
    window is sent as a correction of that task alone (the other tasks have no label in it). An
    impression is tracked until its longest window closes; a label after its task's window is
    counted as late and, with `late_labels: correct`, corrected up to a second window.

    Open (tracked) impressions per input partition are capped, which bounds the joiner's memory:
    over the cap the oldest close early (counted). The topics must be co-partitioned by the key
    (same partition count, keyed producers), as Kafka Streams requires.
    """

    impressions: TopicName
    """The topic of impression events."""
    labels: TopicName | Annotated[list[JoinedLabels], Field(min_length=1)]
    """The topic of label events (clicks), or a topic per task of a multi-task job."""
    key: FieldPath
    """The field every topic's events carry, by dotted path, that joins a label to its impression."""
    window_seconds: PositiveFloat | None = None
    """How long (event time) an impression waits for its label (one label topic; a topic per
    task gives each its own)."""
    allowed_lateness_seconds: NonNegativeFloat = 0.0
    """How far the watermark stays behind the least event time read."""
    late_labels: Literal["count", "correct"] = "count"
    """A label after its window: only counted, or also trained as a positive correction."""
    max_open_per_partition: PositiveInt = 1_000_000
    """Impressions an input partition may hold open (with a topic per task: until the longest
    window closes); over it the oldest close early (counted)."""

    @model_validator(mode="after")
    def _windows(self) -> JoinConfig:
        if isinstance(self.labels, str):
            if self.window_seconds is None:
                raise ValueError("data.join.window_seconds: required with one label topic")
            if self.labels == self.impressions:
                raise ValueError("data.join.labels: the label topic is the impressions topic")
            return self
        if self.window_seconds is not None:
            raise ValueError(
                "data.join.window_seconds: with a topic per task, each entry of data.join.labels has its own"
            )
        topics = [self.impressions, *(j.topic for j in self.labels)]
        for i, joined in enumerate(self.labels):
            if joined.topic in topics[: i + 1]:
                raise ValueError(f"data.join.labels[{i}]: topic {joined.topic!r} is named twice")
            if joined.task in (j.task for j in self.labels[:i]):
                raise ValueError(f"data.join.labels[{i}]: task {joined.task!r} has two label topics")
        return self

    @property
    def per_task(self) -> bool:
        """Whether the labels come from a topic per task (a multi-task job's join)."""
        return not isinstance(self.labels, str)

    @property
    def label_topics(self) -> list[str]:
        return [self.labels] if isinstance(self.labels, str) else [j.topic for j in self.labels]

    @property
    def sample_window(self) -> float:
        """How long after its impression a sample is decided at the latest: the window, or the
        shortest of the tasks'."""
        if isinstance(self.labels, str):
            assert self.window_seconds is not None
            return self.window_seconds
        return min(j.window_seconds for j in self.labels)


class EventClock(Strict):
    """Event times the loader's own clock calls wrong: a producer's clock ahead (a time in the
    future) or a replay of old data (a time in the far past). Each is counted in the job's view;
    `clamp` sets its time to the bound (the clock, for one from the future: it never moves the
    watermark past now, which would close every open window at once, nor gives a negative delay),
    `dlq` sends it to the dead-letter topic with the reason."""

    max_future_seconds: PositiveFloat | None = 60.0
    """How far ahead of the loader's clock an event time may be; null: any."""
    max_past_seconds: PositiveFloat | None = None
    """How old an event time may be; null: any age."""
    action: Literal["clamp", "dlq"] = "clamp"
    """What an event outside the bounds gets: its time set to the bound, or the dead-letter topic."""


class KafkaData(Strict):
    """Events from Kafka, trained continuously (`training.epochs: null`). An event is a JSON
    object or a msgpack map per message; the slots, dense columns and the label name its fields by
    dotted path (`user.recent_items`); a list value is a multi-valued slot. Events either carry
    their label (`topics`) or are impressions joined with label events (`join`; the joiner
    sets the label field, or each task's, to "1" or "0"). A message that cannot be a sample goes to the dead-letter
    topic `trillium.<job>.dlq` with the reason and where it came from."""

    source: Literal["kafka"]
    """`kafka`: events from Kafka topics, trained until the job is stopped."""
    bootstrap: Annotated[str, Field(min_length=1)] | None = None
    """The brokers to read from (default: the stack's Kafka); other brokers get none of the
    stack's credentials (TLS kept)."""
    topics: Annotated[list[TopicName], Field(min_length=1)] | None = None
    """Topics of events that carry their own label (or give `join`)."""
    join: JoinConfig | None = None
    """Impressions joined with their labels in event time (or give `topics`)."""
    format: Literal["json", "msgpack"] = "json"
    """An event per message: a JSON object or a msgpack map."""
    key: FieldPath | None = None
    """The event's identity (its sample id); with a join, the join key."""
    group: Annotated[str, Field(min_length=1)] | None = None
    """The consumer group the loaders commit the input offsets to, for outside lag monitors (a
    restart resumes from the job's checkpoint, not from these); default trillium.<job>.input."""
    event_time: FieldPath
    """The field holding the event's time: seconds since the UNIX epoch, a number."""
    start: Literal["earliest", "latest"] = "earliest"
    """Where a new job starts reading its topics."""
    on_gap: Literal["fail", "skip"] = "fail"
    """What a loader does when records it was to read next are gone from an input topic (its
    retention passed the job's position: a job stopped for long, or far behind): `fail` the job
    with an error naming the topic, partition and offsets lost; `skip` them, counted in the job
    view (`stream.skipped`) and `/metrics` (`trillium_job_input_skipped_records`)."""
    max_message_bytes: Annotated[int, Field(ge=64, le=1 << 26)] = 1 << 20
    """A larger message goes to the dead-letter topic."""
    batch_timeout_seconds: PositiveFloat = 1.0
    """A partial step goes out after this long without enough events to fill it: the delay from
    an event to its training stays bounded when the stream is slow."""
    max_steps_ahead: PositiveInt = 64
    """Steps the loaders may produce ahead of training: beyond it they stop reading and the
    input's lag grows (nothing is buffered without bound)."""
    fetch_min_bytes: Annotated[int, Field(ge=1, le=1 << 26)] = 1 << 17
    """A loader's fetch waits until it has this many bytes, or for `fetch_max_wait_ms`: a stream
    of a few thousand events a second is read in tens of fetches a second, not one per producer
    request (each fetch costs the broker and the loader a round whatever it brings: at 3,000
    impressions/s this halved the loader's CPU and took a third off the broker's)."""
    fetch_max_wait_ms: Annotated[int, Field(ge=0, le=10_000)] = 50
    """The longest a fetch waits for `fetch_min_bytes`: at most this added to an event's delay."""
    clock: EventClock = Field(default_factory=EventClock)
    """Event times the loader's clock calls wrong: what is done with them."""

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
        return [self.join.impressions, *self.join.label_topics] if self.join is not None else list(self.topics or [])

    @property
    def event_key(self) -> str | None:
        return self.join.key if self.join is not None else self.key


DataConfig = Annotated[
    AdultData | CriteoData | CsvData | ParquetData | SyntheticData | KafkaData, Field(discriminator="source")
]
