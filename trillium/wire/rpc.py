"""gRPC helpers: every server and channel of the project, with the same limits and security.

Every call carries the stack's token (`authorization: Bearer <token>` metadata, attached by the
channel `channel` makes) and every server refuses a call without it as UNAUTHENTICATED — in the
local stack too, so one code path is tested everywhere. TLS is optional (GrpcTls): without
it the token crosses the network in clear, which suits loopback and a private network only.
All our RPCs are unary-unary; a streaming method would need its own deny handler below.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from trillium.config import GRPC_MAX_MESSAGE_BYTES, GrpcCredentials

OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
]
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


class TokenChannel:
    """A grpc.aio channel whose every unary call carries the token in its metadata. Not a client
    interceptor: grpc.aio runs each intercepted call through extra tasks, a quarter more CPU per
    call (on a 2-core host, client and server together: 530 against 425 µs for an empty call)."""

    def __init__(self, channel: grpc.aio.Channel, creds: GrpcCredentials) -> None:
        self._channel = channel
        self._metadata = ((AUTH_METADATA, _bearer(creds)),)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Callable[..., grpc.aio.UnaryUnaryCall]:
        call = self._channel.unary_unary(method, *args, **kwargs)
        token = self._metadata

        def with_token(request: Any, *, metadata: Sequence[tuple[str, str]] = (), **options: Any):
            return call(request, metadata=(*token, *metadata), **options)

        return with_token

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def serve(
    host: str, port: int, creds: GrpcCredentials, register: Callable[[grpc.aio.Server], None]
) -> grpc.aio.Server:
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


def channel(address: str, creds: GrpcCredentials) -> TokenChannel:
    """A channel whose every call carries the token (over TLS when configured)."""
    if creds.tls is None:
        return TokenChannel(grpc.aio.insecure_channel(address, options=OPTIONS), creds)
    tls = grpc.ssl_channel_credentials(root_certificates=_read(creds.tls.ca_file))
    return TokenChannel(grpc.aio.secure_channel(address, tls, options=OPTIONS), creds)
