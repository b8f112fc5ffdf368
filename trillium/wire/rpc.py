"""gRPC helpers: every server and channel of the project, with the same limits and security.

Every call carries a token (`authorization: Bearer <token>` metadata, attached by the channel
`channel` makes): the services' own among the stack's processes, a prediction client's on
`Predict` (METHOD_SCOPES). Every server refuses a call without its method's as UNAUTHENTICATED —
in the local stack too, so one code path is tested everywhere. TLS is optional (GrpcTls): without
it the token crosses the network in clear, which suits loopback and a private network only.

The calls every training step makes (a batch's lookup and its gradients between an NN rank and
its embedding worker, the worker's lookups on the PS shards) ride on long-lived bidi streams,
one call per message (`OrderedStream`, and `streamed` on the servers): no call is set up per
step and the token is checked once per stream (docs/performance.md, "sixth part").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from trillium.config import GRPC_MAX_MESSAGE_BYTES, GrpcCredentials
from trillium.scopes import Scope, ScopeKeys, token_digest
from trillium.timeouts import GRPC_KEEPALIVE_S, GRPC_KEEPALIVE_TIMEOUT_S, GRPC_MIN_PING_INTERVAL_S

# Both ends of every connection ping it (trillium.timeouts): a peer cut off fails its calls in seconds.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", int(GRPC_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(GRPC_KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    *KEEPALIVE,
]
# A server's bounds on what callers may hold open, token or not: streams on one connection (the
# stack opens a handful per peer) and calls in all (past it a call is RESOURCE_EXHAUSTED at once).
MAX_STREAMS_PER_CONNECTION = 128
MAX_CONCURRENT_RPCS = 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    *KEEPALIVE,
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(GRPC_MIN_PING_INTERVAL_S * 1000)),
    ("grpc.http2.min_ping_interval_without_data_ms", int(GRPC_MIN_PING_INTERVAL_S * 1000)),
]
AUTH_METADATA = "authorization"


def _bearer(creds: GrpcCredentials) -> str:
    return f"Bearer {creds.token.get_secret_value()}"


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")


async def _deny_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
    # The stream's first request is read before refusing it: the client's write of it, were it
    # still in flight when the refusal came, would fail in gRPC core, and grpc.aio then reports
    # that failure (INTERNAL, "Internal error from Core") in place of this status.
    async for _ in requests:
        break
    await _deny(None, context)


# The scopes (trillium.scopes) whose token a method takes; every other method takes only the
# services' own: a client of the stack may ask for predictions, and nothing else by gRPC.
METHOD_SCOPES: dict[str, tuple[Scope, ...]] = {"/trillium.v1.Serving/Predict": ("predict",)}
SERVICES_ONLY: tuple[Scope, ...] = ("services",)


class _RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ScopeKeys) -> None:
        self._keys = keys
        self._deny_unary = grpc.unary_unary_rpc_method_handler(_deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(_deny_stream)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        given = next((value for key, value in details.invocation_metadata or () if key == AUTH_METADATA), "")
        token = given[len("Bearer ") :] if given.startswith("Bearer ") else None
        handler = await continuation(details)
        if handler is None or self._keys.granted(token, METHOD_SCOPES.get(details.method, SERVICES_ONLY)):
            return handler
        return self._deny_stream if handler.request_streaming else self._deny_unary


@dataclass(frozen=True)
class _Malformed:
    """A request whose bytes are no message of the method's type."""

    why: str


class _RefuseMalformed(grpc.aio.ServerInterceptor):
    """A request that does not parse is answered INVALID_ARGUMENT naming the method, where gRPC
    would answer INTERNAL ("Exception deserializing request"), a status a caller cannot tell from
    the server's own failure."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        def lenient(raw: bytes) -> Any:
            try:
                return parse(raw)
            except Exception as err:  # noqa: BLE001 (any parse failure is the caller's)
                return _Malformed(f"{type(err).__name__}: {err}")

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse ({request.why})"
            )

        if not handler.request_streaming and not handler.response_streaming:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            behavior = handler.stream_stream

            async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async def parsed() -> AsyncIterator[Any]:
                    async for request in requests:
                        if isinstance(request, _Malformed):
                            await refuse(request, context)
                        yield request

                async for answer in behavior(parsed(), context):
                    yield answer

            return grpc.stream_stream_rpc_method_handler(stream, lenient, handler.response_serializer)
        return handler


class TokenChannel:
    """A grpc.aio channel whose every call carries the token in its metadata. Not a client
    interceptor: grpc.aio runs each intercepted call through extra tasks, a quarter more CPU per
    call (on a 2-core host, client and server together: 530 against 425 µs for an empty call)."""

    def __init__(self, channel: grpc.aio.Channel, creds: GrpcCredentials) -> None:
        self._channel = channel
        self._metadata = ((AUTH_METADATA, _bearer(creds)),)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Callable[..., grpc.aio.UnaryUnaryCall]:
        return self._with_token(self._channel.unary_unary(method, *args, **kwargs))

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Callable[..., grpc.aio.StreamStreamCall]:
        return self._with_token(self._channel.stream_stream(method, *args, **kwargs))

    def _with_token(self, call: Callable[..., Any]) -> Callable[..., Any]:
        token = self._metadata

        def with_token(*request: Any, metadata: Sequence[tuple[str, str]] = (), **options: Any):
            return call(*request, metadata=(*token, *metadata), **options)

        return with_token

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def read_file(path) -> bytes:
    """A TLS file's bytes (a certificate, a key, a CA)."""
    with open(path, "rb") as f:
        return f.read()


