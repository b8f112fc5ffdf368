"""A worker's silence while Redis was out of the coordinator's reach is not held against it,
whichever of the coordinator's reads Redis answers first once it is back (the real Redis,
reached through a relay of the test's own that can hold a connection's traffic)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

import pytest

from trillium.services.coordinator import registry as registry_module
from trillium.services.coordinator.registry import Replaced, WorkerRegistration, WorkerRegistry
from trillium.wire import state

HEARTBEAT_S = 0.2  # a worker is lost after 5 of these: 1 s


class HoldingRelay:
    """TCP to Redis; `hold()` stops the traffic of the connections open now (a partition of
    those), while connections made afterwards pass."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.held: list[asyncio.Event] = []
        self.flowing: list[asyncio.Event] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        for flowing in self.flowing:
            flowing.clear()
        self.held, self.flowing = self.flowing, []

    def release(self) -> None:
        for flowing in self.held:
            flowing.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        flowing = asyncio.Event()
        flowing.set()
        self.flowing.append(flowing)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    await flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        self.release()
        self.server.close()


@pytest.mark.parametrize("first", ["a new read", "the listener's"])
async def test_whichever_read_redis_answers_first_after_a_gap_no_worker_is_lost(infra, first) -> None:
    """Nothing but the registry's listener asks Redis during the gap (the coordinator's other
    loops held up on calls of their own); once Redis is back, either a read on a new connection is
    answered before the listener's, or the listener's first."""
    url = urlsplit(infra.redis_database(10))
    relay = HoldingRelay(url.hostname, url.port)
    port = await relay.start()
    redis = state.connect(f"redis://127.0.0.1:{port}{url.path}")
    listening = None
    try:
        await redis.flushdb()
        registry = WorkerRegistry(redis, HEARTBEAT_S)
        reg = WorkerRegistration(name="embedding_ps-0", role="embedding_ps", index=0, http_url="http://x", pid=1)
        await registry.register(reg)
        assert [w.status for w in await registry.workers()] == ["starting"]
        listening = asyncio.create_task(registry.listen())
        await asyncio.sleep(HEARTBEAT_S)
        relay.hold()  # every connection open now is cut off: the listener's next ask waits
        await asyncio.sleep(registry.lost_after_s + 0.5)  # no heartbeat could have been recorded
        if first == "the listener's":
            relay.release()
            await asyncio.sleep(HEARTBEAT_S)
        statuses = [w.status for w in await registry.workers()]
        assert statuses == ["starting"], "silence during the gap counted as the worker's"
        relay.release()
        # Silence from now on counts: no heartbeat for longer than the bound, and it is lost.
        await asyncio.sleep(registry.lost_after_s + 0.5)
        assert [w.status for w in await registry.workers()] == ["lost"]
    finally:
        if listening is not None:
            listening.cancel()
        await redis.flushdb()
        await redis.aclose()
        await relay.close()


async def test_a_restarted_coordinator_lets_a_moved_worker_take_a_silent_name_over_at_once(infra) -> None:
    redis = state.connect(infra.redis_database(10))
    try:
        await redis.flushdb()
        old = WorkerRegistration(
            name="embedding_ps-1", role="embedding_ps", index=1, http_url="http://10.0.0.5:8080", pid=7
        )
        await WorkerRegistry(redis, HEARTBEAT_S).register(old)
        moved = old.model_copy(update={"http_url": "http://10.0.0.9:8080", "pid": 8})
        restarted = WorkerRegistry(redis, HEARTBEAT_S)  # a new coordinator process: it has listened for no time
        with pytest.raises(Replaced):  # the holder was heard from just now: a partitioned original is fenced
            await restarted.register(moved)
        await asyncio.sleep(restarted.lost_after_s + 0.2)  # the holder silent for a loss's worth
        again = WorkerRegistry(redis, HEARTBEAT_S)  # restarted once more, its state machine reading first
        assert [w.name for w in await again.workers()] == ["embedding_ps-1"]
        worker = await again.register(moved)  # at once: first sight of a record is no heartbeat heard
        assert worker.http_url == "http://10.0.0.9:8080" and worker.pid == 8
    finally:
        await redis.flushdb()
        await redis.aclose()


class _ShiftedClock:
    """The `time` module as the registry sees it, with the wall clock moved by `shift_s`: a clock
    jump on the coordinator's host (NTP stepping it, an operator's `date -s`)."""

    def __init__(self) -> None:
        self.shift_s = 0.0

    def time(self) -> float:
        return time.time() + self.shift_s

    def monotonic(self) -> float:
        return time.monotonic()

    def strftime(self, fmt: str, t: time.struct_time) -> str:
        return time.strftime(fmt, t)

    def gmtime(self, seconds: float) -> time.struct_time:
        return time.gmtime(seconds)


@pytest.mark.parametrize("jump_s", [-600.0, 600.0])
async def test_a_wall_clock_jump_neither_hides_a_loss_nor_makes_one(infra, monkeypatch, jump_s) -> None:
    """Set back, the wall clock would make a silent worker look heard from for 10 minutes; set
    forward, every worker would look silent for 10 minutes at once. Liveness keeps to the
    coordinator's monotonic clock, so neither happens."""
    clock = _ShiftedClock()
    monkeypatch.setattr(registry_module, "time", clock)
    redis = state.connect(infra.redis_database(10))
    try:
        await redis.flushdb()
        registry = WorkerRegistry(redis, HEARTBEAT_S)
        reg = WorkerRegistration(name="embedding_ps-0", role="embedding_ps", index=0, http_url="http://x", pid=1)
        await registry.register(reg)
        clock.shift_s = jump_s
        await registry.heartbeat(reg.name, {"pid": 1, "status": "ok"})
        clock.shift_s = -jump_s  # and back past where it was, as a stepped clock overshoots
        assert [w.status for w in await registry.workers()] == ["healthy"], "a worker heard from just now was lost"
        await asyncio.sleep(registry.lost_after_s + 0.5)  # then silence for longer than the bound
        assert [w.status for w in await registry.workers()] == ["lost"], "the clock jump hid the worker's loss"
    finally:
        await redis.flushdb()
        await redis.aclose()


async def test_a_worker_this_coordinator_never_heard_is_not_lost_at_first_sight(infra) -> None:
    """A record read before this process heard of its worker (another coordinator process wrote
    it; a deregistration crossing a new registration leaves one so) counts its silence from its
    first sight, however long this process has listened: not from when it started."""
    redis = state.connect(infra.redis_database(10))
    try:
        await redis.flushdb()
        listening = WorkerRegistry(redis, HEARTBEAT_S)
        await asyncio.sleep(listening.lost_after_s + 0.5)  # listening for longer than a loss
        reg = WorkerRegistration(name="nn_worker-0", role="nn_worker", index=0, http_url="http://x", pid=9)
        await WorkerRegistry(redis, HEARTBEAT_S).register(reg)  # written by another process
        assert [w.status for w in await listening.workers()] == ["starting"], "lost at first sight"
        await asyncio.sleep(listening.lost_after_s + 0.5)
        assert [w.status for w in await listening.workers()] == ["lost"], "silence after first sight not counted"
    finally:
        await redis.flushdb()
        await redis.aclose()
