"""Soak benchmark: a continuous job on a replayed stream for `--minutes`, processes killed and the
broker restarted on a schedule, watched for leaks and checked for exactly-once samples at the end.

The stack and job of bench/online.py (examples/online, a 5 s window) with a checkpoint every 30 s
and a recovery allowed for each kill. `trillium replay` feeds it `--rate` impressions/s from a file
of up to 5 minutes of planted-model rows, replayed again and again under a new replay seed, so
each loop's event keys (`r<seed>-<row>`) are new. With T = `--minutes` and E = min(10, T/3):

- at E minutes, the **early snapshot** of each process's RSS (VmRSS) and open file descriptors;
- every K = max(E, 0.5) minutes (K, 2K, ... up to T - K/2), a **kill -9** of a random process of
  data_loader, embedding_worker, embedding_ps and nn_worker, once the job runs with a checkpoint
  and has recovered from the kill before (the supervisor restarts it, the job recovers by itself);
- once, halfway between the two kills around T/2, a **broker restart** (SIGTERM, a clean one);
- at T, the **end snapshot**; then the job catches up with the last impression and is stopped
  with a final checkpoint. T = 60: kills at 10, 20, ... 50 min, the broker at 35 min; T = 3: the
  snapshot and a kill at 1 min, the broker at 1.5 min, a kill at 2 min.

Reported: per process, by name, RSS and fds at E and at T and end RSS / early RSS (target < 1.05;
a restarted process has a new pid, `restarts` counts them, including the NN ranks', data loaders'
and PS shards' own at each recovery),
and every process's RSS once a minute (`rss_series`: when it grew, and whether it came back down);
the disk usage of each topic the job writes and of its inputs (their partition directories under
the broker's log.dirs) and of the whole data directory; Redis' DBSIZE and used_memory; the
checkpoint directory and model store. And the ledger: the samples topic, read as it is written
(the job trims it behind its oldest kept checkpoint) and counted as the job's final lineage says,
against the hashed key of every impression on the input topic. Exact: each impression once, and
once more per correction of a late click the joiner counted.

    python bench/soak.py --minutes 60 --json
    python bench/soak.py --minutes 3            # a short trial, as a table
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
from aiokafka import TopicPartition
from online import TOPOLOGY, online_job  # bench/online.py: the same stack and job

import trillium_native
from trillium import stack
from trillium.config import KafkaConnection
from trillium.data.replay import ReplayReport, replay
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig
from trillium.job.record import TERMINAL, PartitionLineage
from trillium.runtime.checkpoint import JobCheckpoints
from trillium.runtime.model_store import ModelStore, model_topic
from trillium.stack.client import CoordinatorClient
from trillium.stack.procs import pid_alive, pid_of, usage
from trillium.wire import codec, kafka

KILLED_ROLES = ("data_loader", "embedding_worker", "embedding_ps", "nn_worker")
CHECKPOINT_EVERY_S = 30.0
WINDOW_S = 5.0
LOOP_S = 300  # seconds of stream in the replayed file
INPUT_PARTITIONS = 4  # what replay creates the input topics with
RSS_GROWTH = 1.05
RSS_EVERY_S = 60.0  # the RSS series' interval
STALL_S = 120.0  # no new sample for this long: the job will not catch up


@dataclass(frozen=True)
class Schedule:
    """When things happen, in seconds from the feed's start (see the module docstring)."""

    total: float
    early: float
    kills: tuple[float, ...]
    broker: float

    @classmethod
    def of(cls, minutes: float) -> Schedule:
        total, early = minutes * 60, min(10.0, minutes / 3) * 60
        every = max(early, 30.0)
        kills = tuple(k * every for k in range(1, int(total / every) + 1) if k * every <= total - every / 2)
        return cls(total, early, kills, (int(total / 2 / every) + 0.5) * every)


