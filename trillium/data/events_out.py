"""Events on their way out to Kafka, as `trillium replay` sends them: rows encoded as JSON (or
msgpack) event messages a chunk at a time, and a topic's messages in one record batch per
partition.

JSON is written by the native core (`trillium_native.json_rows`) a chunk of rows per call: each
field's column goes over at once (text as strings, numbers as a float64 array and where they are
missing) and is filled into the event's fixed layout, strings quoted and escaped, numbers in
their shortest form, empty cells as null. A row costs no Python dict nor `json.dumps`, and no
Arrow kernel per field either (those were a third of a sender's CPU): a sender on the same two
cores as the stack it feeds takes a fraction of the CPU it would.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from aiokafka import AIOKafkaProducer

import trillium_native
from trillium.data.sources.cells import as_text
from trillium.job import JobConfig

Layout = dict[str, "Layout | int"]  # an event's nested fields: a leaf is its value's index


def nest(event: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = event
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def _layout(paths: Sequence[str]) -> Layout:
    tree: Layout = {}
    for index, path in enumerate(paths):
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ValueError(f"event field {path!r} nests inside {p!r}, which is a value")
            node = child
        if leaf in node:
            raise ValueError(f"event field {path!r} is mapped twice")
        node[leaf] = index
    return tree


def _template(tree: Layout) -> list[str | int]:
    """The JSON text of an event with this layout: literal text, and leaf indices between."""
    out: list[str | int] = []
    for n, (name, child) in enumerate(tree.items()):
        out.append(("{" if n == 0 else ",") + json.dumps(name) + ":")
        out += [child] if isinstance(child, int) else _template(child)
    out.append("}" if tree else "{}")
    return _merged(out)


def _literals_as_bytes(pieces: list[str | int]) -> list[bytes | int]:
    return [p.encode() if isinstance(p, str) else p for p in pieces]


def _merged(pieces: list[str | int]) -> list[str | int]:
    """Adjacent literals joined."""
    out: list[str | int] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out


def _text(text: pa.Array, empty_is_null: bool) -> tuple[list[str | None], bool]:
    """A column of text for `json_rows`: each value as a JSON string (null where missing, or empty
    with `empty_is_null`)."""
    return text.to_pylist(), empty_is_null


def _numbers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A column of numbers for `json_rows`: its values as float64, and where they are missing
    (null or empty)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = pc.if_else(pc.equal(column, ""), pa.scalar(None, column.type), column)
    values = pc.cast(column, pa.float64())
    missing = values.is_null().to_numpy(zero_copy_only=False)
    return values.fill_null(0.0).to_numpy(zero_copy_only=False), missing


def _at(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Event times for `json_rows`: numbers, none missing."""
    times = np.ascontiguousarray(times, np.float64)
    return times, np.zeros(len(times), bool)


