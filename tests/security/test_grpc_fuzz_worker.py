"""Property-based fuzzing of an embedding worker's gRPC surface, LookupBatches and PushGradients:
its native plane (trillium_native.WorkerServer) over real PS shards on loopback, for the tiny job's
layout, serving ranks 0 and 1 of attempt 3. Batches that are no batch, batches whose slots, IDs or
shapes are not the job's, and gradients of the wrong shape, dtype or count are answered with a
clear code (INVALID_ARGUMENT, or NOT_FOUND for gradients of embeddings never handed out), never
INTERNAL or UNKNOWN; and a good lookup and its push answer as before."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_record import tiny_record
from worker_oracle import pooled_oracle
from worker_plane import METADATA, shard_servers, tiny_shards, worker_plane

from trillium.wire import codec
from trillium.wire.batch import Batch, KeyedIds
from trillium.wire.pb import embedding_pb2 as pb

ATTEMPT = 3
SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingWorker"].full_name
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def server():
    stores = tiny_shards()
    # One rank served, so that each push is a step of its own, answered at once.
    record = tiny_record("running", ATTEMPT)
    with shard_servers(stores, record) as ports, worker_plane(record, ports, ranks=[0]) as plane:
        with grpc.insecure_channel(f"127.0.0.1:{plane.server.port}") as channel:
            yield plane, stores, channel


def call(channel: grpc.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, bytes | None]:
    stream = channel.stream_stream(f"/{SERVICE}/{method}")  # bytes in, bytes out
    try:
        return grpc.StatusCode.OK, next(iter(stream(iter([payload]), metadata=METADATA, timeout=20)))
    except grpc.RpcError as err:
        return err.code(), None


def batch(batch_id: int, rank: int, ids: KeyedIds, size: int, dense: int = 13) -> bytes:
    labels = np.zeros(size, dtype=np.float32)
    return codec.encode_batch(Batch(batch_id, 0, rank, ids, np.zeros((size, dense), np.float32), labels))


def tiny_ids(size: int, seed: int) -> KeyedIds:
    """A batch's IDs as the tiny job's loader makes them: 26 slots, one ID each."""
    keys = tuple(f"c{i}" for i in range(1, 27))
    values = np.random.default_rng(seed).integers(0, 1 << 63, len(keys) * size, dtype=np.uint64)
    return KeyedIds(keys, values, np.ones(len(keys) * size, dtype=np.int32))


def lookup(batch_bytes: bytes, *, training: bool = True, attempt: int = ATTEMPT) -> bytes:
    return pb.BatchLookupRequest(batch=batch_bytes, training=training, attempt=attempt).SerializeToString()


@st.composite
def odd_ids(draw) -> KeyedIds:
    """IDs whose slots are not quite the job's: unknown, missing, repeated counts, many per sample."""
    size = draw(st.integers(1, 6))
    names = draw(
        st.one_of(
            st.just(tuple(f"c{i}" for i in range(1, 27))),
            st.lists(st.sampled_from(["c1", "c2", "c26", "c27", "x", "C1"]), min_size=1, max_size=5, unique=True).map(
                tuple
            ),
        )
    )
    lengths = draw(st.lists(st.integers(0, 4), min_size=len(names) * size, max_size=len(names) * size))
    values = draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=sum(lengths), max_size=sum(lengths)))
    return KeyedIds(names, np.asarray(values, dtype=np.uint64), np.asarray(lengths, dtype=np.int32))


@st.composite
def lookups(draw) -> bytes:
    kind = draw(st.sampled_from(["odd", "dense", "garbage", "empty"]))
    if kind == "garbage":
        body = draw(st.binary(max_size=80))
    elif kind == "empty":
        body = b""
    else:
        ids = draw(odd_ids())
        size = ids.lengths.size // len(ids.keys)
        body = batch(draw(st.integers(0, 1 << 40)), draw(st.integers(0, 1)), ids, size, 13 if kind == "odd" else 5)
    return lookup(body, training=draw(st.booleans()))


def test_bytes_that_are_no_request_are_invalid_argument(server) -> None:
    *_, channel = server
    for method in ("LookupBatches", "PushGradients"):
        for garbage in (b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))):
            assert call(channel, method, garbage)[0] == grpc.StatusCode.INVALID_ARGUMENT, (method, garbage)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=lookups())
def test_lookups_of_batches_that_are_not_the_jobs_are_refused_clearly(server, payload: bytes) -> None:
    *_, channel = server
    code, _ = call(channel, "LookupBatches", payload)
    assert code in CLEAR, code


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(0, 9),
    columns=st.integers(0, 200),
    dtype=st.sampled_from(["float32", "float16", "float64", "int32", "uint8"]),
    extra_slot=st.booleans(),
    known=st.booleans(),
)
def test_gradients_of_the_wrong_shape_dtype_or_batch_are_refused_clearly(
    server, rows: int, columns: int, dtype: str, extra_slot: bool, known: bool
) -> None:
    plane, _, channel = server
    batch_id = 2 * len(plane.steps) + 10_000_000
    code, reply = call(channel, "LookupBatches", lookup(batch(batch_id, 0, tiny_ids(4, batch_id), 4)))
    assert code == grpc.StatusCode.OK, code
    ref = pb.BatchLookupResponse.FromString(reply).ref
    if not known:
        ref.batch_id += 1  # embeddings never handed out
    slots = [pb.SlotGradient(slot="c1", grad=pb.Array(data=codec.pack_array(np.zeros(3, np.float32))))]
    request = pb.PushGradientsRequest(
        ref=ref,
        pooled=pb.Array(data=codec.pack_array(np.zeros((rows, columns)).astype(dtype))),
        slots=slots if extra_slot else [],
    )
    code, _ = call(channel, "PushGradients", request.SerializeToString())
    assert code in CLEAR, code


def test_a_good_lookup_and_push_answer_as_before(server) -> None:
    plane, stores, channel = server
    pushed = len(plane.steps)
    ids = tiny_ids(4, 42)
    code, reply = call(channel, "LookupBatches", lookup(batch(42, 0, ids, 4)))
    assert code == grpc.StatusCode.OK, code
    answer = pb.BatchLookupResponse.FromString(reply)
    pooled = codec.unpack_array(answer.pooled.data)
    assert pooled.shape == (4, sum(answer.widths))
    np.testing.assert_allclose(pooled, pooled_oracle(stores, ids, size=4), rtol=1e-6, atol=1e-7)
    push = pb.PushGradientsRequest(ref=answer.ref, pooled=pb.Array(data=codec.pack_array(np.ones_like(pooled))))
    code, reply = call(channel, "PushGradients", push.SerializeToString())
    assert code == grpc.StatusCode.OK, code
    assert pb.PushGradientsResponse.FromString(reply).messages == 2
    assert [step for _, step, *_ in plane.steps[pushed:]] == [21]  # batch 42 of 2 ranks' steps
