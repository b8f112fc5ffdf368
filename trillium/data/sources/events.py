"""Events from Kafka as rows: decoding a message, reading the fields a job names, and refusing
what cannot be a sample (it goes to the dead-letter topic with the reason).

A message is one JSON object (or msgpack map). The job's slots, dense columns, label, event time
and key name fields by dotted path (`user.recent_items`). What is checked, per message:

- it decodes, to a mapping, within `max_message_bytes`;
- every field the job maps is present (`null` is a missing value, like an empty cell);
- a slot's value is a string, a number or a boolean, or a list of those (a multi-valued slot);
  no string longer than `MAX_VALUE_BYTES`, none with the separators `FIELD_SEP` or `MULTI_SEP`;
- a dense value is a finite number; the event time a finite number of seconds; the label a
  string, number or boolean.

`EventReader.events` decodes a fetch of messages at once: JSON goes through the native decoder
(`trillium_native.EventDecoder`), which takes the messages it is sure of and leaves every other
one (a malformed one, or one it does not read the way `json.loads` does) to `EventReader.event`,
the reference, which says why it is bad or takes it. So a batch decodes to what the reference
makes of each message, reasons included.

An event keeps its fields' values as one text (`FIELD_SEP` between them, in the order of
`event_fields`; a missing value is empty, as an empty cell is): a joiner holds tens of thousands
of events per window, and a value each as its own string and dict entry was 3 KB an event.
`EventRows` gathers accepted events as the text columns `trillium.data.features` encodes (a list
value is joined with `MULTI_SEP`, which slots of a kafka job split on), with each event's key and
event time.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from time import monotonic
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

import trillium_native

if TYPE_CHECKING:
    from trillium.job import JobConfig, KafkaData

__all__ = [
    "FIELD_SEP",
    "MAX_VALUE_BYTES",
    "MULTI_SEP",
    "BadEvent",
    "Event",
    "EventReader",
    "EventRows",
    "event_columns",
    "event_fields",
    "events_of",
    "packed_values",
    "scalar_text",
    "stream_encoder_config",
]

MULTI_SEP = "\x1f"  # the ASCII unit separator: joins a list value's items into one cell
FIELD_SEP = "\x1e"  # the ASCII record separator: joins an event's field values into one text
MAX_VALUE_BYTES = 1 << 16  # a string value longer than this is no ID: the event is refused
UNREADABLE = "unreadable"  # the reason of a message whose reading failed in a way no check names
ROW_LISTS = ("events", "labels", "times", "arrived")  # an `EventRows`' lists, a row's item in each


class BadEvent(ValueError):
    """A message that cannot be a sample; the message is the reason."""


class Event(NamedTuple):
    """A decoded event: the values of the fields the job maps as one text (see the module's
    docstring; `EventReader.named` gives them by path), its key, its time."""

    values: str
    key: str | None
    time: float


def event_columns(events: Iterable[Event]) -> dict[str, list[Any]]:
    """Events as a checkpoint keeps them: a list per field, not one per event. A restore that
    parsed a short-lived list per event between the texts it kept left the heap fragmented: the
    loader's RSS rose by a tenth at each of a long job's first recoveries."""
    values: list[str] = []
    keys: list[str | None] = []
    times: list[float] = []
    for e in events:
        values.append(e.values)
        keys.append(e.key)
        times.append(e.time)
    return {"values": values, "keys": keys, "times": times}


def events_of(columns: Mapping[str, list[Any]]) -> Iterator[Event]:
    """The events of `event_columns`."""
    return map(Event, columns["values"], columns["keys"], columns["times"])


def event_fields(job: JobConfig) -> list[tuple[str, str]]:
    """The fields an event of `job` carries, in their order: (path, kind), kind slot, dense or
    label (the labels only where no joiner sets them: a one-label job's label last; a multi-task
    job's tasks' labels and masks, each once)."""
    fields = [(s.column, "slot") for s in job.slots] + [(d.column, "dense") for d in job.dense]
    if job.data.join is None:  # type: ignore[union-attr]
        fields += [(path, "label") for path in label_paths(job)]
    return fields


def label_paths(job: JobConfig) -> list[str]:
    """The fields an event carries its labels in: the label's, or each task's and mask's."""
    return list(dict.fromkeys(c for t in job.tasks for c in (t.column, t.mask) if c is not None))


def packed_values(values: Mapping[str, str | None], paths: Sequence[str]) -> str:
    """Field values by path (checkpoints of format 1 kept them so) as an event's one text."""
    return FIELD_SEP.join(values.get(p) or "" for p in paths)


