"""Property-based fuzzing of a serving replica's gRPC Predict, over a real channel to the stack's
replica serving a trained model, with the token: bytes that are no PredictRequest, instances that
are no JSON or msgpack (or say the other format), values of every type msgpack has (bytes, NaN,
integer keys), unknown models and formats, and more instances than a request may hold are each
answered with the code the proto names (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND), never
INTERNAL or UNKNOWN; and the replica answers the probe exactly as before, and as fast."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import msgpack
import pytest
from fuzzed_instances import FIELDS, INSTANCES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillium.wire.pb import serving_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Serving"].full_name
CLEAR = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
}
# msgpack carries what JSON cannot: bytes, non-finite floats, keys that are no strings.
PACKED_VALUES = st.one_of(
    st.binary(max_size=16),
    st.floats(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.dictionaries(st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=4), max_size=2),
)
PACKED = st.lists(
    st.one_of(st.dictionaries(st.sampled_from(FIELDS), st.one_of(PACKED_VALUES, st.text(max_size=8)), max_size=8)),
    max_size=20,
)


@pytest.fixture(scope="module")
def predict(served):
    channel = grpc.insecure_channel(served.grpc_address)
    call = channel.unary_unary(f"/{SERVICE}/Predict")  # bytes in, bytes out
    metadata = (("authorization", f"Bearer {served.token}"),)

    def send(payload: bytes) -> tuple[grpc.StatusCode, bytes | None]:
        try:
            return grpc.StatusCode.OK, call(payload, metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return err.code(), None

    yield send
    channel.close()


def request(model: str, instances: bytes, format: str) -> bytes:
    return pb.PredictRequest(model=model, instances=instances, format=format).SerializeToString()


def probe_answer(predict, served) -> list[float]:
    code, reply = predict(request(served.model, json.dumps([served.probe] * 4).encode(), "json"))
    assert code == grpc.StatusCode.OK, code
    return list(pb.PredictResponse.FromString(reply).predictions)


@pytest.fixture(scope="module")
def before(predict, served) -> list[float]:
    """The probe's predictions before any fuzzing (the first test asks for them)."""
    return probe_answer(predict, served)


@st.composite
def requests(draw, model: str) -> bytes:
    format = draw(st.sampled_from(["", "json", "msgpack", "msgpack", "JSON", "protobuf", "\x00"]))
    body = draw(
        st.one_of(
            INSTANCES.map(lambda i: json.dumps(i).encode()),
            PACKED.map(msgpack.packb),
            st.binary(max_size=64),
            st.sampled_from([b"{}", b"null", b"[", b"\x91\xc1", b"[[[[[[[[[[[[]]]]]]]]]]]]"]),
        )
    )
    name = draw(st.one_of(st.just(model), st.just(model), st.text(max_size=12)))
    return request(name, body, format)


def test_a_call_without_the_token_or_with_another_is_unauthenticated(served) -> None:
    with grpc.insecure_channel(served.grpc_address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Predict")
        payload = request(served.model, json.dumps([served.probe]).encode(), "json")
        for metadata in ((), (("authorization", "Bearer not-the-stack-token-0123"),), (("authorization", "x"),)):
            with pytest.raises(grpc.RpcError) as refused:
                call(payload, metadata=metadata, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata


def test_grpc_answers_what_rest_answers(predict, served) -> None:
    """The same instances over gRPC (JSON and msgpack) and REST: the same version, the same
    probabilities to the bit (one `predict` behind both)."""
    instances = [served.probe, {"C1": "b", "I1": "7", "C2": "x"}, {}]
    code, reply = predict(request(served.model, msgpack.packb(instances), "msgpack"))
    assert code == grpc.StatusCode.OK, code
    over_grpc = pb.PredictResponse.FromString(reply)
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}) as http:
        over_rest = http.post(f"/v1/models/{served.model}:predict", json={"instances": instances}).json()
    assert over_grpc.version == over_rest["version"]
    assert list(over_grpc.predictions) == pytest.approx(over_rest["predictions"], rel=0, abs=0)


def test_bytes_that_are_no_request_are_invalid_argument(predict, before) -> None:
    for garbage in (b"\xff" * 7, b"\x12\xff\xff\xff\xff\x0f", bytes(range(256))):
        assert predict(garbage)[0] == grpc.StatusCode.INVALID_ARGUMENT, garbage


def test_more_instances_than_a_request_holds_are_resource_exhausted(predict, served) -> None:
    many = json.dumps([served.probe] * 5000).encode()  # the replica takes 1024 a request
    assert predict(request(served.model, many, "json"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert predict(request("no-such-model", b"[]", "json"))[0] == grpc.StatusCode.NOT_FOUND


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_requests_of_any_shape_are_answered_with_a_clear_code(predict, served, data) -> None:
    payload = data.draw(requests(served.model))
    code, _ = predict(payload)
    assert code in CLEAR, (code, pb.PredictRequest.FromString(payload))


def test_the_replica_answers_as_before_and_as_fast_after_the_fuzzing(predict, served, before) -> None:
    started = time.perf_counter()
    for _ in range(50):
        assert probe_answer(predict, served) == before
    per_call = (time.perf_counter() - started) / 50
    assert per_call < 0.05, f"a probe prediction took {per_call * 1e3:.1f} ms after the fuzzing"


def _peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) >> 10


def test_the_worst_requests_are_refused_before_they_are_built(predict, served, before) -> None:
    """The requests that make the most memory of their bytes, each answered with a clear code,
    and the replica's peak memory barely moves: a 64 MiB message, with the token and without
    (refused from its length, past the body cap); 8 MiB of empty msgpack maps in arrays each
    within bounds (8 million dicts, were they built: 500 MB); 8 MB of JSON arrays (2.7 million
    lists: 150 MB); an array header declaring 4 billion instances."""
    peak = _peak_rss_mib(served.pid)
    huge = request(served.model, b"\x90" * (64 << 20), "msgpack")
    assert predict(huge)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.insecure_channel(served.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(f"/{SERVICE}/Predict")(huge, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    maps = b"\xdc\x04\x00" + (b"\x92" + (b"\xdc\x10\x00" + b"\x80" * 4096) * 2) * 1024
    arrays = b"[" + b",".join([b"[" + b"[]," * 2600 + b"[]]"] * 1024) + b"]"
    for instances, format in ((maps, "msgpack"), (arrays, "json"), (b"\xdd\xff\xff\xff\xff", "msgpack")):
        assert predict(request(served.model, instances, format))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    grown = _peak_rss_mib(served.pid) - peak
    assert grown < 100, f"the replica's peak memory grew {grown} MiB"
    assert probe_answer(predict, served) == before
