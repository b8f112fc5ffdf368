"""The worker registry: every registered service instance, kept in Redis so a
coordinator restart forgets nobody."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import Awaitable
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, model_validator

from trillium.config import Role
from trillium.timeouts import LOST_AFTER_MISSED
from trillium.wire import state

logger = logging.getLogger("trillium.coordinator.registry")


class WorkerRegistration(BaseModel):
    name: str = Field(pattern=r"^[a-z_]+-\d+$", max_length=64)
    role: Role
    index: int = Field(ge=0, le=1 << 16)
    http_url: str = Field(max_length=256)
    grpc_address: str | None = Field(None, max_length=256)
    pid: int = Field(ge=0, le=1 << 31)

    @model_validator(mode="after")
    def _name_is_role_and_index(self) -> WorkerRegistration:
        # Jobs find their workers by this name: it must say what the worker is.
        if self.name != f"{self.role}-{self.index}":
            raise ValueError(f"name must be '{self.role}-{self.index}' (role-index), got {self.name!r}")
        return self


class Worker(WorkerRegistration):
    registered_at: float
    last_heartbeat: float
    health: dict[str, Any] = {}
    status: Literal["healthy", "starting", "lost"] = "starting"

    def job_report(self, job_id: str, attempt: int) -> dict[str, Any] | None:
        """What the worker last reported about this attempt of a job (see trillium.runtime.service)."""
        job = self.health.get("job")
        if isinstance(job, dict) and job.get("id") == job_id and job.get("attempt") == attempt:
            return job
        return None

    def job_phase(self, job_id: str, attempt: int) -> str | None:
        """setting_up, ready, done, failed or stopped; None when it said nothing of this attempt."""
        report = self.job_report(job_id, attempt)
        return report.get("phase") if report else None

    def job_final(self, job_id: str, attempt: int) -> bool:
        """Whether it failed this attempt in a way no recovery gets past (`JobCannotRecover`)."""
        report = self.job_report(job_id, attempt)
        return bool(report and report.get("final"))

    def job_error(self) -> str | None:
        job = self.health.get("job")
        return job.get("error") if isinstance(job, dict) else None


class Replaced(Exception):
    """A registration refused: the name is held by a process on another host that is still heard from."""


def _host(url: str) -> str | None:
    return urlsplit(url).hostname


class ElsewhereRegistered(ValueError):
    """A registration names an address the caller does not call from."""


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # a link-local address's zone is no part of it
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


async def check_caller(reg: WorkerRegistration, caller: str | None) -> None:
    """A process registers only at its own host: each host the registration names (its HTTP URL's
    and its gRPC address's) must resolve to the address the call came from, or the holder of the
    services' token could register as `embedding_ps-0` at another machine and be sent that shard's
    lookups and gradients. Loopback addresses are one host: this machine's (a process bound to
    every address advertises its host name, which Debian resolves to 127.0.1.1)."""
    if caller is None:
        raise ElsewhereRegistered(f"{reg.name}: the call's address is unknown, so its registration is refused")
    source = _ip(caller)
    hosts = {_host(reg.http_url)}
    if reg.grpc_address is not None:
        hosts.add(reg.grpc_address.rpartition(":")[0].strip("[]"))
    loop = asyncio.get_running_loop()
    for host in hosts:
        if not host:
            raise ElsewhereRegistered(f"{reg.name}: {reg.http_url!r} names no host")
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as err:
            raise ElsewhereRegistered(f"{reg.name}: its host {host!r} does not resolve here ({err})") from None
        addresses = {_ip(info[4][0]) for info in infos}
        if source not in addresses and not (source.is_loopback and any(a.is_loopback for a in addresses)):
            shown = ", ".join(sorted(map(str, addresses)))
            raise ElsewhereRegistered(
                f"{reg.name} registers at {host} ({shown}) but calls from {source}: a process registers only itself"
            )


class WorkerRegistry:
    def __init__(self, redis: state.aioredis.Redis, heartbeat_s: float) -> None:
        self.redis = redis
        self.heartbeat_s = heartbeat_s
        self.lost_after_s = heartbeat_s * LOST_AFTER_MISSED
        # Heartbeats are heard only while this process runs and reaches Redis, where it records
        # them: silence during a coordinator restart, or while Redis was out of its reach (a read
        # that failed, or took longer than a heartbeat interval), is not the workers' fault.
        # Liveness runs on this process's monotonic clock: a wall clock set back by X would hide
        # every loss for X, one set forward would lose every worker at once. The wall-clock
        # `last_heartbeat` in Redis is for people and for a restarted coordinator's first reads.
        self.listening_since = time.monotonic()
        self._heard: dict[str, float] = {}  # name -> when this process last recorded its heartbeat
        self._seen: dict[str, float] = {}  # name -> when this process first read a record it had not heard
        self._deaf = False
        # When each read now waiting on Redis began: a read answered at once just after Redis
        # came back must not judge silence before the slow ones that span the gap return.
        self._asking: dict[int, float] = {}
        self._reads = itertools.count()
        self._key = state.WORKERS
        # name -> (the record as stored, parsed): the job state machine, the checkpointer and the
        # publisher each read every worker several times a second, and a record changes only
        # with its worker's heartbeat, every 2 s.
        self._parsed: dict[str, tuple[str, Worker]] = {}

    def _parse(self, name: str, raw: str) -> Worker:
        """The stored record `raw` of worker `name`, as a copy of its own to change."""
        cached = self._parsed.get(name)
        if cached is None or cached[0] != raw:
            cached = self._parsed[name] = (raw, Worker.model_validate_json(raw))
        return cached[1].model_copy()

    def _lost(self, worker: Worker, now: float) -> bool:
        """Whether `worker` has been silent for a loss's worth of listening, by the monotonic `now`.
        A record this process has not heard of (registered before it started, or read while its
        deregistration and a new registration cross) counts its silence from its first sight."""
        since = self._heard.get(worker.name)
        if since is None:
            since = self._seen.setdefault(worker.name, now)
        return now - max(since, self.listening_since) > self.lost_after_s

    def _hear(self, name: str) -> None:
        self._heard[name] = time.monotonic()
        self._seen.pop(name, None)

    def _silent_s(self, previous: Worker) -> float:
        """How long the stored holder `previous` has been silent: by this process's own record of
        its heartbeats, or, for one not heard since this process started, by the stored wall clock."""
        heard = self._heard.get(previous.name)
        if heard is not None:
            return time.monotonic() - heard
        return time.time() - previous.last_heartbeat

    async def register(self, reg: WorkerRegistration) -> Worker:
        """Record `reg`, replacing the name's earlier holder: the same process, its restart on the
        same host, or, once the holder has been silent for a worker's loss, a replacement on
        another host. A process of another host does not displace a holder still heard from
        (Replaced): the holder that a partition cut off, come back after its replacement took
        over, is fenced out so. Silence here is the holder's own, however briefly this process
        has listened: a restarted coordinator lets a moved worker (a pod with a new address)
        take its name over at once rather than after a loss's worth of listening."""
        raw = await self.redis.hget(self._key, reg.name)
        previous = Worker.model_validate_json(raw) if raw else None
        if (
            previous is not None
            and previous.pid != reg.pid
            and _host(previous.http_url) != _host(reg.http_url)
            and (silent := self._silent_s(previous)) <= self.lost_after_s
        ):
            raise Replaced(
                f"{reg.name} is held by pid {previous.pid} at {previous.http_url}, heard from "
                f"{silent:.0f} s ago: this process ({reg.http_url}) was replaced"
            )
        # The same process registering again (the coordinator restarted) keeps its job report,
        # so the job state machine does not read its silence as "no phase".
        health = previous.health if previous is not None and previous.pid == reg.pid else {}
        now = time.time()
        worker = Worker(**reg.model_dump(), registered_at=now, last_heartbeat=now, health=health)
        await self.redis.hset(self._key, reg.name, worker.model_dump_json())
        self._hear(reg.name)
        return worker

    async def heartbeat(self, name: str, health: dict[str, Any]) -> Worker | None:
        """Record a heartbeat; None when `name` is not registered by the process sending it
        (the worker then registers again, replacing a stale or foreign registration)."""
        raw = await self.redis.hget(self._key, name)
        if raw is None:
            return None
        worker = self._parse(name, raw)
        if "pid" in health and health["pid"] != worker.pid:
            return None
        worker.last_heartbeat = time.time()
        worker.health = health
        await self.redis.hset(self._key, name, worker.model_dump_json())
        self._hear(name)
        return worker

    async def deregister(self, name: str) -> bool:
        self._heard.pop(name, None)
        self._seen.pop(name, None)
        return bool(await self.redis.hdel(self._key, name))

    async def _read(self, command: Awaitable[Any]) -> tuple[Any, float]:
        """`command`'s answer, and when it came. Any read that failed, or that waited (or that
        sees another still waiting) longer than a heartbeat interval, means Redis was out of
        reach: heartbeats were not being recorded, so workers' silence counts from now."""
        asked = time.monotonic()
        read = next(self._reads)
        self._asking[read] = asked
        try:
            answer = await command
        except Exception:
            self._deaf = True
            raise
        finally:
            del self._asking[read]
        now = time.monotonic()
        waited = now - min([asked, *self._asking.values()])
        if self._deaf or waited > self.heartbeat_s:
            if now - self.listening_since > self.lost_after_s:
                logger.warning(
                    "Redis answers again: workers' silence counted from now", extra={"waited_s": round(waited, 1)}
                )
            self.listening_since = now
            self._deaf = False
        return answer, now

    async def listen(self) -> None:
        """Ask Redis every heartbeat interval, for as long as the coordinator runs: a gap is
        seen even while nothing else reads the registry (the state machine held up on another
        of its calls to Redis), whichever read Redis answers first once it is back."""
        while True:
            with contextlib.suppress(Exception):  # a failure marks the gap; the next ask goes on
                await self._read(self.redis.ping())
            await asyncio.sleep(self.heartbeat_s)

    async def workers(self) -> list[Worker]:
        raw, now = await self._read(self.redis.hgetall(self._key))
        for gone in self._parsed.keys() - raw.keys():
            del self._parsed[gone]
        for known in (self._heard, self._seen):
            for gone in known.keys() - raw.keys():
                del known[gone]
        workers = []
        for name, value in raw.items():
            worker = self._parse(name, value)
            if self._lost(worker, now):
                worker.status = "lost"
            else:
                worker.status = "healthy" if worker.health.get("status") == "ok" else "starting"
            workers.append(worker)
        return sorted(workers, key=lambda w: (w.role, w.index))


