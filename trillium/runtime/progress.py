"""A running job's shared state in Redis (its keys are named in `trillium.wire.state`).

Writers: the PS shards record how far they have applied each rank's gradients; the
embedding workers record the staleness they observed; the NN workers record samples and
loss. Readers: the embedding workers (to enforce the staleness bound) and the
coordinator (progress, metrics, the REST API).

Staleness is counted in steps. NN ranks step in lock-step (DDP), so rank r's s-th batch
belongs to step s. When a lookup for step s runs, its staleness is the number of earlier
steps whose embedding gradients are not yet applied on every shard for every rank:
    staleness(s) = s - applied_steps,   applied_steps = min over (shard, rank) of (last applied step + 1)
A lookup waits while staleness would exceed the bound k: k = 0 is synchronous training.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from trillium.wire import state

logger = logging.getLogger("trillium.runtime.progress")

# Staleness histogram buckets: 0, 1, ..., 15, and "16+" (unbounded async can go far).
STALENESS_BUCKETS = 17
# KEYS[1]: a rank's staleness hash; ARGV: the lookups' count, sum and max, then pairs of a
# bucket's field and its lookups.
RECORD_STALENESS = """
redis.call('HINCRBY', KEYS[1], 'count', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'sum', ARGV[2])
if tonumber(ARGV[3]) > tonumber(redis.call('HGET', KEYS[1], 'max') or '-1') then
    redis.call('HSET', KEYS[1], 'max', ARGV[3])
end
for i = 4, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 0
"""


class StalenessCounts:
    """A rank's training lookups' staleness since it last reported them (`JobProgress.record_staleness`)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.buckets = [0] * STALENESS_BUCKETS
        self.count = self.total = self.max = 0

    def add(self, staleness: int) -> None:
        self.buckets[min(staleness, STALENESS_BUCKETS - 1)] += 1
        self.count += 1
        self.total += staleness
        self.max = max(self.max, staleness)

    def take(self) -> tuple[int, int, int, list[int]] | None:
        """(count, sum, max, per bucket) of the lookups since the last take, and none are left; None if none."""
        if not self.count:
            return None
        taken = (self.count, self.total, self.max, self.buckets)
        self._reset()
        return taken

    def restore(self, taken: tuple[int, int, int, list[int]]) -> None:
        """Put back what a take took (its recording failed): counted with the next ones."""
        count, total, maximum, buckets = taken
        self.count, self.total, self.max = self.count + count, self.total + total, max(self.max, maximum)
        self.buckets = [a + b for a, b in zip(self.buckets, buckets, strict=True)]


@dataclass(frozen=True)
class StepTiming:
    """A rank's steps in its current attempt, and the seconds they spent waiting for their
    embeddings and in the step itself (forward, backward, the dense all-reduce)."""

    steps: int
    lookup_wait_s: float
    step_s: float


@dataclass
class StalenessStats:
    bound: int | None
    max: int = 0
    mean: float = 0.0
    count: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * STALENESS_BUCKETS)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bound": self.bound,
            "max": self.max,
            "mean": round(self.mean, 4),
            "count": self.count,
            "histogram": self.histogram,
        }