def _at(event: Mapping[str, Any], path: str) -> Any:
    node: Any = event
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise BadEvent(f"missing field {path!r}")
        node = node[part]
    return node


def _short_repr() -> reprlib.Repr:
    """What a reason shows of a value: bounded, as a value from outside may be an integer of
    thousands of digits or a list nested hundreds deep (a full repr of which recurses as deep)."""
    short = reprlib.Repr()  # Python 3.11's takes no arguments
    short.maxlevel = 3
    short.maxstring = 60
    short.maxlong = 40
    short.maxother = 60
    return short


_SHORT = _short_repr()


def _finite(value: Any) -> float | None:
    """A number as the finite float it is, or None: not a number (a boolean is none), not finite,
    or an integer too large for a float (JSON has no bound on an integer's digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def scalar_text(path: str, value: Any) -> str:
    """A scalar field value as the text cell training hashes and parses (`BadEvent` if it cannot be one)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadEvent(f"field {path!r}: non-finite value {value!r}")
        return repr(value)
    if isinstance(value, str):
        try:
            size = len(value.encode())
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): no UTF-8 text to hash
            raise BadEvent(f"field {path!r}: a string that is not valid Unicode") from None
        if size > MAX_VALUE_BYTES:
            raise BadEvent(f"field {path!r}: a string of {size} bytes (at most {MAX_VALUE_BYTES})")
        if MULTI_SEP in value or FIELD_SEP in value:
            raise BadEvent(f"field {path!r}: the control character \\x1e or \\x1f in a value")
        return value
    raise BadEvent(f"field {path!r}: expected a string, number or boolean, got {type(value).__name__}")


def stream_encoder_config(job: JobConfig) -> JobConfig:
    """The job as its stream's encoder takes it: every slot split on `MULTI_SEP`, which joins a
    list value's items (a string value is one ID, whatever the slot's own separator)."""
    slots = [s.model_copy(update={"separator": MULTI_SEP}) for s in job.slots]
    return job.model_copy(update={"slots": slots})


class EventReader:
    """Decodes messages of a kafka job into `Event`s (`BadEvent` says why it cannot)."""

    def __init__(self, job: JobConfig) -> None:
        data: KafkaData = job.data  # type: ignore[assignment]
        self.data = data
        self.slots = [s.column for s in job.slots]
        self.dense = [d.column for d in job.dense]
        self.labels = label_paths(job)
        self.joined = data.join is not None
        fields = event_fields(job)
        self.paths = [p for p, _ in fields]
        self.native = (
            trillium_native.EventDecoder(
                fields, data.event_time, data.event_key, data.max_message_bytes, MAX_VALUE_BYTES, Event
            )
            if data.format == "json"
            else None
        )

    def events(self, raws: Sequence[bytes | None], *, impression: bool = True) -> list[Event | BadEvent]:
        """Each message's event, or the `BadEvent` saying why it is none: `event` of each, in one call."""
        out: list[Event | BadEvent | None]
        if self.native is not None:
            out, undecided = self.native.decode(list(raws), impression)
        else:
            out, undecided = [None] * len(raws), range(len(raws))
        for i in undecided:
            out[i] = self.checked(raws[i], impression=impression)
        return out  # type: ignore[return-value]  # every None was replaced

    def checked(self, raw: bytes | None, *, impression: bool = True) -> Event | BadEvent:
        """`event`, or the `BadEvent` saying why there is none, whatever the bytes: the loader's
        promise is that no message stops it. An error `event` does not anticipate becomes an
        "unreadable" reason naming it (the property test asserts none of its inputs gets one)."""
        try:
            return self.event(raw, impression=impression)
        except BadEvent as err:
            return err
        except Exception as err:  # noqa: BLE001 (a record from outside must never stop the job)
            return BadEvent(f"{UNREADABLE}: {type(err).__name__}: {str(err)[:200]}")

    def decode(self, raw: bytes | None) -> Mapping[str, Any]:
        if raw is None:
            raise BadEvent("empty message (a tombstone)")
        if len(raw) > self.data.max_message_bytes:
            raise BadEvent(f"message of {len(raw)} bytes (max_message_bytes is {self.data.max_message_bytes})")
        try:
            event = json.loads(raw) if self.data.format == "json" else msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException, UnicodeDecodeError) as err:
            raise BadEvent(f"not valid {self.data.format}: {err}") from None
        except RecursionError:  # json's C decoder checks its depth against the interpreter's limit
            raise BadEvent(f"not valid {self.data.format}: nested too deep") from None
        if not isinstance(event, Mapping):
            raise BadEvent(f"expected an object, got {type(event).__name__}")
        return event

    def time_and_key(self, event: Mapping[str, Any]) -> tuple[float, str | None]:
        value = _at(event, self.data.event_time)
        time = _finite(value)
        if time is None:
            raise BadEvent(f"field {self.data.event_time!r} (event time): expected seconds, got {_SHORT.repr(value)}")
        path = self.data.event_key
        key = scalar_text(path, _at(event, path)) if path is not None else None
        return time, key

    def event(self, raw: bytes | None, *, impression: bool = True) -> Event:
        """An event with every mapped field (a label event of a join: its key and time only)."""
        event = self.decode(raw)
        time, key = self.time_and_key(event)
        if not impression:
            return Event("", key, time)
        values: list[str] = []
        for path in self.slots:
            value = _at(event, path)
            if isinstance(value, list):
                values.append(MULTI_SEP.join(scalar_text(path, v) for v in value if v is not None))
            else:
                values.append("" if value is None else scalar_text(path, value))
        for path in self.dense:
            value = _at(event, path)
            if value is not None and _finite(value) is None:
                raise BadEvent(f"field {path!r} (dense): expected a finite number, got {_SHORT.repr(value)}")
            values.append("" if value is None else scalar_text(path, value))
        if not self.joined:
            for path in self.labels:
                value = _at(event, path)
                values.append("" if value is None else scalar_text(path, value))
        return Event(FIELD_SEP.join(values), key, time)

    def named(self, event: Event) -> dict[str, str]:
        """An event's field values by path (an impression's; a label event of a join has none)."""
        return dict(zip(self.paths, event.values.split(FIELD_SEP), strict=True))


