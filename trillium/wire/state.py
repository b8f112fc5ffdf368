"""Redis: the shared state store (the coordinator's worker registry and jobs, a running job's
progress) and its key schema, named here and nowhere else."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisError, TimeoutError

from trillium.config import redact
from trillium.timeouts import REDIS_SOCKET_S

# A restarted Redis (AOF persistence: nothing acknowledged is lost) is back within seconds;
# callers ride that out instead of failing the work in hand. About 30 s of retries.
_RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=40)

# ---- the key schema: every key lives under one prefix, so a shared Redis can host other data too ----
KEY_PREFIX = "trillium:"


def key(*parts: object) -> str:
    return KEY_PREFIX + ":".join(str(p) for p in parts)


WORKERS = key("workers")  # hash: worker name -> its registration and last health (coordinator)
JOBS = key("jobs")  # sorted set: every job id, by creation time
CURRENT_JOB = key("current_job")  # string: the id of the stack's current (or last) job
# pub/sub channel: a job's id whenever its record or the current job changes, so that workers
# heartbeat at once instead of hearing of it with their next periodic heartbeat (coordinator).
JOB_CHANGED = key("job_changed")
FORGETS = key("forgets")  # hash: receipt id -> a forget's receipt (JSON), kept after its job is deleted
FORGET_INTENTS = key("forget_intents")  # hash: receipt id -> a forget not yet done (ForgetIntent JSON)
MODELS = key("models")  # hash: model -> where its versions are (dir, topic), the newest, its job (JSON)

# A job's keys: JOB_KEYS[name] says what each holds; `applied`, `ledger` and `rendezvous` are per attempt.
JOB_KEYS = {
    "record": "string: the JobRecord (config, state, attempt, lineage)",
    "applied": "hash per attempt, and its pub/sub channel: 'shard:rank' -> last step applied",
    "ledger": "hash per attempt: PS shard -> the gradient ledger of its state as of its last applied step (JSON)",
    "staleness_bound": "string: the live bound, 'inf' when unbounded",
    "auto_bound": "string: the bound `staleness_bound: auto` chose and why (JSON), once chosen",
    "staleness": "hash per rank (suffix ':<rank>'): the histogram, count, sum and max observed",
    "samples": "hash: each rank's samples, loss sum, steps, epoch, last loss; its attempt's steps and their lookup-wait and step seconds",
    "progressive": "hash: rank -> its progressive validation summary (JSON)",
    "series": "list: the job's curve, (time, samples, rolling AUC, loss) points (JSON)",
    "ranks": "hash: rank -> its result once it has finished (JSON)",
    "rendezvous": "hash per attempt, expiring: the NN ranks' torch.distributed store (services/nn_worker/rendezvous.py)",
    "loader_steps": "hash: 'epoch:loader' -> the steps that loader's share of the epoch takes",
    "dense_stats": "hash: loader -> the dense normalization statistics it encodes with now (JSON)",
}


def job_key(job_id: str, name: str, attempt: int | None = None) -> str:
    """The key `name` (one of `JOB_KEYS`) of a job, or of one attempt of it."""
    if name not in JOB_KEYS:
        raise KeyError(f"no job key {name!r}; the schema has {sorted(JOB_KEYS)}")
    return key("job", job_id, name) if attempt is None else key("job", job_id, name, attempt)


def job_keys_pattern(job_id: str) -> str:
    """A SCAN pattern matching every key of a job."""
    return key("job", job_id, "*")


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(
        url,
        decode_responses=True,
        health_check_interval=30,
        socket_timeout=REDIS_SOCKET_S,
        socket_connect_timeout=REDIS_SOCKET_S,
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
    raise TimeoutError(f"Redis at {redact(url)} did not answer PING in {timeout_s:.0f}s: {last}")
