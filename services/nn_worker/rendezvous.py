"""The NN ranks' rendezvous: a torch.distributed store kept in the stack's Redis, where the ranks
of one attempt find each other's devices and gloo's (or NCCL's) addresses before their process
group forms.

Why not rank 0's TCPStore: it checks no credential, and answers anyone who reaches its port
(`list_keys()` included), so no key could be kept from a stranger, and a stranger could write
keys or join the group. The stack's Redis already takes its password (over TLS, with
`trillium up --tls`; bound to loopback only, without), and every rank already holds its URL: the
store lives there, and no rank listens on a port for it. Who can read or write the rendezvous
can read and write the stack's state anyway; nobody else can do either.

The contract is c10d's, as TCPStore keeps it (`tests/unit/test_rendezvous.py` compares the two):
values are bytes; `get` and `wait` block until their keys are set, up to the store's timeout;
`add` counts in decimal strings; `compare_set` sets a key only if it holds `expected` (or is
absent and `expected` is empty), and returns what the key holds then (`expected`, when absent).
The methods are called synchronously from torch's C++ threads, so the client is redis-py's
synchronous one (thread-safe: a pool of connections), built from the service's Redis URL. The
Python object must outlive the process group formed through it: its C++ half calls back into
it (new groups, NCCL's monitor), and torch keeps no reference to the Python half.

Every key of an attempt is a field of one Redis hash (`state.job_key(job, "rendezvous",
attempt)`): an attempt's ranks start from an empty store, a stale attempt's ranks cannot reach a
new one's, and a deleted job takes its rendezvous with it. Each write pushes the hash's expiry
to twice the store's timeout after it (nothing lingers): a rank that would read a key later has
been given up on by its peers already.

Not covered here: the connections gloo (or NCCL's bootstrap) then opens between the ranks are
plain TCP without a credential (docs/operations.md, the threat model).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import redis
import torch.distributed as dist
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from trillium.timeouts import REDIS_SOCKET_S
from trillium.wire import state

# As the service's own client (trillium/wire/state.py): a restarted Redis is ridden out, ~30 s.
_RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=40)
# How often a waiting rank looks again: from 2 ms (peers arrive together) to 100 ms (one is late).
_POLL_S = (0.002, 0.1)
T = TypeVar("T")

# KEYS[1]: the hash; ARGV: field, expected, desired, expiry (ms). Returns what the field holds after.
_COMPARE_SET = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if (not current and ARGV[2] == '') or current == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return ARGV[3]
end
return current or ARGV[2]
"""


class RedisStore(dist.Store):
    """A c10d store whose keys are the fields of the Redis hash `key` (the module's docstring)."""

    def __init__(self, client: redis.Redis, key: str, timeout: timedelta) -> None:
        super().__init__()  # the pybind trampoline's C++ half
        self.set_timeout(timeout)
        self._redis = client
        self._key = key
        self._compare_set = client.register_script(_COMPARE_SET)

    @classmethod
    def of_attempt(cls, redis_url: str, job_id: str, attempt: int, timeout: timedelta) -> RedisStore:
        client = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_SOCKET_S,
            socket_connect_timeout=REDIS_SOCKET_S,
            retry=_RETRY,
            retry_on_error=[ConnectionError, TimeoutError],
        )
        return cls(client, state.job_key(job_id, "rendezvous", attempt), timeout)

    def _expiry_ms(self) -> int:
        return int(2 * self.timeout.total_seconds() * 1000)

    def set(self, key: str, value: str | bytes) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key, key, value)
        pipe.pexpire(self._key, self._expiry_ms())
        pipe.execute()

    def get(self, key: str) -> bytes:
        return self._until(lambda: self._redis.hget(self._key, key), [key], self.timeout)

    def add(self, key: str, amount: int) -> int:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrby(self._key, key, amount)
        pipe.pexpire(self._key, self._expiry_ms())
        return int(pipe.execute()[0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._compare_set(keys=[self._key], args=[key, expected, desired, self._expiry_ms()])

    def check(self, keys: list[str]) -> bool:
        return not keys or None not in self._redis.hmget(self._key, keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(lambda: self.check(keys) or None, keys, self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._redis.hdel(self._key, key))

    def num_keys(self) -> int:
        return int(self._redis.hlen(self._key))

    @staticmethod
    def _until(probe: Callable[[], T | None], keys: list[str], limit: timedelta) -> T:
        """What `probe()` returns once it is not None, asking again until `limit` has passed;
        then DistStoreError, as TCPStore raises it."""
        deadline = time.monotonic() + limit.total_seconds()
        pause = _POLL_S[0]
        while (found := probe()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {limit.total_seconds():.1f}s, keys: {keys}")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _POLL_S[1])
        return found


def exchange_idents(store: dist.Store, rank: int, world: int, ident: str) -> list[str]:
    """Every rank's device identity (which host and GPU it trains on), by rank."""
    store.set(f"device/{rank}", ident)
    return [store.get(f"device/{r}").decode() for r in range(world)]
