"""Property-based fuzzing of a PS shard's gRPC surface (its native server, `trillium_native.ShardServer`,
and the store it serves, on loopback): bytes that are no protobuf, and
protobufs whose fields disagree (counts against IDs, unknown tables, wrong dtypes, huge counts),
are answered INVALID_ARGUMENT (or UNAVAILABLE, FAILED_PRECONDITION where they say so), never
INTERNAL or UNKNOWN; one for an attempt the shard does not serve is refused and makes no row; and
the shard answers a good lookup exactly as before, and as fast."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_server import shard_server

import trillium_native
from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb

TOKEN = "the-stack-token-0123456789"
DIM = 8
SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingParameterServer"].full_name
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
JOB = ("fuzz-0123abcd", 3)  # the job and attempt the shard serves


class Shard:
    """A real native store holding the table `t`, and what its server reports of its own failures."""

    def __init__(self) -> None:
        self.store = trillium_native.EmbeddingStore(threads=1)
        self.store.create_table("t", DIM, seed=7)
        self.failures: list[str] = []


@pytest.fixture(scope="module")
def server():
    shard = Shard()
    with shard_server(shard.store, TOKEN, JOB, on_failure=shard.failures.append) as native:
        with grpc.insecure_channel(f"127.0.0.1:{native.port}") as channel:
            yield shard, channel


METADATA = (("authorization", f"Bearer {TOKEN}"),)


def lookup_raw(channel: grpc.Channel, payload: bytes) -> bytes:
    call = channel.stream_stream(f"/{SERVICE}/Lookups")  # bytes in, bytes out
    return next(iter(call(iter([payload]), metadata=METADATA, timeout=20)))


def good_lookup(channel: grpc.Channel) -> np.ndarray:
    request = pb.ShardLookupRequest(
        tables=["t"],
        counts=[3],
        ids=pb.Array(data=codec.pack_array(np.arange(3, dtype=np.uint64))),
        job_id=JOB[0],
        attempt=JOB[1],
    )
    reply = pb.ShardLookupResponse.FromString(lookup_raw(channel, request.SerializeToString()))
    return codec.unpack_array(reply.rows.data).reshape(3, DIM)


def status_of(channel: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    try:
        lookup_raw(channel, payload)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_bytes_that_are_no_request_are_invalid_argument(server) -> None:
    _, channel = server
    for garbage in (b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))):
        assert status_of(channel, garbage) == grpc.StatusCode.INVALID_ARGUMENT, garbage
    stats = channel.unary_unary(f"/{SERVICE}/Stats")
    with pytest.raises(grpc.RpcError) as refused:
        stats(b"\x0a\x05abc", metadata=METADATA, timeout=20)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in refused.value.details()


ARRAYS = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda dtype, n: codec.pack_array(np.arange(n).astype(dtype)),
        st.sampled_from(["uint64", "int64", "int32", "float32", "float16", "uint8"]),
        st.integers(0, 40),
    ),
)


@st.composite
def nearly_good(draw) -> bytes:
    """A lookup of the table `t` as an embedding worker sends one, one thing at a time changed
    (or none): duplicate or extreme IDs, counts off by some, the table named twice, another attempt
    or job."""
    ids = draw(st.lists(st.integers(0, (1 << 64) - 1), max_size=50, unique=draw(st.booleans())))
    tables, counts = ["t"], [len(ids)]
    job_id, attempt = JOB
    change = draw(st.sampled_from(["none", "count", "twice", "dtype", "attempt", "job"]))
    if change == "attempt":
        attempt = draw(st.sampled_from([-1, 0, JOB[1] - 1, JOB[1] + 1, (1 << 31) - 1]))
    elif change == "job":
        job_id = draw(st.sampled_from(["", "other-0123abcd", JOB[0] + "\x00"]))
    elif change == "count":
        counts = [len(ids) + draw(st.sampled_from([-1, 1, 1 << 31]))]
    elif change == "twice":
        tables, counts = ["t", "t"], [len(ids) // 2, len(ids) - len(ids) // 2]
    array = np.asarray(ids, dtype=np.uint64)
    if change == "dtype":
        array = array.astype(draw(st.sampled_from(["int64", "float64", "uint32"])))
    return pb.ShardLookupRequest(
        tables=tables,
        counts=counts,
        ids=pb.Array(data=codec.pack_array(array)),
        row_dtype=draw(st.sampled_from(["", "float32", "float16"])),
        read_only=draw(st.booleans()),
        job_id=job_id,
        attempt=attempt,
    ).SerializeToString()


RANDOM = st.builds(
    lambda tables, counts, data, row_dtype, read_only, attempt: pb.ShardLookupRequest(
        tables=tables,
        counts=counts,
        ids=pb.Array(data=data),
        row_dtype=row_dtype,
        read_only=read_only,
        job_id=JOB[0],
        attempt=attempt,
    ).SerializeToString(),
    st.lists(st.sampled_from(["t", "u", "", "t\x00", "é"]), max_size=4),
    st.lists(st.one_of(st.integers(-3, 50), st.sampled_from([-(1 << 63), (1 << 63) - 1, 1 << 40])), max_size=4),
    ARRAYS,
    st.sampled_from(["", "float32", "float16", "int8", "float64", "x" * 100]),
    st.booleans(),
    st.sampled_from([JOB[1], JOB[1], JOB[1] - 1, JOB[1] + 1]),
)
REQUESTS = st.one_of(nearly_good(), RANDOM)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=REQUESTS)
def test_requests_whose_fields_disagree_are_refused_clearly(server, payload: bytes) -> None:
    shard, channel = server
    request = pb.ShardLookupRequest.FromString(payload)
    rows = shard.store.num_rows("t")
    code = status_of(channel, payload)
    if (request.job_id, request.attempt) == JOB:
        assert code == grpc.StatusCode.OK or code in CLEAR, code
        return
    # Another attempt or job: refused, and no row made (an earlier attempt is fenced out).
    fenced = request.job_id == JOB[0] and request.attempt < JOB[1]
    refused = grpc.StatusCode.FAILED_PRECONDITION if fenced else grpc.StatusCode.UNAVAILABLE
    assert code in CLEAR | {refused}, code
    assert shard.store.num_rows("t") == rows


def test_the_shard_answers_as_before_and_as_fast_after_the_fuzzing(server) -> None:
    shard, channel = server
    before = good_lookup(channel)
    started = time.perf_counter()
    for _ in range(50):
        np.testing.assert_array_equal(good_lookup(channel), before)
    per_call = (time.perf_counter() - started) / 50
    assert per_call < 0.05, f"a good lookup took {per_call * 1e3:.1f} ms after the fuzzing"
    assert shard.failures == []  # nothing it was sent failed the shard's job