def unreachable(name: str, worker: Worker | None, now: float) -> str:
    """What a job waiting for the worker `name` waits for, in words, for the job's view."""
    if worker is None:
        return f"{name} not registered"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(worker.last_heartbeat))
    return f"{name} unreachable since {since} (no heartbeat for {now - worker.last_heartbeat:.0f} s)"


def failure_cause(failed: list[tuple[str, str | None]], lost: list[str], workers: dict[str, Worker]) -> str:
    """One line naming the process at fault: a restarted or silent one if any; else a report
    that names no other failed process (the root, not those that failed calling it), with the
    process it could not reach when its error names that one's address."""
    restarted = [f"{name}: {error}" for name, error in failed if error and "restarted while" in error]
    if restarted:
        return restarted[0]
    if lost:
        return f"lost contact with {', '.join(lost)}"
    reports = [(name, error or "failed") for name, error in failed]
    failing = {name for name, _ in reports}
    name, error = next(
        ((n, e) for n, e in reports if (r := _reached(n, e, workers)) is None or r.name not in failing), reports[0]
    )
    other = _reached(name, error, workers)
    return f"{other.name} unreachable ({name}: {error})" if other is not None else f"{name}: {error}"


def failure_explained(failed: list[tuple[str, str | None]], lost: list[str], workers: dict[str, Worker]) -> bool:
    """Whether the reports say which process is at fault: a silent one, or a report that is not
    a call's error naming no process (its own failure, a restart, or a peer it could not reach).
    gRPC's own "Internal error from Core" (a write racing the status a server ended the stream
    with, which it then hides) names none; the reports that do are seconds behind it."""
    return bool(lost) or any(
        error and (not error.startswith("gRPC ") or _reached(name, error, workers) is not None)
        for name, error in failed
    )


def _reached(name: str, error: str, workers: dict[str, Worker]) -> Worker | None:
    """The other process whose address the error names."""
    for other in workers.values():
        addresses = [a for a in (other.grpc_address, other.http_url.removeprefix("http://")) if a]
        if other.name != name and any(a in error for a in addresses):
            return other
    return None
