"""Every gRPC call carries the stack's token, and a real service refuses one without it (or
with another) as UNAUTHENTICATED — over plaintext and over TLS."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from tls_files import TOKEN, tls_files

from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_GRPC_TLS_CA,
    ENV_GRPC_TLS_CERT,
    ENV_GRPC_TLS_KEY,
    ENV_KAFKA_BOOTSTRAP,
    ENV_OPERATE_DIGEST,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_TOKEN,
    GrpcCredentials,
    GrpcTls,
)
from trillium.scopes import token_digest
from trillium.stack.procs import free_port
from trillium.wire import rpc
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc


def _start_ps(infra, run_dir: Path, tls: GrpcTls | None) -> tuple[subprocess.Popen, int]:
    """A real embedding_ps process (no coordinator needed to serve Stats)."""
    http_port, grpc_port = free_port(), free_port()
    env = os.environ | {
        ENV_KAFKA_BOOTSTRAP: infra.kafka_bootstrap,
        ENV_REDIS_URL: infra.redis_database(5),
        ENV_COORDINATOR_URL: f"http://127.0.0.1:{free_port()}",
        ENV_TOKEN: TOKEN,
        ENV_OPERATE_DIGEST: token_digest("an-operators-token-0123456789"),
        ENV_RUN_DIR: str(run_dir),
    }
    if tls is not None:
        env |= {
            ENV_GRPC_TLS_CERT: str(tls.cert_file),
            ENV_GRPC_TLS_KEY: str(tls.key_file),
            ENV_GRPC_TLS_CA: str(tls.ca_file),
        }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillium.services.embedding_ps",
            "--index",
            "3",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # With TLS, its HTTP port speaks TLS too (test_rest_tls.py).
    ready = f"{'https' if tls else 'http'}://127.0.0.1:{http_port}/readyz"
    verify = ssl.create_default_context(cafile=str(tls.ca_file)) if tls else True
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"embedding_ps exited with {proc.returncode}"
        try:
            if httpx.get(ready, verify=verify).status_code == 200:
                return proc, grpc_port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "embedding_ps not ready in 60 s"
        time.sleep(0.2)


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def ps(request, infra, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"grpc-auth-{request.param}")
    tls = tls_files(run_dir) if request.param == "tls" else None
    proc, port = _start_ps(infra, run_dir, tls)
    yield f"127.0.0.1:{port}", tls
    proc.terminate()
    proc.wait(30)


async def _stats(address: str, channel: rpc.TokenChannel | grpc.aio.Channel) -> pb.ShardStatsResponse:
    async with channel:
        return await pb_grpc.EmbeddingParameterServerStub(channel).Stats(pb.ShardStatsRequest(), timeout=10)


def _raw_channel(address: str, tls: GrpcTls | None) -> grpc.aio.Channel:
    """A channel that attaches no token of its own."""
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls.ca_file.read_bytes()))


async def test_call_with_the_token_is_answered(ps) -> None:
    address, tls = ps
    reply = await _stats(address, rpc.channel(address, GrpcCredentials(token=TOKEN, tls=tls)))
    assert reply.shard == 3


async def test_call_without_a_token_is_unauthenticated(ps) -> None:
    address, tls = ps
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stats(address, _raw_channel(address, tls))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_call_with_a_wrong_token_is_unauthenticated(ps) -> None:
    address, tls = ps
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stats(address, rpc.channel(address, GrpcCredentials(token=TOKEN + "x", tls=tls)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The same token in another header is no token either.
    channel = _raw_channel(address, tls)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.EmbeddingParameterServerStub(channel).Stats(
                pb.ShardStatsRequest(), metadata=[("x-token", f"Bearer {TOKEN}")], timeout=10
            )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("ps", ["tls"], indirect=True)
async def test_tls_server_refuses_a_plaintext_channel(ps) -> None:
    address, _ = ps
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stats(address, rpc.channel(address, GrpcCredentials(token=TOKEN)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