def native_server_options(creds: GrpcCredentials | None = None) -> dict[str, Any]:
    """What a native server (`trillium_native.ShardServer`, `WorkerServer`) takes of the stack's
    gRPC settings beside its address and token: TLS from `creds` when it has any, and the limits
    the Python servers here keep."""
    tls = creds.tls if creds is not None else None
    return {
        "tls_cert": read_file(tls.cert_file) if tls else None,
        "tls_key": read_file(tls.key_file) if tls else None,
        "max_message_bytes": GRPC_MAX_MESSAGE_BYTES,
        "keepalive_s": GRPC_KEEPALIVE_S,
        "keepalive_timeout_s": GRPC_KEEPALIVE_TIMEOUT_S,
    }


async def serve(
    host: str,
    port: int,
    creds: GrpcCredentials,
    register: Callable[[grpc.aio.Server], None],
    keys: ScopeKeys | None = None,
    max_receive_bytes: int = GRPC_MAX_MESSAGE_BYTES,
) -> grpc.aio.Server:
    """Start a server on host:port with the servicers `register` adds; a call needs a token of
    its method's scopes (METHOD_SCOPES; `keys`, by default the services' token of `creds` alone),
    and a request that does not parse is refused INVALID_ARGUMENT. A message over
    `max_receive_bytes` is refused RESOURCE_EXHAUSTED from its length prefix, before it is read:
    grpc.aio reads a call's message before the token's check can refuse it, so this cap is also
    what a caller without a token can make the server hold."""
    keys = keys if keys is not None else ScopeKeys({"services": token_digest(creds.token.get_secret_value())})
    server = grpc.aio.server(
        options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)],
        interceptors=[_RequireToken(keys), _RefuseMalformed()],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    register(server)
    if creds.tls is None:
        server.add_insecure_port(f"{host}:{port}")
    else:
        tls = grpc.ssl_server_credentials([(read_file(creds.tls.key_file), read_file(creds.tls.cert_file))])
        server.add_secure_port(f"{host}:{port}", tls)
    await server.start()
    return server


def channel(address: str, creds: GrpcCredentials, extra_options: Sequence[tuple[str, Any]] = ()) -> TokenChannel:
    """A channel whose every call carries the token (over TLS when configured)."""
    options = [*OPTIONS, *extra_options]
    if creds.tls is None:
        return TokenChannel(grpc.aio.insecure_channel(address, options=options), creds)
    tls = grpc.ssl_channel_credentials(root_certificates=read_file(creds.tls.ca_file))
    return TokenChannel(grpc.aio.secure_channel(address, tls, options=options), creds)


Request = TypeVar("Request")
Response = TypeVar("Response")


CLOSE_GRACE_S = 5.0  # how long closing a stream waits for the server to end its side


class StreamEnded(ConnectionError):
    """The stream is over: closed by its client, or ended by its server with calls unanswered."""