def _feed(
    data: Path, rows: int, job: JobConfig, conn: KafkaConnection, rate: float, seed: int, until: float
) -> tuple[threading.Thread, list[ReplayReport], list[str]]:
    """`trillium replay` of one file again and again until `until` (monotonic), a new seed a loop."""
    reports: list[ReplayReport] = []
    errors: list[str] = []

    async def run() -> None:
        for loop in itertools.count():
            if (left := until - time.monotonic()) < 1.0:
                return
            try:
                limit = min(rows, int(left * rate))
                reports.append(await replay(data, job, conn, fmt="criteo", rate=rate, limit=limit, seed=seed + loop))
            except Exception as exc:  # a loop cut short (the broker away too long): the ledger reads the topic
                errors.append(f"loop {loop}: {exc!r}")

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    return thread, reports, errors


class Tap:
    """A topic read from its first record in a thread of its own, each fetch's records handed to
    `take` (what it returns is kept), until `finish()`: then on to the topic's end at that time."""

    def __init__(self, conn: KafkaConnection, topic: str, partitions: int, take: Callable[[list], list]) -> None:
        self.conn, self.take = conn, take
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.items: list[Any] = []
        self.gaps = 0  # offsets skipped: records trimmed before the tap read them
        self.error: str | None = None
        self._finish = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def finish(self, timeout_s: float = 600.0) -> Tap:
        self._finish.set()
        self._thread.join(timeout_s)
        return self

    async def _run(self) -> None:
        consumer = kafka.consumer(self.conn, group_id=None)
        consumer.assign(self.tps)
        await consumer.start()
        try:
            await consumer.seek_to_beginning(*self.tps)
            following, ends = dict.fromkeys(self.tps, 0), None
            while ends is None or [tp for tp in self.tps if await consumer.position(tp) < ends[tp]]:
                if ends is None and self._finish.is_set():
                    ends = await consumer.end_offsets(self.tps)
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    self.gaps += records[-1].offset + 1 - following[tp] - len(records)
                    following[tp] = records[-1].offset + 1
                    self.items += self.take(records)
        except Exception as exc:
            self.error = f"{self.tps[0].topic}: {exc!r}"
        finally:
            await consumer.stop()


def _sample_ids(records: list) -> list[tuple[int, int, int, np.ndarray]]:
    # A copy of the ids: a view would keep the whole record alive.
    return [
        (r.partition, r.offset, kafka.attempt_of(r.headers), np.array(codec.decode_batch(r.value).sample_ids))
        for r in records
    ]


def _impression_ids(records: list) -> list[np.ndarray]:
    return [trillium_native.hash_ids("trillium.sample", [r.key for r in records])]  # as the loader names samples


def _ledger(impressions: Tap, samples: Tap, job: dict[str, Any], corrections: int) -> dict[str, Any]:
    segments = job["lineage"].get(job["topics"]["samples"], {})
    lineage = {tp.partition: PartitionLineage(segments.get(str(tp.partition))) for tp in samples.tps}
    counted = [ids for p, offset, attempt, ids in samples.items if lineage[p].counts(offset, attempt)]
    expected = np.concatenate([np.empty(0, np.uint64), *impressions.items])
    emitted = np.concatenate([np.empty(0, np.uint64), *counted])
    wanted = np.unique(expected)
    got, times = np.unique(emitted, return_counts=True)
    out = {
        "impressions_on_input_topic": int(expected.size),
        "distinct_impression_keys": int(wanted.size),
        "samples_counted": int(emitted.size),
        "sample_records_of_superseded_attempts": len(samples.items) - len(counted),
        "sample_records_trimmed_before_read": samples.gaps,
        "read_errors": [t.error for t in (impressions, samples) if t.error],
        "missing": int(np.setdiff1d(wanted, got, assume_unique=True).size),
        "unexpected": int(np.setdiff1d(got, wanted, assume_unique=True).size),
        "repeated": int((times - 1).sum()),
        "corrections": corrections,
    }
    out["exact"] = (
        out["missing"] == out["unexpected"] == 0 and out["repeated"] == corrections and wanted.size == expected.size
    )
    return out


