"""A random fault schedule on a cluster while jobs train, and a checker of what must hold after it
(the nemesis of Jepsen): to find what the fixed fault scenarios of tests/cluster do not look for.

The stack runs on a cluster of hosts on this machine (trillium/stack/hosts.py: every process,
Kafka and Redis included, on a network namespace of its own; TLS on every link), and trains the
cluster tests' synchronous job (tests/cluster/timeline.py: 600 steps, a checkpoint every 40, as
many recoveries as it needs) once undisturbed, for the model every later run must make, then
again and again, back to back, for `--minutes` while a schedule drawn from `--seed` injects
faults, overlapping (bench/nemesis_faults.py: kill -9 and SIGSTOP of any process, partitions both
ways and one way, loss, slow and capped links, broker and Redis restarts, a service's clock
jumping, the checkpoints' disk full). Then every fault is healed, the job running finishes, and
the checker asserts, for every job:

- it finished, every step of every NN rank's gradients exactly once in the final model by the PS
  shards' ledgers, none applied twice by any attempt, each epoch's rows trained once
  (tests/cluster/timeline.py::assert_exactly_once);
- its test AUC within 0.001 of the undisturbed run's (a recovered synchronous run repeats its
  steps);
- no job the driver did not submit (a submit retried after a lost answer makes none);
- with `--streams`, of every third job, a stream with poison records among its events: each good
  event trained exactly once by the job's final lineage, each poison record dead-lettered with
  its reason (bench/nemesis_stream.py);

and, of every process, that memory and descriptors stayed flat: one that ran the whole window
(not restarted) ends with RSS under 1.5 times and at most 32 more open descriptors than after the
undisturbed run, a coarse alarm (bench/soak.py measures leaks over an hour). Printed: the seed and
the schedule (a failure replays with the same seed), faults by kind, each fault's detect and
recover seconds (to the coordinator's new attempt; from its end to the job training again), the
recoveries, each check and the verdict; the exit code is 1 unless every check holds. Needs root
(its stack's checkpoints go on a tmpfs of their own, the disk a `disk` fault fills).

    .venv/bin/python bench/nemesis.py --minutes 60 --seed 7 --json
    make test-nemesis        # CI's: 4 minutes of faults, seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("cluster", "")]

from nemesis_faults import KINDS, Fault, Injector, kinds_of, schedule  # noqa: E402 (bench/: the script's own folder)
from nemesis_stream import STREAM_EVERY, StreamRun, check_stream, operator_kafka, run_stream  # noqa: E402
from timeline import AUC_TOLERANCE, FAULT_EPOCHS, Timeline, assert_exactly_once, cluster_job  # noqa: E402

from trillium import stack  # noqa: E402
from trillium.config import StackTopology  # noqa: E402
from trillium.job import JobConfig  # noqa: E402
from trillium.stack.client import CoordinatorClient, CoordinatorUnavailable  # noqa: E402
from trillium.stack.links import Network  # noqa: E402
from trillium.stack.procs import usage  # noqa: E402

TOPOLOGY = StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=1, serving_replicas=0)
JOB_TIMEOUT_S = 900.0  # a job under faults, and the last one after the heal
RSS_GROWTH = 1.5
FD_GROWTH = 32
CHECKPOINT_DISK = "256m"  # every job's checkpoints of an hour's run fit (1.5-4 MB a job)


def nemesis_job(number: int) -> JobConfig:
    """The cluster tests' fault job, named for its place in the run (a submit whose answer was
    lost is found by its name), recovering as often as the faults make it."""
    job = cluster_job(FAULT_EPOCHS, name=f"nemesis-{number}")
    checkpoint = job.checkpoint.model_copy(update={"max_recoveries": 10_000})
    return job.model_copy(update={"checkpoint": checkpoint})


class Driver:
    """Submits the jobs back to back, in a thread, until told to stop, and watches each."""

    def __init__(self, run_dir: Path, seed: int, streams: bool) -> None:
        self.run_dir = run_dir
        self.seed = seed
        self.streams = streams
        self.stream_runs: dict[str, StreamRun] = {}
        self.client = CoordinatorClient.for_stack(run_dir)
        self.client.http.timeout = 5.0
        self.jobs: list[tuple[JobConfig, str, Timeline]] = []
        self.views: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _submit(self, job: JobConfig) -> str:
        """The job's id, submitted once: a submit the coordinator did not answer may have been
        taken, so the job is looked for by its name before it is sent again."""
        while True:
            try:
                return self.client.submit(job)["id"]
            except CoordinatorUnavailable:
                pass
            while True:
                try:
                    taken = [j for j in self.client.jobs() if j["config"]["name"] == job.name]
                    break
                except CoordinatorUnavailable:
                    time.sleep(1.0)
            if taken:
                return taken[0]["id"]

    def _run(self) -> None:
        number = 0
        try:
            while not self._stop.is_set():
                if self.streams and number % STREAM_EVERY == STREAM_EVERY - 1:
                    run, timeline = run_stream(self.run_dir, self._submit, number, self.seed, JOB_TIMEOUT_S)
                    self.stream_runs[run.job_id] = run
                    self.jobs.append((run.job, run.job_id, timeline))
                    self.views[run.job_id] = run.view
                else:
                    job = nemesis_job(number)
                    job_id = self._submit(job)
                    timeline = Timeline(self.run_dir, job_id)
                    self.jobs.append((job, job_id, timeline))
                    self.views[job_id] = timeline.wait(JOB_TIMEOUT_S)
                number += 1
        except Exception as err:  # noqa: BLE001 (reported as a problem of the run)
            self.errors.append(f"the driver stopped: {type(err).__name__}: {err}")

    def finish(self) -> None:
        """No job after the one running; wait for it to end."""
        self._stop.set()
        self._thread.join(JOB_TIMEOUT_S + 60)
        if self._thread.is_alive():
            self.errors.append(f"the last job did not end within {JOB_TIMEOUT_S:.0f}s of the heal")

    def job_at(self, t: float) -> Timeline | None:
        """The timeline of the job that ran at monotonic time `t`."""
        found = None
        for _, _, timeline in self.jobs:
            if timeline.points and timeline.points[0].at <= t:
                found = timeline
        return found


def _inject(injector: Injector, faults: list[Fault], started: float, seconds: float) -> None:
    """Each fault at its time, each undone when its hold ends, until `seconds` have passed."""
    ending: list[tuple[float, int]] = []
    by_number = {f.number: f for f in faults}
    for fault in faults:
        while ending and ending[0][0] <= started + fault.at_s:
            due, number = heapq.heappop(ending)
            time.sleep(max(0.0, due - time.monotonic()))
            injector.end(by_number[number])
        time.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        print(f"  {time.monotonic() - started:6.1f}s  {fault.kind:9} {' '.join(fault.targets)}", file=sys.stderr)
        injector.begin(fault)
        heapq.heappush(ending, (started + fault.at_s + fault.hold_s, fault.number))
    while ending:
        due, number = heapq.heappop(ending)
        time.sleep(max(0.0, due - time.monotonic()))
        injector.end(by_number[number])
    time.sleep(max(0.0, started + seconds - time.monotonic()))


def _timings(fault: Fault, driver: Driver) -> dict[str, Any]:
    """Detect: from the fault to the coordinator's new attempt (None: the job rode it out).
    Recover: from its end to the job seen training again."""
    out: dict[str, Any] = {"fault": fault.number, "kind": fault.kind, "targets": fault.targets}
    timeline = driver.job_at(fault.began or 0.0)
    if timeline is None or fault.began is None or fault.ended is None:
        return out | {"detect_s": None, "recover_s": None}
    attempt = timeline.attempt_before(fault.began)
    detected = timeline.new_attempt_at(fault.began, attempt)
    resumed = timeline.progress_at(fault.ended)
    return out | {
        "detect_s": None if detected is None else round(detected - fault.began, 1),
        "recover_s": None if resumed is None else round(resumed - fault.ended, 1),
    }


def _check_jobs(driver: Driver, baseline_auc: float, submitted: set[str]) -> tuple[list[dict[str, Any]], list[str]]:
    jobs, problems = [], []
    for job, job_id, _ in driver.jobs:
        view = driver.views.get(job_id)
        if view is None:
            problems.append(f"{job_id}: did not end")
            continue
        if job_id in driver.stream_runs:
            entry, found = check_stream(operator_kafka(driver.run_dir), driver.stream_runs[job_id])
            jobs.append(entry)
            problems += found
            continue
        record = view["job"]
        entry: dict[str, Any] = {"id": job_id, "state": record["state"], "recoveries": len(record["recoveries"])}
        if record["state"] != "finished":
            problems.append(f"{job_id}: {record['state']}: {record['error']}")
        else:
            auc = record["metrics"]["auc"]
            entry["auc"] = round(auc, 5)
            if abs(auc - baseline_auc) > AUC_TOLERANCE:
                problems.append(f"{job_id}: AUC {auc:.5f}, the undisturbed run's {baseline_auc:.5f}")
            try:
                assert_exactly_once(view, job)
                entry["exactly_once"] = True
            except AssertionError as err:
                entry["exactly_once"] = False
                problems.append(f"{job_id}: not exactly once: {err}")
        jobs.append(entry)
    with contextlib.suppress(CoordinatorUnavailable):
        strangers = {j["id"] for j in driver.client.jobs()} - submitted
        problems += [f"{s}: a job the driver did not submit" for s in sorted(strangers)]
    return jobs, problems


def _check_processes(early: dict[str, Any], end: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, problems = {}, []
    for name, last in end.items():
        first = early.get(name, {})
        same = first.get("pid") == last["pid"] and first.get("rss_bytes") and last["rss_bytes"]
        entry = {"early": first, "end": last, "restarted": first.get("pid") != last["pid"]}
        if same:
            ratio = last["rss_bytes"] / first["rss_bytes"]
            entry["rss_end_over_early"] = round(ratio, 3)
            if ratio > RSS_GROWTH:
                problems.append(f"{name}: RSS grew {ratio:.2f}x over the run")
            if (last["open_fds"] or 0) > (first.get("open_fds") or 0) + FD_GROWTH:
                problems.append(f"{name}: open descriptors {first.get('open_fds')} -> {last['open_fds']}")
        out[name] = entry
    return out, problems


def run(run_dir: Path, minutes: float, seed: int, overlap: int, disk: Path | None, streams: bool) -> dict[str, Any]:
    state = stack.read_state(run_dir)
    network = Network(state["hosts"])
    kinds = tuple(
        k for k in KINDS if (k != "disk" or disk is not None) and (k != "clock" or state["hosts"].get("clock_jumps"))
    )
    client = CoordinatorClient.for_stack(run_dir)
    try:
        baseline = client.follow(client.submit(cluster_job(FAULT_EPOCHS, name="nemesis-undisturbed"))["id"])
    finally:
        client.close()
    if baseline["job"]["state"] != "finished":
        raise SystemExit(f"the undisturbed run ended {baseline['job']['state']}: {baseline['job']['error']}")
    baseline_auc = baseline["job"]["metrics"]["auc"]
    early = usage(run_dir)
    seconds = minutes * 60
    faults = schedule(seed, seconds, sorted(network.hosts), sorted(early), overlap, kinds)
    print(f"nemesis: seed {seed}, {len(faults)} faults in {seconds:.0f}s", file=sys.stderr)
    injector = Injector(run_dir, network, disk)
    driver = Driver(run_dir, seed, streams)
    started = time.monotonic()
    driver.start()
    try:
        _inject(injector, faults, started, seconds)
    finally:
        injector.heal_all()
    healed = time.monotonic()
    driver.finish()
    end = usage(run_dir)
    submitted = {baseline["job"]["id"], *(job_id for _, job_id, _ in driver.jobs)}
    jobs, problems = _check_jobs(driver, baseline_auc, submitted)
    processes, grown = _check_processes(early, end)
    problems += driver.errors + grown
    if not jobs:
        problems.append("no job ran under the faults")
    return {
        "seed": seed,
        "minutes": minutes,
        "overlap": overlap,
        "baseline_auc": round(baseline_auc, 5),
        "faults_by_kind": kinds_of(faults),
        "faults_without_a_target": [f"{f.number} {f.kind}: {f.error}" for f in faults if f.error],
        "timings": [_timings(f, driver) for f in faults if f.began is not None],
        "jobs": jobs,
        "recoveries": sum(j["recoveries"] for j in jobs),
        "last_job_after_heal_s": round(time.monotonic() - healed, 1),
        "processes": processes,
        "schedule": [f.public() for f in faults],
        "verdict": {"ok": not problems, "problems": problems},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument("--overlap", type=int, default=2, help="faults holding at once at most (default 2)")
    parser.add_argument("--run-dir", type=Path, help="a cluster stack already running (else one of its own)")
    parser.add_argument(
        "--streams", action="store_true", help="every third job a stream with poison records (bench/nemesis_stream.py)"
    )
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args(argv)
    own = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="trillium-nemesis-")) if own else args.run_dir
    disk = run_dir / "checkpoints" if own else None  # a stack of another's keeps its disk
    with contextlib.ExitStack() as cleanup:
        if disk is not None:
            disk.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CHECKPOINT_DISK}", "tmpfs", str(disk)], check=True)
            cleanup.callback(subprocess.run, ["umount", "--lazy", str(disk)], check=True)
        if own:
            stack.up(run_dir, TOPOLOGY, cluster=True, link_delay=True, tls=True, clock_jumps=True)
            cleanup.callback(stack.down, run_dir)
        report = run(run_dir, args.minutes, args.seed, args.overlap, disk, args.streams)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"seed {report['seed']}: {report['faults_by_kind']}; {report['recoveries']} recoveries")
        for job in report["jobs"]:
            print(f"  {job}")
        for timing in report["timings"]:
            print(
                f"  fault {timing['fault']:3} {timing['kind']:9} detect {timing['detect_s']} recover {timing['recover_s']}"
            )
        print("verdict:", "ok" if report["verdict"]["ok"] else "FAILED", *report["verdict"]["problems"], sep="\n  ")
    return 0 if report["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
