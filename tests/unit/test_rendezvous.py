"""The NN ranks' rendezvous (services/nn_worker/rendezvous.py): a store in the stack's Redis,
as `trillium up --tls` runs it (TLS only, a password). A stranger finds no store on rank 0's
ports and is refused by Redis; the store keeps TCPStore's contract; two ranks form a gloo group
through it and gather their scores without a pickle."""

from __future__ import annotations

import asyncio
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
import torch.distributed as dist
from rank_processes import rank_processes, run_ranks
from redis.backoff import NoBackoff
from redis.retry import Retry
from tiny_record import tiny_record

from trillium.config import KafkaConnection, ServiceSettings, StackTopology
from trillium.job.record import JobRecord
from trillium.scopes import token_digest
from trillium.services.nn_worker import evaluate, rendezvous
from trillium.services.nn_worker.server import COLLECTIVE_TIMEOUT, NNWorker
from trillium.services.nn_worker.step import ENV_DEVICE, local_placement
from trillium.stack import tls
from trillium.stack.supervisor import Supervisor
from trillium.wire import state

TIMEOUT = timedelta(seconds=20)
STRANGER_S = 5.0  # how long a stranger's clients may try rank 0's ports


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The stack's Redis as the launcher starts it with TLS; yields (its URL with the password, the CA file)."""
    run_dir = tmp_path_factory.mktemp("guarded")
    launcher = Supervisor(run_dir, StackTopology(), False, "127.0.0.1:9", None, with_tls=True)
    launcher.tls = tls.ensure(run_dir, {"redis": launcher.place.address("redis")})
    asyncio.run(launcher.start_redis())
    try:
        yield launcher.redis_url, launcher.tls.ca_file
    finally:
        launcher.stop_all()


def _worker(rank: int, redis_url: str, run_dir: Path) -> NNWorker:
    settings = ServiceSettings(
        role="nn_worker",
        index=rank,
        http_port=0,
        kafka=KafkaConnection(bootstrap="127.0.0.1:9"),
        redis_url=redis_url,
        coordinator_url="http://127.0.0.1:9",
        token="t" * 16,
        operate_token_sha256=token_digest("o" * 16),
        run_dir=run_dir,
    )
    worker = NNWorker(settings)
    worker.placement = local_placement(rank)
    return worker


def _job(ranks: int, attempt: int) -> JobRecord:
    job = tiny_record(attempt=attempt)
    topology = job.config.topology.model_copy(update={"nn_ranks": ranks})
    return job.model_copy(update={"config": job.config.model_copy(update={"topology": topology})})


def _listening() -> set[int]:
    """The TCP ports this process listens on (its sockets' inodes in /proc/self/net)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            mine.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in mine:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _stranger(port: int, found) -> None:
    """A stranger on rank 0's host, with a TCPStore client at `port` (a process of its own: a
    client hangs on a port that is not a store's): what it lists, reads and writes."""
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=3))
    keys = store.list_keys()
    read = {key: store.get(key) for key in keys}
    store.set("device/1", "stranger-host/cpu")
    found.put((port, keys, read))


def test_a_stranger_can_neither_list_read_write_nor_join_rank_0s_rendezvous(guarded, tmp_path, monkeypatch) -> None:
    url, ca_file = guarded
    monkeypatch.setenv(ENV_DEVICE, "cpu")
    worker, job = _worker(0, url, tmp_path), _job(1, attempt=1)
    thread = ThreadPoolExecutor(1)
    before = _listening()
    asyncio.run(worker._process_group(job, thread))
    try:
        # Every port rank 0 now listens on (gloo's own, here): no store answers there.
        context = rank_processes("trillium.services.nn_worker.server")
        found = context.Queue()
        strangers = [context.Process(target=_stranger, args=(p, found)) for p in _listening() - before]
        for p in strangers:
            p.start()
        for p in strangers:
            p.join(STRANGER_S)
            p.kill()
        answered = []
        while not found.empty():
            answered.append(found.get())
        assert answered == [], f"a stranger's TCPStore client on rank 0's ports got {answered}"

        # The store is in Redis, which refuses whoever lacks the password, with TLS or without.
        key = state.job_key(job.id, "rendezvous", job.attempt)
        ranks = redis.Redis.from_url(url)
        assert ranks.hgetall(key) and ranks.hget(key, "device/0") == b"cpu"  # the rendezvous went through it
        assert 0 < ranks.pttl(key) <= 2 * COLLECTIVE_TIMEOUT.total_seconds() * 1000  # and it expires
        address = {k: ranks.connection_pool.connection_kwargs[k] for k in ("host", "port")}
        with_tls = {"ssl": True, "ssl_ca_certs": str(ca_file)}
        address["retry"] = Retry(NoBackoff(), 0)  # a refusal is final: no retries
        for stranger in (
            redis.Redis(**address, **with_tls),
            redis.Redis(**address, **with_tls, password="guessed"),
            redis.Redis(**address),
        ):
            joining = rendezvous.RedisStore(stranger, key, TIMEOUT)
            for call, args in (
                (stranger.keys, ("*",)),  # list
                (stranger.hgetall, (key,)),  # read
                (stranger.hset, (key, "device/0", "stranger-host/cpu")),  # write
                (joining.set, ("device/1", "stranger-host/cpu")),  # join
                (joining.get, ("device/0",)),
            ):
                with pytest.raises((redis.AuthenticationError, redis.ConnectionError)):
                    call(*args)
        assert b"device/1" not in ranks.hkeys(key) and ranks.hget(key, "device/0") == b"cpu"  # none of it landed
    finally:
        dist.destroy_process_group()
        thread.shutdown()