def soak_job(kills: int) -> JobConfig:
    raw = online_job(WINDOW_S).model_dump(mode="json")
    raw["name"] = "bench-soak"
    # Recoveries are counted over the job's life: one for each kill, and a few spare.
    raw["checkpoint"] = {"every_seconds": CHECKPOINT_EVERY_S, "every_steps": None, "max_recoveries": kills + 3}
    return JobConfig.model_validate(raw)


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return value


def _compare(early: dict[str, dict[str, Any]], end: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, last in end.items():
        first = early.get(name, {})
        ratio = last["rss_bytes"] / first["rss_bytes"] if first.get("rss_bytes") and last["rss_bytes"] else None
        out[name] = {"role": last.pop("role"), "restarts": last.pop("restarts")}
        out[name] |= {"restarted_since_early": first.get("pid") != last["pid"], "end": last}
        out[name]["early"] = {k: first.get(k) for k in ("pid", "rss_bytes", "open_fds")}
        out[name]["rss_end_over_early"] = round(ratio, 3) if ratio else None
    return out


def _kill_one(run_dir: Path, rng: random.Random) -> dict[str, Any]:
    role = rng.choice(KILLED_ROLES)
    proc = rng.choice([p for p in stack.read_state(run_dir)["processes"] if p["role"] == role])
    os.kill(proc["pid"], signal.SIGKILL)
    return {"process": proc["name"], "pid": proc["pid"]}


def _restart_broker(run_dir: Path, conn: KafkaConnection) -> dict[str, Any]:
    """SIGTERM the broker (SIGKILL after a minute), wait for the supervisor's new one to answer."""
    old, started, killed = pid_of(run_dir, "kafka"), time.monotonic(), False
    os.kill(old, signal.SIGTERM)
    while pid_of(run_dir, "kafka") == old:
        if not killed and time.monotonic() - started > 60 and pid_alive(old):
            os.kill(old, signal.SIGKILL)
            killed = True
        time.sleep(0.2)
    asyncio.run(kafka.wait_for_kafka(conn, timeout_s=180))
    down = round(time.monotonic() - started, 1)
    return {"process": "kafka", "pid": old, "new_pid": pid_of(run_dir, "kafka"), "sigkilled": killed, "down_s": down}


def _bytes(path: Path) -> int:
    """Disk usage, as `du` counts it: the broker preallocates each segment's two indexes, sparse
    files of 10 MiB each that an empty topic would otherwise show as 20 MiB a partition."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a segment deleted while we walk
                pass
    return total


def _kafka_sizes(run_dir: Path, topics: dict[str, str | None]) -> dict[str, Any]:
    props = (run_dir / "kafka" / "server.properties").read_text().splitlines()
    data = Path(next(line.split("=", 1)[1] for line in props if line.startswith("log.dirs=")))
    sizes: dict[str, int] = {}
    for part in data.iterdir():  # <topic>-<partition>
        topic, _, partition = part.name.rpartition("-")
        if part.is_dir() and partition.isdigit():
            sizes[topic] = sizes.get(topic, 0) + _bytes(part)
    topics = {what: {"topic": t, "bytes": sizes.get(t)} for what, t in topics.items() if t}
    return {"data_dir": str(data), "data_dir_bytes": _bytes(data), "topics": topics}


def _redis(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        return {"keys": client.dbsize(), "used_memory_bytes": client.info("memory")["used_memory"]}
    finally:
        client.close()


def _catch_up(client: CoordinatorClient, job_id: str, produced: int) -> dict[str, Any]:
    """Wait for the loader to count every impression produced as a sample; returns the last view
    (a stopped job's view no longer shows the stream)."""
    last, since = -1, time.monotonic()
    while True:
        view = client.job(job_id)
        samples = ((view["stream"] or {}).get("events") or {}).get("samples", 0)
        if samples >= produced or view["job"]["state"] in TERMINAL or time.monotonic() - since > STALL_S:
            return view
        if samples > last:
            last, since = samples, time.monotonic()
        time.sleep(1.0)


def _drive(
    client: CoordinatorClient, job_id: str, run_dir: Path, conn: KafkaConnection, schedule: Schedule, rng: random.Random
) -> tuple[list[dict[str, Any]], dict[str, Any], int, float, list[dict[str, Any]]]:
    """Follow the schedule to its end (or the job's); returns the events, the early snapshot, the
    kills not done, when it stopped, and every process's RSS once a minute."""
    t0, events, early, rss, next_rss = time.monotonic(), [], {}, [], 0.0
    # By time only (a stable sort): the snapshot before a kill at the same time.
    plan = sorted(
        [(schedule.early, "snapshot"), (schedule.broker, "broker")] + [(t, "kill") for t in schedule.kills],
        key=lambda p: p[0],
    )
    pending: list[tuple[dict[str, Any], int]] = []  # a kill and the job's recoveries before it
    while (now := time.monotonic() - t0) < schedule.total:
        view = client.job(job_id)
        state, recoveries = view["job"]["state"], len(view["job"]["recoveries"])
        if state in TERMINAL:
            break
        if now >= next_rss:
            rss.append({"at_s": round(now), "mb": {n: _mb(p["rss_bytes"]) for n, p in usage(run_dir).items()}})
            next_rss += RSS_EVERY_S
        for kill, before in pending:
            if recoveries > before and state == "running":
                kill["recovered_after_s"] = round(now - kill["at_s"], 1)
        pending = [(k, b) for k, b in pending if "recovered_after_s" not in k]
        when, what = plan[0] if plan else (float("inf"), "")
        if now >= when and what == "snapshot":
            early = usage(run_dir)
        elif now >= when and what == "broker":
            events.append({"at_s": round(now, 1), "what": "broker restart"} | _restart_broker(run_dir, conn))
        elif now >= when and state == "running" and view["last_checkpoint"] and not pending:
            events.append({"at_s": round(now, 1), "what": "kill -9"} | _kill_one(run_dir, rng))
            pending.append((events[-1], recoveries))
        else:
            time.sleep(1.0)
            continue
        plan.pop(0)
    return events, early, sum(what == "kill" for _, what in plan), round(now, 1), rss


def _mb(rss_bytes: int | None) -> float | None:
    return round(rss_bytes / 2**20, 1) if rss_bytes else None


def soak(run_dir: Path, data: Path, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    schedule = Schedule.of(args.minutes)
    st = stack.read_state(run_dir)
    conn = KafkaConnection.from_env(st["kafka"]["bootstrap"])
    job = soak_job(len(schedule.kills))
    join = job.data.join
    asyncio.run(kafka.ensure_topics(conn, {join.impressions: INPUT_PARTITIONS, join.labels: INPUT_PARTITIONS}))
    client = CoordinatorClient.for_stack(run_dir)
    try:
        job_id = client.submit(job)["id"]
        view = _wait(lambda: (v := client.job(job_id))["job"]["state"] in ("running", *TERMINAL) and v, "a start", 300)
        samples = Tap(conn, view["job"]["topics"]["samples"], job.topology.nn_ranks, _sample_ids)
        thread, reports, errors = _feed(data, rows, job, conn, args.rate, args.seed, time.monotonic() + schedule.total)
        events, early, not_done, ended, rss = _drive(client, job_id, run_dir, conn, schedule, random.Random(args.seed))
        end = usage(run_dir)
        thread.join(timeout=WINDOW_S + 120)
        produced = sum(r.impressions for r in reports)
        last = client.job(job_id)
        if last["job"]["state"] not in TERMINAL:
            last = _catch_up(client, job_id, produced)
            client.stop(job_id)  # after a final checkpoint
        final = _wait(lambda: (v := client.job(job_id))["job"]["state"] in TERMINAL and v, "the job to stop", 300)
        checkpoints = JobCheckpoints.of(job, job_id, run_dir)
        complete = len(client.checkpoints(job_id))
    finally:
        client.close()
    models = ModelStore.of(job, run_dir)
    stream = final["stream"] or last["stream"] or {}
    topics = final["job"]["topics"] | {"model": model_topic(models.model)}
    impressions = Tap(conn, join.impressions, INPUT_PARTITIONS, _impression_ids).finish()
    corrections = stream.get("joined", {}).get("corrections", 0)
    return {
        "minutes": args.minutes,
        "rate": args.rate,
        "seed": args.seed,
        "schedule_s": {"early": schedule.early, "kills": schedule.kills, "broker": schedule.broker},
        "job": {k: final["job"][k] for k in ("id", "state", "error", "recoveries")}
        | {"samples_trained": final["progress"]["samples"]}
        | {k: stream.get(k) for k in ("joined", "dead_letters")},
        "feed": {"impressions": produced, "loops": len(reports), "errors": errors},
        "events": events,
        "kills_not_done": not_done,
        "end_snapshot_at_s": ended,  # before the schedule's end if the job ended first
        "processes": _compare(early, end),
        "rss_series": rss,
        "kafka": _kafka_sizes(run_dir, topics | {"impressions": join.impressions, "clicks": join.labels}),
        "redis": _redis(st["redis"]["url"]),
        "checkpoints": {
            "dir": checkpoints.root,
            "bytes": _bytes(Path(checkpoints.root)),
            "count": len(checkpoints.steps()),
            "complete": complete,
        },
        "model_store_bytes": _bytes(Path(models.root)),
        "ledger": _ledger(impressions, samples.finish(), final["job"], corrections),
    }


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    kills = [e for e in result["events"] if e["what"] == "kill -9"]
    job = result["job"]
    return {
        f"rss end/early < {RSS_GROWTH}": {
            name: (p["rss_end_over_early"] or float("inf")) < RSS_GROWTH for name, p in result["processes"].items()
        },
        "ledger exact": result["ledger"]["exact"],
        "recovered from every kill, stopped cleanly": job["state"] == "stopped"
        and job["error"] is None
        and all("recovered_after_s" in k for k in kills),
    }


def _table(result: dict[str, Any]) -> str:
    target = result["targets"][f"rss end/early < {RSS_GROWTH}"]
    lines = [f"{'process':<20} {'restarts':>8} {'MiB@early':>9} {'MiB@end':>9} {'ratio':>6} {'fds':>9}  target"]
    for name, p in result["processes"].items():
        mib = [f"{s['rss_bytes'] / 2**20:.1f}" if s["rss_bytes"] else "-" for s in (p["early"], p["end"])]
        fds = f"{p['early']['open_fds']}->{p['end']['open_fds']}"
        ok = "ok" if target[name] else "FAIL"
        lines.append(
            f"{name:<20} {p['restarts']:>8} {mib[0]:>9} {mib[1]:>9} {p['rss_end_over_early'] or '-':>6} {fds:>9}  {ok}"
        )
    lines += [f"at {e['at_s']:.0f} s: {e['what']} {e['process']}" for e in result["events"]]
    keys = ("job", "feed", "kafka", "redis", "checkpoints", "model_store_bytes", "ledger", "targets")
    return "\n".join(lines + [f"{key}: {json.dumps(result[key])}" for key in keys])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the job runs (>= 1; see above)")
    parser.add_argument("--rate", type=float, default=2000.0, help="impressions a second replayed")
    parser.add_argument("--seed", type=int, default=1, help="the data, the replay seeds and which processes die")
    args = parser.parse_args()
    if args.minutes < 1:
        parser.error("--minutes: at least 1")
    # Stopped early (SIGTERM), an hour-long soak takes its stack down as on Ctrl-C: not left running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="trillium-bench-soak-") as tmp:
        tmp_path = Path(tmp)
        rows = int(args.rate * min(LOOP_S, args.minutes * 60)) + 1
        data = generate_criteo(tmp_path / "stream.tsv", rows, seed=args.seed, vocab_sizes=[1000] * 26)
        run_dir = tmp_path / "stack"
        stack.up(run_dir, TOPOLOGY)
        try:
            result = soak(run_dir, data.path, data.rows, args)
        finally:
            stack.down(run_dir)
    result["targets"] = _targets(result)
    print(json.dumps(result) if args.json else _table(result))


if __name__ == "__main__":
    main()
