"""A gRPC prediction request's instances, from their bytes, with the batch cap held during the parse.

`Predict` carries its instances as JSON or msgpack bytes, and both formats make far more memory
than they take: msgpack's `0x80` is one byte and an empty dict of 64, so a message of 8 MiB of
them would be 8 million dicts (half a GB) before anything counted them; JSON's `{}` and `[]` do
the same at half the ratio. So the parse itself counts: a request's top-level array may hold at
most `max_batch` instances (a longer msgpack array is refused from its header, before a byte of
it is parsed; any array inside at most `MAX_MAP_LEN` items), and all its containers together (an instance is a map, a stream event's maps may nest, a
multi-valued slot is a list) at most `CONTAINERS_PER_INSTANCE` a permitted instance. A request
over either bound raises `TooManyInstances` as soon as the count passes it, having built at most
that many containers; what parses to no array of instances raises `ValueError`.

Strings, numbers and byte strings cost about what they take (a Python object per value, the
smallest of which CPython keeps as singletons), so the message's own size cap bounds them.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack

__all__ = ["CONTAINERS_PER_INSTANCE", "FORMATS", "TooManyInstances", "decode_instances"]

FORMATS = ("json", "msgpack")
# Every container (map or list) of a request counts: this many for each instance it may hold.
CONTAINERS_PER_INSTANCE = 64
# A map's keys in one instance: a job has at most a few thousand fields.
MAX_MAP_LEN = 4096


class TooManyInstances(ValueError):
    """A request with more instances (or containers) than a request may hold."""


class _Counted:
    """Counts each container as the parser finishes it; past the limit, the parse stops."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.limit = CONTAINERS_PER_INSTANCE * max_batch + 1
        self.built = 0

    def _count(self) -> None:
        self.built += 1
        if self.built > self.limit:
            raise TooManyInstances(
                f"instances: more than {self.limit - 1} maps and lists in all "
                f"({CONTAINERS_PER_INSTANCE} for each of at most {self.max_batch} instances)"
            )

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._count()
        return value

    def pairs(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        self._count()
        return dict(pairs)

    def list(self, value: list[Any]) -> list[Any]:
        self._count()
        return value


def _packed_array_len(raw: bytes) -> int | None:
    """The length a msgpack array's header declares (None: `raw` starts with no array)."""
    if raw[:1] and 0x90 <= raw[0] <= 0x9F:
        return raw[0] & 0x0F
    if raw[:1] == b"\xdc" and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if raw[:1] == b"\xdd" and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


def decode_instances(raw: bytes, format: str, max_batch: int) -> list[Any]:
    """`raw` (JSON, or msgpack for `format` "msgpack"; "" means JSON) -> its list of instances."""
    format = format or "json"
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: expected 'json' or 'msgpack'")
    counted = _Counted(max_batch)
    try:
        if format == "json":
            # The json module has no hook for a list: an array is a `[`, so counting them bounds
            # the lists (a `[` inside a string counts too, which only errs on the safe side).
            if raw.count(b"[") > counted.limit:
                raise TooManyInstances(f"instances: more than {counted.limit - 1} arrays")
            instances = json.loads(raw, object_pairs_hook=counted.pairs)
        else:
            declared = _packed_array_len(raw)
            if declared is not None and declared > max_batch:
                raise TooManyInstances(f"instances: {declared} in one request, at most {max_batch}")
            instances = msgpack.unpackb(
                raw,
                raw=False,
                object_hook=counted.map,
                list_hook=counted.list,
                max_array_len=max(max_batch, MAX_MAP_LEN),
                max_map_len=MAX_MAP_LEN,
            )
    except TooManyInstances:
        raise
    except RecursionError:
        raise ValueError("instances: nested too deep") from None
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise ValueError(f"instances: {err}") from None
    if not isinstance(instances, list):
        raise ValueError(f"instances: expected an array, got {type(instances).__name__}")
    if len(instances) > max_batch:
        raise TooManyInstances(f"instances: {len(instances)} in one request, at most {max_batch}")
    return instances
