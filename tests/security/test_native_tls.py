"""The native data plane over TLS, with certificates the stack makes (trillium/stack/tls.py): an
embedding worker's plane serves its ranks over TLS and reaches its PS shards over TLS by the
stack's CA, each shard's certificate checked against its address; a shard whose certificate
another CA signed is refused, the lookup failing with the shard named."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tiny_record import tiny_record
from worker_oracle import encoded, pooled_oracle, random_ids
from worker_plane import METADATA, shard_servers, tiny_shards, worker_plane

from trillium.stack import tls
from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc


def _lookup(port: int, ca: bytes, request: pb.BatchLookupRequest) -> pb.BatchLookupResponse:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = pb_grpc.EmbeddingWorkerStub(channel)
        return next(iter(stub.LookupBatches(iter([request]), metadata=METADATA, timeout=20)))


def test_the_plane_serves_and_calls_its_shards_over_tls_by_the_stacks_ca(tmp_path) -> None:
    stack = tls.ensure(tmp_path / "ours", {"host-0": "127.0.0.1"})
    other = tls.ensure(tmp_path / "theirs", {"host-0": "127.0.0.1"})
    ca = stack.ca_file.read_bytes()
    ours = (stack.cert_file("host-0").read_bytes(), stack.key_file("host-0").read_bytes())
    theirs = (other.cert_file("host-0").read_bytes(), other.key_file("host-0").read_bytes())
    stores, record = tiny_shards(), tiny_record("running", 1)
    ids = random_ids(0)
    request = pb.BatchLookupRequest(batch=encoded(0, ids), training=True, attempt=1)
    with shard_servers(stores, record, tls=ours) as ports, worker_plane(record, ports, tls=ours, ps_tls_ca=ca) as plane:
        answer = _lookup(plane.server.port, ca, request)
        pooled = codec.unpack_array(answer.pooled.data)
        np.testing.assert_allclose(pooled, pooled_oracle(stores, ids), rtol=1e-6, atol=1e-7)
    with (
        shard_servers(tiny_shards(), record, tls=theirs) as ports,
        worker_plane(record, ports, tls=ours, ps_tls_ca=ca) as plane,
    ):
        with pytest.raises(grpc.RpcError) as refused:
            _lookup(plane.server.port, ca, request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "embedding_ps-0 at 127.0.0.1:" in refused.value.details(), refused.value.details()