class JobProgress:
    """Typed access to one job's keys. The applied watermarks belong to one attempt of the job
    (as the NN ranks' rendezvous does: services/nn_worker/rendezvous.py): a recovered job starts
    them afresh, and nothing a worker of an abandoned attempt still writes can reach the new one."""

    def __init__(self, redis: state.aioredis.Redis, job_id: str, attempt: int = 0) -> None:
        self.redis = redis
        self.job_id = job_id
        self.attempt = attempt
        self.applied_key = state.job_key(job_id, "applied", attempt)  # a hash, and the pub/sub channel
        self._ledger = state.job_key(job_id, "ledger", attempt)
        self._bound = state.job_key(job_id, "staleness_bound")
        self._auto_bound = state.job_key(job_id, "auto_bound")
        self._staleness = state.job_key(job_id, "staleness")
        self._samples = state.job_key(job_id, "samples")
        self._progressive = state.job_key(job_id, "progressive")
        self._series = state.job_key(job_id, "series")
        self._ranks = state.job_key(job_id, "ranks")
        # Not per attempt: a loader's step count of an epoch is the same in every attempt.
        self._loader_steps = state.job_key(job_id, "loader_steps")
        self._dense_stats = state.job_key(job_id, "dense_stats")
        self._record_staleness: Any = None  # the script, registered at its first use

    # ---- applied watermarks (PS) -----------------------------------------------------
    async def set_applied_all(self, shard: int, ranks: int, step: int, ledger: str | None = None) -> None:
        """Record and announce (pub/sub) that `shard` has applied every rank's gradients up to `step` (-1:
        none yet, as a shard restored from no checkpoint says), with its gradient ledger then
        (trillium.runtime.ledger, JSON): written first, so whoever sees the step applied (a
        checkpoint's cut, the evaluation after the last step) finds the ledger that holds it."""
        pipe = self.redis.pipeline(transaction=False)
        if ledger is not None:
            pipe.hset(self._ledger, str(shard), ledger)
        pipe.hset(self.applied_key, mapping={f"{shard}:{rank}": step for rank in range(ranks)})
        pipe.publish(self.applied_key, f"{shard}:{ranks}:{step}")  # one message for the shard's ranks
        await pipe.execute()

    async def applied(self) -> dict[tuple[int, int], int]:
        """The last applied step per (shard, rank)."""
        raw = await self.redis.hgetall(self.applied_key)
        return {(int(k.split(":")[0]), int(k.split(":")[1])): int(v) for k, v in raw.items()}

    async def ledgers(self, attempts: int) -> dict[int, dict[int, Any]]:
        """Each PS shard's last gradient ledger (JSON-ready) in each of attempts 0..attempts-1 that
        has any: the last attempt's are the final model's, an earlier one's what its shards held
        when it was abandoned."""
        pipe = self.redis.pipeline(transaction=False)
        for attempt in range(attempts):
            pipe.hgetall(state.job_key(self.job_id, "ledger", attempt))
        found = await pipe.execute()
        return {a: {int(s): json.loads(v) for s, v in raw.items()} for a, raw in enumerate(found) if raw}

    def watermark(
        self, shards: int, ranks: int, on_change: Callable[["AppliedWatermark"], None] | None = None
    ) -> "AppliedWatermark":
        return AppliedWatermark(self, shards, ranks, on_change=on_change)

    # ---- the staleness bound (live-changeable) -------------------------------------------
    async def set_bound(self, bound: int | None) -> None:
        await self.redis.set(self._bound, "inf" if bound is None else str(bound))

    async def bound(self) -> int | None:
        raw = await self.redis.get(self._bound)
        return None if raw in (None, "inf") else int(raw)

    async def record_staleness(self, rank: int, counts: StalenessCounts) -> None:
        """The lookups' staleness a rank saw since it last recorded them (`counts`, taken) into its
        histogram, count, sum and max: one script call (EVALSHA), with each of the rank's progress
        reports, not one per lookup."""
        taken = counts.take()
        if taken is None:
            return
        count, total, maximum, buckets = taken
        if self._record_staleness is None:
            self._record_staleness = self.redis.register_script(RECORD_STALENESS)
        pairs = [x for b, n in enumerate(buckets) if n for x in (f"b{b}", n)]
        try:
            await self._record_staleness(keys=[f"{self._staleness}:{rank}"], args=[count, total, maximum, *pairs])
        except BaseException:
            counts.restore(taken)
            raise

    async def staleness(self, ranks: int) -> dict[int, StalenessStats]:
        bound = await self.bound()
        out = {}
        for rank in range(ranks):
            raw = await self.redis.hgetall(f"{self._staleness}:{rank}")
            count = int(raw.get("count", 0))
            out[rank] = StalenessStats(
                bound=bound,
                max=int(raw.get("max", 0)),
                count=count,
                mean=int(raw.get("sum", 0)) / count if count else 0.0,
                histogram=[int(raw.get(f"b{b}", 0)) for b in range(STALENESS_BUCKETS)],
            )
        return out

    # ---- training progress (NN workers) ----------------------------------------------
    async def set_training(
        self,
        rank: int,
        *,
        samples: int,
        loss_sum: float,
        steps: int,
        epoch: int,
        last_loss: float | None,
        timing: StepTiming | None = None,
    ) -> None:
        """A rank's totals so far (absolute, so a rank restored from a checkpoint just says them
        again), and its attempt's step timings."""
        fields: dict[str, Any] = {
            f"samples:{rank}": samples,
            f"loss_sum:{rank}": repr(loss_sum),
            f"steps:{rank}": steps,
            f"epoch:{rank}": epoch,
        }
        if timing is not None:
            fields[f"timed_steps:{rank}"] = timing.steps
            fields[f"lookup_wait_s:{rank}"] = repr(timing.lookup_wait_s)
            fields[f"step_s:{rank}"] = repr(timing.step_s)
        if last_loss is not None:
            fields[f"last_loss:{rank}"] = repr(last_loss)
        await self.redis.hset(self._samples, mapping=fields)

    async def set_progressive(self, rank: int, summary: dict[str, Any]) -> None:
        """A rank's progressive validation (trillium.train.progressive_validation.Scores.summary) and recent delays."""
        await self.redis.hset(self._progressive, str(rank), json.dumps(summary))

    async def progressive(self, ranks: int) -> list[dict[str, Any]]:
        raw = await self.redis.hmget(self._progressive, [str(r) for r in range(ranks)])
        return [json.loads(v) for v in raw if v is not None]

    async def append_series(self, point: list[Any], keep: int) -> None:
        """A point of the job's series (time, samples, rolling AUC, loss). Past `keep` points every
        other one goes, the newest kept: the series spans the job's whole life in at most `keep`
        points, the older the coarser (a week-long online job's plot, in a key that stops growing).
        The coordinator is its only writer."""
        if await self.redis.rpush(self._series, json.dumps(point)) > keep:
            points = await self.redis.lrange(self._series, 0, -1)
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(self._series)
            pipe.rpush(self._series, *points[(len(points) - 1) % 2 :: 2])  # the newest's parity
            await pipe.execute()

    async def series(self) -> list[list[Any]]:
        return [json.loads(p) for p in await self.redis.lrange(self._series, 0, -1)]

    async def training(self, ranks: int) -> dict[str, Any]:
        raw = await self.redis.hgetall(self._samples)
        samples = sum(int(raw.get(f"samples:{r}", 0)) for r in range(ranks))
        loss_sum = sum(float(raw.get(f"loss_sum:{r}", 0.0)) for r in range(ranks))
        last = [float(raw[f"last_loss:{r}"]) for r in range(ranks) if f"last_loss:{r}" in raw]
        return {
            "samples": samples,
            "steps": max((int(raw.get(f"steps:{r}", 0)) for r in range(ranks)), default=0),
            "epoch": min((int(raw.get(f"epoch:{r}", 0)) for r in range(ranks)), default=0),
            "mean_loss": loss_sum / samples if samples else math.nan,
            "last_loss": sum(last) / len(last) if last else math.nan,
        }

    async def timings(self, ranks: int) -> dict[int, dict[str, Any]]:
        """Each rank's attempt so far: steps, and the seconds they waited for embeddings and stepped."""
        raw = await self.redis.hgetall(self._samples)
        return {
            r: {
                "steps": int(raw[f"timed_steps:{r}"]),
                "lookup_wait_s": float(raw[f"lookup_wait_s:{r}"]),
                "step_s": float(raw[f"step_s:{r}"]),
            }
            for r in range(ranks)
            if f"timed_steps:{r}" in raw
        }

    async def set_auto_bound(self, choice: dict[str, Any]) -> None:
        """Record what `staleness_bound: auto` chose, then make it the live bound."""
        await self.redis.set(self._auto_bound, json.dumps(choice))
        await self.set_bound(choice["bound"])

    async def auto_bound(self) -> dict[str, Any] | None:
        raw = await self.redis.get(self._auto_bound)
        return json.loads(raw) if raw else None

    # ---- per-rank completion and results ------------------------------------------------
    async def set_rank_result(self, rank: int, result: dict[str, Any]) -> None:
        await self.redis.hset(self._ranks, str(rank), json.dumps(result))

    async def rank_results(self) -> dict[int, dict[str, Any]]:
        return {int(k): json.loads(v) for k, v in (await self.redis.hgetall(self._ranks)).items()}

    async def clear_rank_results(self) -> None:
        """Forget the results of an abandoned attempt (a recovery re-runs what follows its checkpoint)."""
        await self.redis.delete(self._ranks)

    # ---- data loaders' epochs ----------------------------------------------------------------
    async def set_loader_steps(self, epoch: int, loader: int, steps: int) -> None:
        """How many steps loader `loader`'s share of epoch `epoch` takes (every loader pads to the most)."""
        await self.redis.hset(self._loader_steps, f"{epoch}:{loader}", steps)

    async def loader_steps(self, epoch: int, loaders: int) -> list[int] | None:
        """Every loader's step count of `epoch`, once all have said it."""
        raw = await self.redis.hmget(self._loader_steps, [f"{epoch}:{i}" for i in range(loaders)])
        return None if any(v is None for v in raw) else [int(v) for v in raw]

    async def set_dense_stats(self, loader: int, stats: dict[str, dict[str, float]]) -> None:
        """The normalization statistics a loader encodes with now (a model version takes loader 0's)."""
        await self.redis.hset(self._dense_stats, str(loader), json.dumps(stats))

    async def dense_stats(self) -> dict[str, dict[str, float]]:
        raw = await self.redis.hget(self._dense_stats, "0")
        return json.loads(raw) if raw else {}

    async def delete(self) -> None:
        keys = [k async for k in self.redis.scan_iter(match=state.job_keys_pattern(self.job_id))]
        if keys:
            await self.redis.delete(*keys)


