"""gRPC helpers: every server and channel of the project, with the same limits and security.

Every call carries the stack's token (`authorization: Bearer <token>` metadata, attached by a
client interceptor) and every server refuses a call without it as UNAUTHENTICATED — in the
local stack too, so one code path is tested everywhere. TLS is optional (GrpcTls): without
it the token crosses the network in clear, which suits loopback and a private network only.
All our RPCs are unary-unary; a streaming method would need its own deny handler below.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import grpc

from trillium.config import GrpcCredentials

# A batch's embeddings or a shard's rows can be tens of MiB.
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
AUTH_METADATA = "authorization"


def _bearer(creds: GrpcCredentials) -> str:
    return f"Bearer {creds.token.get_secret_value()}"


async def _deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")


class _RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, creds: GrpcCredentials) -> None:
        self._expected = _bearer(creds).encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        given = next((value for key, value in details.invocation_metadata or () if key == AUTH_METADATA), "")
        # Constant time: how long a refusal takes tells nothing about the token.
        if secrets.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        return self._deny


class _AttachToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, creds: GrpcCredentials) -> None:
        self._header = (AUTH_METADATA, _bearer(creds))

    async def intercept_unary_unary(self, continuation, details: grpc.aio.ClientCallDetails, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return await continuation(details._replace(metadata=metadata), request)


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def serve(host: str, port: int, creds: GrpcCredentials,
                register: Callable[[grpc.aio.Server], None]) -> grpc.aio.Server:
    """Start a server on host:port with the servicers `register` adds; calls need the token."""
    server = grpc.aio.server(options=OPTIONS, interceptors=[_RequireToken(creds)])
    register(server)
    if creds.tls is None:
        server.add_insecure_port(f"{host}:{port}")
    else:
        tls = grpc.ssl_server_credentials([(_read(creds.tls.key_file), _read(creds.tls.cert_file))])
        server.add_secure_port(f"{host}:{port}", tls)
    await server.start()
    return server


def channel(address: str, creds: GrpcCredentials) -> grpc.aio.Channel:
    """A channel whose every call carries the token (over TLS when configured)."""
    interceptors = [_AttachToken(creds)]
    if creds.tls is None:
        return grpc.aio.insecure_channel(address, options=OPTIONS, interceptors=interceptors)
    tls = grpc.ssl_channel_credentials(root_certificates=_read(creds.tls.ca_file))
    return grpc.aio.secure_channel(address, tls, options=OPTIONS, interceptors=interceptors)