class OrderedStream(Generic[Request, Response]):
    """Unary calls as messages on one bidi stream, opened at the first call: `await
    stream(request)` gives that request's answer; the server answers in request order
    (`streamed`). The stream's first error ends it: every call pending and every later one
    raises it (as a broken channel fails unary calls), and whoever made them decides what follows."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open = open_call
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: deque[asyncio.Future[Response]] = deque()
        self._writing = asyncio.Lock()
        self._error: BaseException | None = None

    async def __call__(self, request: Request) -> Response:
        return await (await self.send(request))

    async def send(self, request: Request) -> asyncio.Future[Response]:
        """Write `request` after every one sent before it, and give its answer to await later:
        for a caller that keeps several requests unanswered in order (`await stream(request)`
        waits for each answer before its caller can send the next)."""
        answer: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        try:
            # Shielded: a write cut halfway would leave an answer unclaimed, and every later
            # caller would take the answer meant for the one before it.
            await asyncio.shield(self._send(request, answer))
        except asyncio.CancelledError:
            answer.cancel()  # its answer, when it comes, is dropped
            raise
        return answer

    async def _send(self, request: Request, answer: asyncio.Future[Response]) -> None:
        async with self._writing:
            if self._error is not None:
                if not answer.done():
                    answer.set_exception(self._error)
                return
            if self._call is None:
                self._call = self._open()
                self._reader = asyncio.create_task(self._read(self._call), name="ordered stream reader")
            self._pending.append(answer)
            try:
                await self._call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the stream is over: the reader fails every pending call with its status

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for response in call:
                answer = self._pending.popleft()
                if not answer.done():  # its caller may have given up on it
                    answer.set_result(response)
            error: BaseException = StreamEnded(f"the stream ended with {len(self._pending)} calls unanswered")
        except grpc.aio.AioRpcError as err:
            error = err
        except asyncio.CancelledError:
            error = StreamEnded("the stream was closed")
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        while self._pending:
            answer = self._pending.popleft()
            if not answer.done():
                answer.set_exception(error)

    async def close(self) -> None:
        """End the stream: at once when calls are pending (they raise StreamEnded), else once the
        server has seen its end; a closed stream takes no calls."""
        async with self._writing:
            if self._call is None:
                self._fail(StreamEnded("the stream was closed"))
                return
            assert self._reader is not None
            if not self._pending and not self._call.done():
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await self._call.done_writing()
                await asyncio.wait({self._reader}, timeout=CLOSE_GRACE_S)
            if not self._reader.done():  # calls pending, or a server that does not end its side
                self._call.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)
            self._fail(StreamEnded("the stream was closed"))


@dataclass(frozen=True)
class Later(Generic[Response]):
    """What a `streamed` handler returns when it is done with its request but its answer is not
    ready: the stream handles the requests after it meanwhile, and writes `answer`'s result
    in its turn. For work that must start in request order and completes later (a message
    queued to Kafka in order, answered once acknowledged): handled one at a time, its
    acknowledgements still overlap."""

    answer: Awaitable[Response]


def streamed(*, window: int):
    """Turn a servicer's handler of one request into the handler of a stream of them (an
    OrderedStream's server side): about `window` requests handled at once (1: each after the one
    before), answered in their order. A handler that returns `Later` frees its place in the
    window at once. A handler's error ends the stream with it (a `context.abort`'s status
    included), and the handlers still running are cancelled."""

    def decorate(handle: Callable[[Any, Request, Any], Awaitable[Response | Later[Response]]]):
        @functools.wraps(handle)
        async def stream(servicer: Any, requests: AsyncIterator[Request], context: Any) -> AsyncIterator[Response]:
            answers = _answer_in_order(requests, lambda request: handle(servicer, request, context), window)
            async with contextlib.aclosing(answers):
                async for answer in answers:
                    yield answer

        return stream

    return decorate


async def _answer_in_order(
    requests: AsyncIterator[Request], handle: Callable[[Request], Awaitable[Response | Later[Response]]], window: int
) -> AsyncIterator[Response]:
    # Handlers in request order; then None where the requests ended, or how they broke off.
    handling: asyncio.Queue[asyncio.Future[Response | Later[Response]] | BaseException | None] = asyncio.Queue()
    unanswered = asyncio.Semaphore(window)  # being handled, or handled and waiting for its turn to be answered

    def handled(future: asyncio.Future[Response | Later[Response]]) -> None:
        if not future.cancelled() and future.exception() is None and isinstance(future.result(), Later):
            unanswered.release()

    async def read() -> None:
        try:
            async for request in requests:
                await unanswered.acquire()
                future = asyncio.ensure_future(handle(request))
                future.add_done_callback(handled)
                await handling.put(future)
        except Exception as err:  # noqa: BLE001 - raised where the answers are written
            await handling.put(err)
        else:
            await handling.put(None)

    reader = asyncio.create_task(read(), name="stream request reader")
    try:
        while (item := await handling.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            answer = await item
            if isinstance(answer, Later):
                answer = await answer.answer  # its place in the window was freed when it was handled
            else:
                unanswered.release()
            yield answer
    finally:
        reader.cancel()
        while not handling.empty():
            item = handling.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
                if item.done() and not item.cancelled() and item.exception() is None:
                    _discard(item.result())
                # else retrieved: the stream ended with an earlier error


def _discard(answer: Any) -> None:
    """A Later answer no one will write: cancelled, or its error marked as seen."""
    if isinstance(answer, Later) and isinstance(answer.answer, asyncio.Future):
        answer.answer.cancel()
        if answer.answer.done() and not answer.answer.cancelled():
            answer.answer.exception()