def _taken(items: list[Any], indices: list[int]) -> list[Any]:
    """`[items[i] for i in indices]`, by `itemgetter` (in C)."""
    if len(indices) < 2:
        return [items[i] for i in indices]
    return list(itemgetter(*indices)(items))


class EventRows:
    """Accepted events, as the columns of a block of rows for `trillium.data.features`."""

    def __init__(self, job: JobConfig) -> None:
        self.paths = [p for p, _ in event_fields(job)]  # of each event's values, in order
        self.events: list[Event] = []
        # Each event's label (set by the joiner, or read: its last field). A multi-task job's labels
        # are read from each event's values by `trillium.data.features.Encoder.check_cells`, or
        # set by its joiner: a text per task ("1", "0", "" for none), in task order.
        self.labels: list[str | Sequence[str]] = []
        self.times: list[float] = []  # when each became a sample (the click, else the event)
        self.arrived: list[float] = []  # when each was added here (time.monotonic()), oldest first

    def __len__(self) -> int:
        return len(self.events)

    def add(self, event: Event, label: str | Sequence[str] | None = None, time: float | None = None) -> None:
        self.events.append(event)
        # A label read from the event is its last field (`event_fields`).
        self.labels.append(label if label is not None else event.values.rpartition(FIELD_SEP)[2])
        self.times.append(event.time if time is None else time)
        self.arrived.append(monotonic())

    def extend(self, events: list[Event], labels: Sequence[str | Sequence[str]], times: list[float]) -> None:
        """Events with their labels and the times they became samples (a joiner's `Decided`)."""
        self.events += events
        self.labels += list(labels)
        self.times += times
        self.arrived += [monotonic()] * len(events)

    def pick(self, indices: Sequence[int]) -> EventRows:
        """These events (in this order), removed from these (the rest keep their order)."""
        picked = np.asarray(indices, np.int64).tolist()
        left = np.ones(len(self.events), bool)
        left[picked] = False
        kept = np.flatnonzero(left).tolist()
        # A step out of a pool of steps: in C, not a loop.
        chosen = self._part(lambda items: _taken(items, picked))
        for name in ROW_LISTS:
            setattr(self, name, _taken(getattr(self, name), kept))
        return chosen

    def split(self, size: int) -> list[EventRows]:
        """These rows in consecutive parts of `size` (the last may be smaller)."""
        return [self._part(lambda items, at=at: items[at : at + size]) for at in range(0, len(self.events), size)]

    def _part(self, cut: Callable[[list[Any]], list[Any]]) -> EventRows:
        """Rows of these: each of their lists as `cut` makes it of ours."""
        part = EventRows.__new__(EventRows)
        part.paths = self.paths
        for name in ROW_LISTS:
            setattr(part, name, cut(getattr(self, name)))
        return part