class AppliedWatermark:
    """A live view of how many steps are fully applied, for lookups that must wait.

    It follows the PS shards' announcements (pub/sub, so a waiting lookup wakes as soon
    as the gradients it waits for are applied) and re-reads the hash and the bound every
    `refresh_s` — pub/sub drops messages while disconnected, and the bound changes live.
    `on_change(watermark)` is called after each change (the embedding worker's native gate
    follows it so).
    """

    def __init__(
        self,
        progress: JobProgress,
        shards: int,
        ranks: int,
        refresh_s: float = 0.1,
        on_change: Callable[["AppliedWatermark"], None] | None = None,
    ) -> None:
        self.progress = progress
        self.cells = [(s, r) for s in range(shards) for r in range(ranks)]
        self.last: dict[tuple[int, int], int] = {}
        self.bound: int | None = None
        self.loaded = False  # no lookup passes before the bound is known
        self.refresh_s = refresh_s
        self._on_change = on_change
        self._changed = asyncio.Condition()

    @property
    def steps(self) -> int:
        """Steps fully applied on every shard for every rank."""
        return min(self.last.get(cell, -1) for cell in self.cells) + 1

    async def _update(self, last: dict[tuple[int, int], int] | None = None, bound: Any = ...) -> None:
        async with self._changed:
            for cell, step in (last or {}).items():
                self.last[cell] = max(step, self.last.get(cell, -1))
            if bound is not ...:
                self.bound, self.loaded = bound, True
            self._changed.notify_all()
        if self._on_change is not None:
            self._on_change(self)

    async def run(self) -> None:
        """Follow the announcements until cancelled, through Redis restarts (the hash is
        re-read on every reconnection, so nothing announced meanwhile is missed)."""
        while True:
            try:
                await self._follow()
            except (RedisError, OSError) as err:
                logger.warning("applied watermarks: Redis unavailable, reconnecting", extra={"error": str(err)})
                await asyncio.sleep(self.refresh_s)

    async def _follow(self) -> None:
        pubsub = self.progress.redis.pubsub()
        try:
            await pubsub.subscribe(self.progress.applied_key)
            await self._update(await self.progress.applied(), await self.progress.bound())
            loop = asyncio.get_running_loop()
            next_refresh = loop.time() + self.refresh_s
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.refresh_s)
                if message is not None:
                    shard, ranks, step = (int(x) for x in message["data"].split(":"))
                    await self._update({(shard, rank): step for rank in range(ranks)})
                if loop.time() >= next_refresh:
                    await self._update(await self.progress.applied(), await self.progress.bound())
                    next_refresh = loop.time() + self.refresh_s
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def wait_within_bound(self, step: int) -> int:
        """Wait until a lookup for `step` is within the bound; returns its staleness then."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.loaded and (self.bound is None or step - self.steps <= self.bound)
            )
            return max(step - self.steps, 0)

    async def wait_applied(self, steps: int) -> None:
        """Wait until the first `steps` steps are applied on every shard for every rank (an
        evaluation after training reads the tables as the last step left them)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.steps >= steps)
