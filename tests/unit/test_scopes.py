"""The scopes' keys (trillium.scopes), a registration's address check, and the gRPC servers'
per-method scopes, over a real channel."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from trillium.config import GrpcCredentials
from trillium.scopes import ScopeKeys, token_digest
from trillium.services.coordinator.registry import ElsewhereRegistered, WorkerRegistration, check_caller
from trillium.stack.procs import free_port
from trillium.wire import rpc

TOKENS = {"services": "s" * 32, "operate": "o" * 32, "predict": "p" * 32, "observe": "w" * 32}


def test_a_token_holds_its_scope_and_those_that_accept_it() -> None:
    keys = ScopeKeys({scope: token_digest(token) for scope, token in TOKENS.items()})
    assert keys.granted(TOKENS["predict"], ["predict"]) and keys.granted(TOKENS["operate"], ["predict"])
    assert not keys.granted(TOKENS["services"], ["predict"]) and not keys.granted(TOKENS["observe"], ["predict"])
    assert keys.granted(TOKENS["operate"], ["observe"]) and not keys.granted(TOKENS["predict"], ["observe"])
    assert not keys.granted(TOKENS["operate"], ["services"]) and not keys.granted(TOKENS["services"], ["operate"])
    assert keys.granted(TOKENS["services"], ["services", "operate"])
    assert not keys.granted(None, ["services"]) and not keys.granted("", ["services"])
    without = ScopeKeys({"services": token_digest(TOKENS["services"]), "predict": None})
    assert not without.holds("predict") and not without.granted(TOKENS["predict"], ["predict"])


def _reg(http_url: str, grpc_address: str | None = None) -> WorkerRegistration:
    return WorkerRegistration(
        name="embedding_ps-0", role="embedding_ps", index=0, http_url=http_url, grpc_address=grpc_address, pid=1
    )


def test_a_registration_must_name_the_callers_host() -> None:
    async def check(reg: WorkerRegistration, caller: str | None) -> str | None:
        try:
            await check_caller(reg, caller)
        except ElsewhereRegistered as err:
            return str(err)
        return None

    async def main() -> None:
        assert await check(_reg("http://10.0.0.5:8080", "10.0.0.5:50051"), "10.0.0.5") is None
        assert await check(_reg("http://10.0.0.5:8080"), "::ffff:10.0.0.5") is None  # a dual-stack socket's
        assert await check(_reg("http://127.0.1.1:8080"), "127.0.0.1") is None  # loopback is one host
        assert await check(_reg("http://[::1]:8080"), "127.0.0.1") is None
        assert "calls from 10.0.0.6" in await check(_reg("http://10.0.0.5:8080"), "10.0.0.6")
        assert "registers at 10.0.0.9" in await check(_reg("http://10.0.0.5:8080", "10.0.0.9:50051"), "10.0.0.5")
        assert "calls from 127.0.0.1" in await check(_reg("http://10.0.0.5:8080"), "127.0.0.1")
        assert "unknown" in await check(_reg("http://10.0.0.5:8080"), None)

    asyncio.run(main())


@pytest.mark.parametrize("method", ["/trillium.v1.Serving/Predict", "/trillium.v1.ServingShard/Lookup"])
def test_a_grpc_method_takes_its_scopes_tokens_alone(method) -> None:
    """Predict takes a prediction client's token (or an operator's); every other method the
    services' alone, the method a scope map does not name included."""
    creds = GrpcCredentials(token=TOKENS["services"])
    keys = ScopeKeys({scope: token_digest(token) for scope, token in TOKENS.items()})
    service, name = method.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(service, {name: grpc.unary_unary_rpc_method_handler(_echo)})
    allowed = {"predict", "operate"} if method.endswith("/Predict") else {"services"}

    port = free_port()

    async def run() -> None:
        server = await rpc.serve("127.0.0.1", port, creds, lambda s: s.add_generic_rpc_handlers((handler,)), keys)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(method)
                for scope, token in TOKENS.items():
                    try:
                        answer = await call(b"ping", metadata=(("authorization", f"Bearer {token}"),), timeout=10)
                        assert scope in allowed and answer == b"ping", scope
                    except grpc.aio.AioRpcError as err:
                        assert scope not in allowed and err.code() == grpc.StatusCode.UNAUTHENTICATED, (scope, err)
        finally:
            await server.stop(None)

    asyncio.run(run())


async def _echo(request: bytes, context) -> bytes:
    return request
