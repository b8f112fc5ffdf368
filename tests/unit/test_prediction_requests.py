"""A gRPC prediction request's bytes -> instances (trillium.data.requests): what a request may hold
is bounded while it is parsed, so the worst bytes of a size build no more than the bound; and what
is no array of instances is a ValueError, whatever the bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trillium.data.requests import CONTAINERS_PER_INSTANCE, TooManyInstances, decode_instances

BATCH = 16


@pytest.mark.parametrize("format", ["json", "msgpack", ""])
def test_instances_come_back_as_sent(format) -> None:
    instances = [{"C1": "a", "I1": 3, "user": {"recent": ["x", "y"]}}, {}, {"C2": None}]
    raw = msgpack.packb(instances) if format == "msgpack" else json.dumps(instances).encode()
    assert decode_instances(raw, format, BATCH) == instances


@pytest.mark.parametrize("format", ["json", "msgpack"])
def test_one_more_instance_than_the_batch_is_too_many(format) -> None:
    def raw(n: int) -> bytes:
        instances = [{"C1": "a"}] * n
        return msgpack.packb(instances) if format == "msgpack" else json.dumps(instances).encode()

    assert len(decode_instances(raw(BATCH), format, BATCH)) == BATCH
    with pytest.raises(TooManyInstances, match=f"{BATCH + 1} in one request, at most {BATCH}"):
        decode_instances(raw(BATCH + 1), format, BATCH)


def test_a_packed_array_too_long_is_refused_from_its_header() -> None:
    # An array32 header declaring 2**32 - 1 items, with none of them sent.
    with pytest.raises(TooManyInstances, match=f"4294967295 in one request, at most {BATCH}"):
        decode_instances(b"\xdd\xff\xff\xff\xff", "msgpack", BATCH)


@pytest.mark.parametrize(
    ("format", "container"),
    [("msgpack", b"\x80"), ("msgpack", b"\x90"), ("json", b"{}"), ("json", b"[]")],
)
def test_containers_nested_in_instances_are_bounded_in_all(format, container) -> None:
    """Each instance within the batch, and each holding what one may, but in all past the bound:
    refused. A request just inside it parses."""
    per_instance = CONTAINERS_PER_INSTANCE - 1  # the instance's own list counts too

    def raw(items: int) -> bytes:
        if format == "msgpack":
            inner = b"\xdc" + items.to_bytes(2, "big") + container * items
            return b"\xdc" + BATCH.to_bytes(2, "big") + inner * BATCH
        inner = b"[" + b",".join([container] * items) + b"]"
        return b"[" + b",".join([inner] * BATCH) + b"]"

    assert len(decode_instances(raw(per_instance), format, BATCH)) == BATCH
    with pytest.raises(TooManyInstances, match="maps and lists in all|arrays"):
        decode_instances(raw(per_instance + 2), format, BATCH)


@pytest.mark.parametrize(
    ("raw", "format", "why"),
    [
        (b"{}", "json", "expected an array, got dict"),
        (b"\x80", "msgpack", "expected an array, got dict"),
        (b"[" * 100_000 + b"]" * 100_000, "json", "more than"),
        (b"[" * 5_000 + b"]" * 5_000, "json", "nested too deep"),
        (b"\x91" * 5_000 + b"\x90", "msgpack", "instances: "),
        (b"[1e999999, 99" + b"9" * 5000 + b"]", "json", "instances: "),
        (b"\x91\xc1", "msgpack", "instances: "),
        (b"[\xff]", "json", "instances: "),
        (b"\x91\x81\x01\x02", "msgpack", "instances: "),  # an integer key
        (b"[]", "protobuf", "format 'protobuf'"),
    ],
)
def test_what_is_no_array_of_instances_is_a_value_error(raw, format, why) -> None:
    with pytest.raises(ValueError, match=why):
        decode_instances(raw, format, 1024)


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=256), format=st.sampled_from(["json", "msgpack"]))
def test_any_bytes_are_instances_or_a_value_error(raw, format) -> None:
    try:
        instances = decode_instances(raw, format, BATCH)
    except ValueError:
        return
    assert isinstance(instances, list) and len(instances) <= BATCH


WORST = """
import resource
from trillium.data.requests import TooManyInstances, decode_instances

raw = b"\\xdc\\x04\\x00" + (b"\\xdc\\x10\\x00" + b"\\x80" * 4096) * 1024
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode_instances(raw, "msgpack", 1024)
except TooManyInstances:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_the_worst_bytes_of_a_message_build_little() -> None:
    """4 MiB of empty maps in 1024 arrays of 4 Ki (the densest msgpack packs them in arrays it
    takes), at the serving default of 1024 instances: the parse stops at the bound and the peak
    memory of a fresh process barely moves (the maps alone would be over 250 MB)."""
    ran = subprocess.run([sys.executable, "-c", WORST], capture_output=True, text=True, check=True)
    grown_kib = int(ran.stdout)
    assert grown_kib < 32 << 10, f"the peak grew {grown_kib >> 10} MiB"