class EventEncoder:
    """Rows to event messages: the key and event time at their paths, then each mapped column
    (named by its path's last part) at its path, then, for events that carry it, the label."""

    def __init__(
        self, key_path: str, time_path: str, paths: list[str], dense: set[str], label: str | None, fmt: str
    ) -> None:
        paths = list(dict.fromkeys(paths))  # slots may share a column: the event holds it once
        self.paths, self.dense, self.label, self.fmt = paths, dense, label, fmt
        leaves = [key_path, time_path, *paths, *([label] if label else [])]
        self.key_path, self.time_path = key_path, time_path
        self._event = _literals_as_bytes(_template(_layout(leaves)))
        self._click = _literals_as_bytes(_template(_layout([key_path, time_path])))

    def events(self, rows: pa.Table, keys: list[bytes], times: np.ndarray) -> list[bytes]:
        columns = [rows.column(p.split(".")[-1]).combine_chunks() for p in self.paths]
        label = as_text(rows.column(self.label.split(".")[-1]).combine_chunks()) if self.label else None
        if self.fmt == "msgpack":
            return self._msgpack_events(columns, label, keys, times)
        values = [(keys, False), _at(times)]
        values += [
            _numbers(c) if p in self.dense else _text(as_text(c), True)
            for p, c in zip(self.paths, columns, strict=True)
        ]
        if label is not None:
            values.append(_text(label, False))
        return trillium_native.json_rows(self._event, values)

    def clicks(self, keys: list[bytes], times: np.ndarray) -> list[bytes]:
        if self.fmt == "msgpack":
            out = []
            for key, at in zip(keys, times.tolist(), strict=True):
                click: dict[str, Any] = {}
                nest(click, self.key_path, key.decode())
                nest(click, self.time_path, at)
                out.append(msgpack.packb(click))
            return out
        return trillium_native.json_rows(self._click, [(keys, False), _at(times)])

    def _msgpack_events(
        self, columns: list[pa.Array], label: pa.Array | None, keys: list[bytes], times: np.ndarray
    ) -> list[bytes]:
        texts = [as_text(c).to_pylist() for c in columns]
        labels = label.to_pylist() if label is not None else None
        out = []
        for i, (key, at) in enumerate(zip(keys, times.tolist(), strict=True)):
            event: dict[str, Any] = {}
            nest(event, self.key_path, key.decode())
            nest(event, self.time_path, at)
            for path, text in zip(self.paths, texts, strict=True):
                cell = text[i]
                nest(event, path, None if cell in (None, "") else float(cell) if path in self.dense else cell)
            if labels is not None:
                nest(event, self.label, labels[i])
            out.append(msgpack.packb(event))
        return out


def malformed(kind: int, message: bytes, job: JobConfig) -> bytes:
    """Garbage in place of an event: not JSON (0), a NaN dense value (1), a mapped field missing (2)."""
    if kind == 0:
        return b"{not json"
    event = json.loads(message) if job.data.format == "json" else msgpack.unpackb(message)
    if kind == 1 and job.dense:
        nest(event, job.dense[0].column, math.nan)
        return json.dumps(event).encode()  # NaN: refused as an absurd value
    event.pop(next(iter(event)))
    return json.dumps(event).encode()  # a mapped field missing


class Outbox:
    """A topic's messages in one record batch per partition, each partitioned as a keyed send
    is (Kafka's default partitioner: murmur2 of the key), so other producers of the same keys
    land beside them. `flush` sends what is queued; `delivered` waits for every batch's acks."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, partitions: list[int]) -> None:
        self._producer, self._topic, self._partitions = producer, topic, partitions
        self._batches: dict[int, Any] = {}  # partition -> aiokafka BatchBuilder
        self._deliveries: list[asyncio.Future] = []

    @classmethod
    async def open(cls, producer: AIOKafkaProducer, topic: str) -> Outbox:
        return cls(producer, topic, sorted(await producer.partitions_for(topic)))

    async def add(self, keys: list[bytes], values: list[bytes]) -> None:
        partitions = trillium_native.kafka_partitions(keys, len(self._partitions)).tolist()
        for key, value, index in zip(keys, values, partitions, strict=True):
            partition = self._partitions[index]
            batch = self._batches.get(partition)
            if batch is None:
                batch = self._batches[partition] = self._producer.create_batch()
            if batch.append(timestamp=None, key=key, value=value) is None:  # full: send it, start the next
                await self._send(partition)
                batch = self._batches[partition] = self._producer.create_batch()
                if batch.append(timestamp=None, key=key, value=value) is None:
                    raise ValueError(f"a message of {len(value)} bytes is larger than a record batch may be")

    async def flush(self) -> None:
        for partition in list(self._batches):
            await self._send(partition)

    async def delivered(self) -> None:
        await self.flush()
        await asyncio.gather(*self._deliveries)
        self._deliveries.clear()

    async def _send(self, partition: int) -> None:
        batch = self._batches.pop(partition)
        self._deliveries.append(await self._producer.send_batch(batch, self._topic, partition=partition))
        for done in [d for d in self._deliveries if d.done()]:
            done.result()  # a batch that failed for good fails the replay
            self._deliveries.remove(done)
