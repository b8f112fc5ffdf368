"""Redis helpers: the shared state store (coordinator registry, jobs, progress)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisError, TimeoutError

# A restarted Redis (AOF persistence: nothing acknowledged is lost) is back within seconds;
# callers ride that out instead of failing the work in hand. About 30 s of retries.
_RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=40)

KEY_PREFIX = "trillium:"


def key(*parts: object) -> str:
    """All keys live under one prefix so a shared Redis can host other data too."""
    return KEY_PREFIX + ":".join(str(p) for p in parts)


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(
        url,
        decode_responses=True,
        health_check_interval=30,
        retry=_RETRY,
        retry_on_error=[ConnectionError, TimeoutError],
    )


async def wait_for_redis(url: str, timeout_s: float = 30.0) -> None:
    """Block until the server answers PING."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        client = aioredis.from_url(url)  # no retries: this loop is the retry
        try:
            if await client.ping():
                return
        except (RedisError, OSError) as exc:
            last = exc
        finally:
            await client.aclose()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"Redis at {url} did not answer PING in {timeout_s:.0f}s: {last}")