def test_the_store_answers_as_tcpstore_does(guarded) -> None:
    """The same calls to c10d's own TCPStore (the reference) and to the Redis store answer alike."""
    short = timedelta(seconds=1)

    def calls(store: dist.Store) -> list[Any]:
        out = [
            store.compare_set("a", "", "x"),  # absent, nothing expected: set
            store.compare_set("b", "e", "x"),  # absent, something expected: left absent
            store.check(["b"]),
            store.compare_set("a", "x", "y"),  # as expected: set
            store.compare_set("a", "q", "z"),  # not as expected: what it holds
            store.get("a"),
            store.add("n", 3),
            store.add("n", -1),
            store.get("n"),  # a decimal string
        ]
        store.set("s", "text")
        store.set("t", b"\x00\xff")
        out += [store.get("s"), store.get("t"), store.num_keys()]
        out += [store.delete_key("s"), store.delete_key("s"), store.check(["a", "t"]), store.check(["a", "s"])]
        store.append("ap", b"1")  # c10d's own fallbacks, over compare_set and get
        store.append("ap", b"2")
        out += [store.get("ap"), store.multi_get(["a", "t"])]
        with pytest.raises(dist.DistStoreError):
            store.get("missing")  # within the store's timeout
        with pytest.raises(dist.DistStoreError):
            store.wait(["a", "missing"], timedelta(milliseconds=200))
        store.wait(["a", "t"])
        return out

    reference = dist.TCPStore("127.0.0.1", 0, 1, True, short, wait_for_workers=False)
    ours = rendezvous.RedisStore.of_attempt(guarded[0], "contract", 0, short)
    assert calls(ours) == calls(reference)


def _scores(rank: int) -> evaluate.Scored:
    """Rank 0's scores of 5 samples, rank 1's of none."""
    rng, n = np.random.default_rng(rank), 5 if rank == 0 else 0
    return evaluate.Scored(
        (rng.random(n) < 0.5).astype(np.float32),
        rng.random(n, np.float32),
        np.arange(n, dtype=np.int64) // 2,
        rng.integers(0, 2**64, n, np.uint64, endpoint=False),
        rng.random(n) < 0.8,
    )


@contextmanager
def _no_unpickling():
    """Every way to unpickle (pickle's, and torch.distributed's all_gather_object's) refused."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a peer's bytes were unpickled")

    targets = [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (dist.distributed_c10d, "_unpickler")]
    saved = [getattr(owner, name) for owner, name in targets]
    for owner, name in targets:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for (owner, name), value in zip(targets, saved, strict=True):
            setattr(owner, name, value)


def _rank(rank: int, redis_url: str, run_dir: str, attempt: int, results) -> None:
    """Rank `rank` of attempt `attempt` of a 2-rank job (a process of its own): its group, formed
    as the service forms it, all-reduces and gathers the ranks' scores."""
    os.environ[ENV_DEVICE] = "cpu"
    worker, job = _worker(rank, redis_url, Path(run_dir)), _job(2, attempt=attempt)
    thread = ThreadPoolExecutor(1)
    try:
        group = asyncio.run(worker._process_group(job, thread))
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total, group=group)
        with _no_unpickling():
            gathered = evaluate.gather(_scores(rank), group)
        results.put((rank, float(total), gathered))
    finally:
        dist.destroy_process_group()
        thread.shutdown()


def test_two_ranks_meet_in_redis_form_a_gloo_group_and_gather_scores_unpickled(guarded, tmp_path) -> None:
    got = run_ranks(
        rank_processes("trillium.services.nn_worker.server"),
        _rank,
        [(r, guarded[0], str(tmp_path), 2) for r in range(2)],
    )
    want = [_scores(0), _scores(1)]
    for rank in (0, 1):
        total, gathered = got[rank]
        assert total == 1.0 + 2.0
        assert len(gathered) == len(want)
        for theirs, ours in zip(gathered, want, strict=True):
            for field, a, b in zip(evaluate.Scored._fields, theirs, ours, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (rank, field)


def _rank_after_a_failed_group(rank: int, redis_url: str, run_dir: str, attempt: int, results) -> None:
    """Rank `rank` of attempt `attempt`, rank 0's process having failed to form the group of an
    earlier attempt (its peer never came), as a process the service keeps has; rank 1's fresh, as
    a restarted one is."""
    if rank == 0:
        with pytest.raises(dist.DistStoreError):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=timedelta(seconds=1))
    _rank(rank, redis_url, run_dir, attempt, results)


def test_a_rank_whose_group_failed_before_meets_a_restarted_one(guarded, tmp_path) -> None:
    """torch names a group's keys by a count of the groups its process began to form, reset only
    when one is torn down: the ranks meet all the same (before, each waited the store's 10 minutes
    for the other's keys: bench/nemesis.py's seed 1 found it, a cut between the ranks)."""
    got = run_ranks(
        rank_processes("trillium.services.nn_worker.server"),
        _rank_after_a_failed_group,
        [(r, guarded[0], str(tmp_path), 3) for r in range(2)],
    )
    assert [got[rank][0] for rank in (0, 1)] == [3.0, 3.0]
