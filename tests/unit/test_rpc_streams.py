"""Unary calls as messages on one gRPC bidi stream (trillium.wire.rpc.OrderedStream and
`streamed`): answers in request order whatever order they are ready in, at most `window`
handled at once, the first error ending the stream for every call, and a caller that gives
up never shifting the answers of the others. A real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from trillium.config import GrpcCredentials
from trillium.stack.procs import free_port
from trillium.wire import rpc

CREDS = GrpcCredentials(token="stream-test-token-0123456789")
METHOD = "/test.Echo/Calls"


class _Echo:
    """Answers b"<request>!" after a delay the request names: b"<n>:<ms>"; b"abort" aborts."""

    def __init__(self) -> None:
        self.running = 0
        self.most_at_once = 0
        self.handled: list[bytes] = []
        self.waiting = 0  # handled, answer not ready
        self.most_waiting = 0

    async def _answer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "told to abort")
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await asyncio.sleep(int(request.split(b":")[1]) / 1000)
        finally:
            self.running -= 1
        return request + b"!"

    concurrent = rpc.streamed(window=4)(_answer)
    one_at_a_time = rpc.streamed(window=1)(_answer)

    async def _handle_then_answer_later(self, request: bytes, context: grpc.aio.ServicerContext) -> rpc.Later[bytes]:
        # Handled at once, one at a time (the window); answered after the delay, like a push
        # queued to Kafka in order and answered once acknowledged.
        self.handled.append(request)
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        return rpc.Later(asyncio.ensure_future(self._later(request)))

    async def _later(self, request: bytes) -> bytes:
        try:
            return await self._answer(request, None)
        finally:
            self.waiting -= 1

    answered_later = rpc.streamed(window=1)(_handle_then_answer_later)


async def _serve(echo: _Echo, handler) -> tuple[grpc.aio.Server, str]:
    address = f"127.0.0.1:{free_port()}"
    host, port = address.split(":")
    same = lambda b: b  # noqa: E731
    generic = grpc.method_handlers_generic_handler(
        "test.Echo",
        {"Calls": grpc.stream_stream_rpc_method_handler(handler.__get__(echo), same, same)},
    )
    server = await rpc.serve(host, int(port), CREDS, lambda s: s.add_generic_rpc_handlers((generic,)))
    return server, address


@contextlib.asynccontextmanager
async def _echo_stream():
    echo = _Echo()
    server, address = await _serve(echo, _Echo.concurrent)
    channel = rpc.channel(address, CREDS)
    stream = rpc.OrderedStream(channel.stream_stream(METHOD))
    try:
        yield echo, stream
    finally:
        await stream.close()
        await channel.close()
        await server.stop(None)


async def test_answers_come_in_request_order_though_later_ones_are_ready_first() -> None:
    async with _echo_stream() as (echo, stream):
        requests = [f"{i}:{(8 - i) * 15}".encode() for i in range(8)]  # the first takes longest
        answers = await asyncio.gather(*(stream(r) for r in requests))
        assert answers == [r + b"!" for r in requests]
        assert echo.most_at_once == 4  # the window: handled at once, not one after the other


async def test_a_window_of_one_handles_each_after_the_one_before() -> None:
    echo = _Echo()
    server, address = await _serve(echo, _Echo.one_at_a_time)
    async with rpc.channel(address, CREDS) as channel:
        stream = rpc.OrderedStream(channel.stream_stream(METHOD))
        answers = await asyncio.gather(*(stream(f"{i}:5".encode()) for i in range(6)))
        await stream.close()
    await server.stop(None)
    assert answers == [f"{i}:5!".encode() for i in range(6)]
    assert echo.most_at_once == 1


async def test_answers_handed_later_overlap_and_still_come_in_order() -> None:
    echo = _Echo()
    server, address = await _serve(echo, _Echo.answered_later)
    async with rpc.channel(address, CREDS) as channel:
        stream = rpc.OrderedStream(channel.stream_stream(METHOD))
        requests = [f"{i}:{(6 - i) * 40}".encode() for i in range(6)]  # the first answer comes last
        sent = [await stream.send(r) for r in requests]  # all written before any is answered
        answers = await asyncio.gather(*sent)
        await stream.close()
    await server.stop(None)
    assert answers == [r + b"!" for r in requests]
    assert echo.handled == requests
    assert echo.most_waiting == 6  # every answer pending at once, with a window of one


async def test_an_abort_ends_the_stream_for_the_calls_pending_and_those_after() -> None:
    async with _echo_stream() as (_, stream):
        assert await stream(b"0:0") == b"0:0!"
        slow = asyncio.ensure_future(stream(b"1:300"))
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as aborted:
            await stream(b"abort")
        assert aborted.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert aborted.value.details() == "told to abort"
        with pytest.raises(grpc.aio.AioRpcError, match="told to abort"):
            await slow  # asked before the abort, not answered yet: it fails with it
        with pytest.raises(grpc.aio.AioRpcError, match="told to abort"):
            await stream(b"2:0")


async def test_a_caller_that_gives_up_leaves_the_others_their_own_answers() -> None:
    async with _echo_stream() as (_, stream):
        first = asyncio.ensure_future(stream(b"0:200"))
        second = asyncio.ensure_future(stream(b"1:10"))
        await asyncio.sleep(0.02)
        first.cancel()
        assert await second == b"1:10!"
        assert await stream(b"2:0") == b"2:0!"
        assert first.cancelled()


async def test_a_closed_stream_fails_its_pending_calls_and_takes_no_more() -> None:
    async with _echo_stream() as (_, stream):
        pending = asyncio.ensure_future(stream(b"0:5000"))
        await asyncio.sleep(0.05)
        await stream.close()
        with pytest.raises(rpc.StreamEnded):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(rpc.StreamEnded):
            await stream(b"1:0")


async def test_a_stream_without_the_token_is_refused() -> None:
    echo = _Echo()
    server, address = await _serve(echo, _Echo.concurrent)
    async with rpc.channel(address, GrpcCredentials(token="another-token-0123456789")) as channel:
        stream = rpc.OrderedStream(channel.stream_stream(METHOD))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream(b"0:0")
        await stream.close()
    await server.stop(None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert echo.most_at_once == 0
