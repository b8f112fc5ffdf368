"""Prediction requests' instances as training reads its samples: one transform for both paths.

An instance is a mapping with the job's own field names: a Kafka job's event (fields by dotted
path, `user.recent_items`) or a file job's row (its column names). Each field becomes a text
cell as training makes it (`trillium.data.sources.events`: a number as its digits, a boolean as
`true`/`false`, a list as a multi-valued slot), then the job's `Encoder` hashes the slots and
normalizes the dense columns with the statistics the model was trained with — the very code a
stream's data loader runs on its events (`Encoder.check_cells`, `encode_cells`), held to the bits
of the file path by test. A field the instance lacks (or sends as `null`) is a missing value, as an
empty cell is in a file: no ID, a dense value of 0.

What an instance cannot be raises `BadInstance` naming the instance and the field:
not a mapping; a slot value that is no string, number or boolean (or a list of them for a
multi-valued slot); a string longer than training takes; a dense value that is no finite number
(a file job's row may also send it as text, as its file has it; a stream's events may not, as
the stream's own loader refuses them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trillium.data.features import DenseStats, Encoder, TextCells, batch_of
from trillium.data.sources.events import MAX_VALUE_BYTES, MULTI_SEP, BadEvent, scalar_text, stream_encoder_config
from trillium.job import JobConfig, KafkaData
from trillium.wire.batch import Batch

__all__ = ["BadInstance", "InstanceEncoder"]


class BadInstance(ValueError):
    """An instance that cannot be a sample: `index` in the request, the `field` at fault (None: the
    instance itself), and why."""

    def __init__(self, index: int, field: str | None, reason: str) -> None:
        where = f"instances[{index}]" + (f".{field}" if field else "")
        super().__init__(f"{where}: {reason}")
        self.index, self.field, self.reason = index, field, reason


_MISSING = object()


class InstanceEncoder:
    """A job's instances -> a `Batch` (IDs, normalized dense values; labels unused), as its data
    loader would encode the same events or rows."""

    def __init__(self, job: JobConfig, stats: DenseStats) -> None:
        self.stream = isinstance(job.data, KafkaData)
        # A stream's loader joins a list's items with MULTI_SEP and splits every slot on it.
        self.config = stream_encoder_config(job) if self.stream else job
        self.encoder = Encoder(self.config, stats)
        self.slots = [(s.column, s.separator) for s in self.config.slots]
        self.dense = [d.column for d in self.config.dense]

    def _get(self, instance: Mapping[str, Any], path: str) -> Any:
        if not self.stream:
            return instance.get(path, _MISSING)  # a file's column name is one key, dots and all
        node: Any = instance
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def _cells(self, index: int, instance: Any) -> dict[str, str | None]:
        if not isinstance(instance, Mapping):
            raise BadInstance(index, None, f"expected an object, got {type(instance).__name__}")
        cells: dict[str, str | None] = {}
        try:
            for column, separator in self.slots:
                value = self._get(instance, column)
                if type(value) is str and value.isascii() and len(value) <= MAX_VALUE_BYTES and MULTI_SEP not in value:
                    cells[column] = value  # scalar_text's answer, without its checks' cost (most values)
                elif value is _MISSING or value is None:
                    cells[column] = None
                elif isinstance(value, list):
                    if separator is None:
                        raise BadInstance(index, column, "a list for a slot of one value per sample")
                    cells[column] = separator.join(scalar_text(column, v) for v in value if v is not None)
                else:
                    cells[column] = scalar_text(column, value)
            for column in self.dense:
                value = self._get(instance, column)
                if value is _MISSING or value is None:
                    cells[column] = None
                elif isinstance(value, str) and not self.stream:
                    cells[column] = scalar_text(column, value)  # as the file has it; parsed as training parses it
                elif isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise BadInstance(index, column, f"expected a finite number, got {value!r:.80}")
                else:
                    cells[column] = scalar_text(column, value)
        except BadEvent as err:
            raise BadInstance(index, _field_of(str(err)), str(err)) from None
        return cells

    def batch(self, instances: Sequence[Any]) -> Batch:
        """The instances as one batch (rank 0, batch 0); `BadInstance` for the first that cannot be one."""
        rows = [self._cells(i, instance) for i, instance in enumerate(instances)]
        columns = {column: [row[column] for row in rows] for column in [*(c for c, _ in self.slots), *self.dense]}
        cells = TextCells.of_columns(self.encoder.job, columns, labelled=False)
        checked = self.encoder.check_cells(cells, lambda i: (i, ""), file="request", labelled=False)
        if checked.bad:
            bad = checked.bad[0]
            raise BadInstance(bad.line, _field_of(bad.reason), bad.reason)
        return batch_of(self.config, self.encoder.encode_cells(cells, checked), batch_id=0, rank=0)


def _field_of(reason: str) -> str | None:
    """The field a reason names (`field 'x': ...` or `x: ...`), when it names one."""
    if reason.startswith("field '"):
        return reason[len("field '") :].split("'", 1)[0]
    head, sep, _ = reason.partition(": ")
    return head if sep and " " not in head else None
