"""Durable jobs on a real stack with its own Kafka and Redis: every process of a running job
SIGKILLed after a checkpoint, the job recovering from it and training every sample exactly once
per epoch; consistent checkpoints under async training; corrupt checkpoints refused; stopped
jobs resumed; warm starts on another number of PS shards; a running job resharded live."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from aiokafka import TopicPartition
from ledger import assert_exactly_once_at_the_ps, final_runs
from pipeline_helpers import DATA, run_to_end, with_training
from topic_records import topic_names
from typer.testing import CliRunner
from waiting import wait_until

from trillium.cli import app
from trillium.config import KafkaConnection, StackTopology
from trillium.data.features import BatchBuilder
from trillium.job import JobConfig, stored_config
from trillium.runtime.checkpoint import CheckpointDir, ps_file
from trillium.stack import down, read_state, read_token, up
from trillium.stack.client import CoordinatorClient
from trillium.wire import kafka

EPOCHS = 40
EVERY_STEPS = 40  # 10 steps an epoch: a checkpoint every 4 epochs

# The kills are timed against checkpoints and steps: poll every 50 ms.
wait = functools.partial(wait_until, every_s=0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    """A stack of its own (Kafka and Redis included): the tests restart both. Its third PS shard
    stays idle until a job is resharded onto it."""
    run_dir = tmp_path_factory.mktemp("recovery-stack")
    up(run_dir, StackTopology(nn_ranks=2, ps_shards=3, embedding_workers=1))
    yield run_dir
    down(run_dir)


def _durable(job: JobConfig, **checkpoint) -> JobConfig:
    settings = {"every_steps": EVERY_STEPS, "every_seconds": None, "keep_last": 5, **checkpoint}
    return job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update=settings)})


@pytest.fixture(scope="module")
def sync_job(tiny_job) -> JobConfig:
    # Synchronous: a run is repeatable, so a recovered run is comparable with one that was not.
    return _durable(with_training(tiny_job, epochs=EPOCHS, staleness_bound=0))


@pytest.fixture(scope="module")
def baseline(stack, sync_job) -> dict:
    view, report = run_to_end(stack, sync_job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert view["job"]["recoveries"] == []
    return report


def _pid(run_dir: Path, name: str) -> int:
    return next(p["pid"] for p in read_state(run_dir)["processes"] if p["name"] == name)


def _assert_exactly_once(view: dict, job: JobConfig) -> None:
    """Every sample trained once an epoch, as the ranks count (restored from the checkpoint with
    them), and every step's gradients of every rank held once in the final model, as the PS shards
    count what they applied (tests/ledger.py)."""
    assert_exactly_once_at_the_ps(view, job)
    print(f"the final model's ledgers: {final_runs(view)}")
    split = BatchBuilder(job).split("train")
    results = view["results"].values()
    for epoch in range(job.training.epochs):
        assert sum(r["epochs"][epoch]["samples"] for r in results) == split.rows, f"epoch {epoch}"
        assert sum(r["epochs"][epoch]["label_sum"] for r in results) == pytest.approx(float(split.labels.sum()))


def _kill_after_a_checkpoint(stack: Path, job: JobConfig, victim: str, before_kill=None) -> dict:
    """Kill `victim` once the job has a checkpoint (after `before_kill(client, job_id)`), then
    follow the job to its end."""
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["last_checkpoint"] is not None, "a first checkpoint")
        view = client.job(job_id)
        assert view["job"]["state"] == "running", view["job"]["error"]
        assert view["progress"]["samples"] < 0.7 * EPOCHS * 1000, "the job ran too far before the kill"
        if before_kill is not None:
            before_kill(client, job_id)
        os.kill(_pid(stack, victim), signal.SIGKILL)
        return client.follow(job_id, timeout_s=300)
    finally:
        client.close()


@pytest.mark.parametrize(
    "victim",
    ["data_loader-0", "nn_worker-1", "embedding_worker-0", "embedding_ps-1", "coordinator-0", "kafka", "redis"],
)
def test_a_job_survives_any_process_killed_mid_job(stack, sync_job, baseline, victim) -> None:
    fresh_per_attempt = {name: _pid(stack, name) for name in ("data_loader-0", "embedding_ps-0", "embedding_ps-1")}
    view = _kill_after_a_checkpoint(stack, sync_job, victim)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    _assert_exactly_once(view, sync_job)
    assert abs(view["job"]["metrics"]["auc"] - baseline["auc"]) <= 0.002
    recoveries = view["job"]["recoveries"]
    if victim in ("coordinator-0", "kafka", "redis"):
        assert recoveries == []  # nothing of the job's was lost: it rode the restart out
    else:
        assert len(recoveries) >= 1 and recoveries[0]["checkpoint_step"] >= EVERY_STEPS - 1
        assert "\n" not in recoveries[0]["cause"] and "debug_error_string" not in recoveries[0]["cause"]
        # The loaders and PS shards joined the recovery's attempt as new processes.
        assert all(_pid(stack, name) != pid for name, pid in fresh_per_attempt.items())


def test_a_process_lost_before_the_first_checkpoint_starts_the_job_over(stack, sync_job, baseline) -> None:
    """With nothing to restore, the job starts again from the beginning, as TorchElastic restarts a
    job's workers: the new attempt skips every record the lost one wrote, so each step lands once
    and the model is the undisturbed run's. (It used to fail the job.)"""
    job = _durable(sync_job, every_steps=100_000)  # no checkpoint before the job's last step
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["progress"]["samples"] >= 2000, "the job getting going")
        os.kill(_pid(stack, "embedding_ps-1"), signal.SIGKILL)
        killed_at = client.job(job_id)
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert killed_at["last_checkpoint"] is None and killed_at["progress"]["samples"] < 0.7 * EPOCHS * 1000
    assert view["job"]["state"] == "finished", view["job"]["error"]
    (recovery,) = view["job"]["recoveries"]
    assert (recovery["kind"], recovery["checkpoint_step"], recovery["attempt"]) == ("recovery", None, 1)
    assert "embedding_ps-1" in recovery["cause"] and "\n" not in recovery["cause"]
    _assert_exactly_once(view, job)
    assert abs(view["job"]["metrics"]["auc"] - baseline["auc"]) <= 0.002


def test_a_job_whose_tables_are_mostly_on_disk_survives_a_ps_shard_killed(stack, sync_job, baseline, tmp_path) -> None:
    """The disk tier under recovery: a RAM budget of a few rows a table (about 1 KiB a shard), the
    rest spilled; the killed shard's replacement restores its checkpoint onto a tier again."""
    spill = tmp_path / "spill"
    tier = {"memory_budget_gb": 1e-6, "disk": str(spill)}
    job = sync_job.model_copy(update={"tables": {n: t.model_copy(update=tier) for n, t in sync_job.tables.items()}})

    def mostly_on_disk(client: CoordinatorClient, job_id: str) -> None:
        for shard in client.tables(job_id)["shards"]:
            for name, t in shard["tables"].items():
                assert t["disk_rows"] > 2 * t["resident_rows"], (shard["shard"], name, t)
                assert t["resident_rows"] + t["disk_rows"] == t["rows"]
                assert t["disk_bytes"] > 0 and t["disk_lookup_hits"] > 0

    view = _kill_after_a_checkpoint(stack, job, "embedding_ps-1", before_kill=mostly_on_disk)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    _assert_exactly_once(view, job)
    assert abs(view["job"]["metrics"]["auc"] - baseline["auc"]) <= 0.002
    assert len(view["job"]["recoveries"]) >= 1 and view["job"]["recoveries"][0]["checkpoint_step"] >= EVERY_STEPS - 1
    assert list(spill.iterdir()) == []  # spill files are unlinked once open: the killed shard's are gone


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs: a disk that fills. Mounting needs root, as this project's machines and CI run."""
    path = tmp_path / "small-disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: a PS may still hold its spill files


def test_a_disk_tier_that_fills_fails_the_job_naming_why_and_its_last_checkpoint_resumes(
    stack, sync_job, small_disk
) -> None:
    """Spill files on a disk that fills after the first checkpoint: the PS shard that cannot spill
    fails, the job fails naming the table, the file and ENOSPC (no recovery allowed, so the first
    failure is the job's), and with room again the job resumes from its last complete checkpoint
    and trains every sample once. New IDs arrive at every step (a large uniform vocabulary), so
    the spill files grow all along."""
    raw = sync_job.model_dump(mode="json")
    raw["data"] = {
        "source": "synthetic",
        "rows": 20_000,
        "test_rows": 1000,
        "vocab_sizes": [100_000] * 26,
        "zipf_exponent": 0.0,
    }
    raw["training"]["epochs"] = 1
    raw["checkpoint"]["max_recoveries"] = 0
    for table in raw["tables"].values():
        table.update(memory_budget_gb=1e-6, disk=str(small_disk / "spill"))
    job = JobConfig.model_validate(raw)
    filler = small_disk / "filler"
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["last_checkpoint"] is not None, "a first checkpoint")
        assert client.job(job_id)["progress"]["samples"] < 0.5 * 20_000, "the job ran too far before the disk filled"
        with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: the disk is full
            while True:
                f.write(b"\0" * 4096)
        view = client.follow(job_id, timeout_s=300)
        assert view["job"]["state"] == "failed"
        error = view["job"]["error"]
        assert "No space left on device" in error and ".spill" in error and str(small_disk) in error, error
        assert re.search(r"table [\"'](a|b)[\"']", error), error
        last = view["last_checkpoint"]
        assert last is not None and last["step"] >= EVERY_STEPS - 1
        filler.unlink()
        client.resume(job_id)
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert [(r["kind"], r["checkpoint_step"]) for r in view["job"]["recoveries"]] == [("resume", last["step"])]
    _assert_exactly_once(view, job)


def test_a_checkpoint_taken_under_async_training_is_consistent(stack, tiny_job) -> None:
    """Under unbounded staleness lookups run ahead of the gradients, yet the checkpoint holds the
    state at its cut: evaluating the restored checkpoint (a delta on the first, here on one PS
    shard instead of two: the snapshots reshard on load) gives the AUC the running job measured at
    the cut."""
    job = _durable(with_training(tiny_job, epochs=13, staleness_bound=None), evaluate=True, keep_last=10)
    view, _ = run_to_end(stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    client = CoordinatorClient.for_stack(stack)
    try:
        listing = client.checkpoints(view["job"]["id"])
        assert [c["reason"] for c in listing] == ["schedule", "schedule", "schedule", "final"]
        middle = listing[1]
        assert middle["eval"]["samples"] == 300
        # Its PS snapshots are deltas on the first checkpoint's: the restore loads both, resharded.
        snapshots = [f for f in middle["files"] if f["role"] == "embedding_ps" and f["name"].endswith(".snap")]
        assert [f["delta_of"] for f in snapshots] == [listing[0]["step"]] * 2
        assert [f["delta_of"] for f in middle["files"] if f["name"].endswith(".ledger.json")] == [None] * 2  # whole
        warm = JobConfig.model_validate(
            job.model_dump()
            | {
                "name": "evaluate-checkpoint",
                "init_from": {"job": view["job"]["id"], "step": middle["step"]},
                "topology": job.topology.model_dump() | {"ps_shards": 1},
            }
        )
        warm = with_training(warm, epochs=0)
        restored, _ = run_to_end(stack, warm)
    finally:
        client.close()
    assert restored["job"]["state"] == "finished", restored["job"]["error"]
    assert restored["job"]["metrics"]["auc"] == pytest.approx(middle["eval"]["auc"], abs=1e-6)
    assert restored["job"]["metrics"]["logloss"] == pytest.approx(middle["eval"]["logloss"], abs=1e-6)


@pytest.mark.parametrize("fixture", sorted(DATA.glob("checkpoint-v*")), ids=lambda p: p.name)
def test_a_checkpoint_of_every_earlier_format_restores(stack, fixture: Path) -> None:
    """Each checkpoint format keeps a checkpoint written by the code of its day
    (tests/data/make_checkpoint_fixture.py): today's code warm-starts from it, and evaluating it
    gives the metrics it measured at its cut."""
    (source,) = [p for p in fixture.iterdir() if p.is_dir()]
    (step,) = [p for p in source.iterdir() if p.is_dir()]
    manifest = json.loads((step / "manifest.json").read_text())
    # As it was written then, read by today's schema as a stored config: a table with no `ids` was
    # hashed per slot, and a job warm-starting from it says so (or is refused: tests/unit/test_stored_id_spaces.py).
    config = stored_config(manifest["config"])
    data = DATA / ("tiny_multitask" if config.get("labels") else "tiny")
    suffix = Path(config["data"]["train"]).suffix
    job = JobConfig.model_validate(
        config
        | {
            "name": f"restore-{fixture.name}",
            "data": config["data"] | {"train": str(data / f"train{suffix}"), "test": str(data / f"test{suffix}")},
            "training": config["training"] | {"epochs": 0},
            "init_from": {"job": source.name, "step": int(step.name), "dir": str(fixture)},
        }
    )
    restored, _ = run_to_end(stack, job)
    assert restored["job"]["state"] == "finished", restored["job"]["error"]
    assert restored["job"]["init_from"]["step"] == int(step.name)
    assert restored["job"]["metrics"]["auc"] == pytest.approx(manifest["eval"]["auc"], abs=1e-6)
    assert restored["job"]["metrics"]["logloss"] == pytest.approx(manifest["eval"]["logloss"], abs=1e-6)
    for task, metrics in manifest["eval"].get("tasks", {}).items():  # a multi-task job's (format 4 on)
        for name, value in metrics.items():
            assert restored["job"]["metrics"]["tasks"][task][name] == pytest.approx(value, abs=1e-6), (task, name)


def test_a_corrupt_checkpoint_is_refused_and_recovery_takes_the_one_before(stack, sync_job) -> None:
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(sync_job)["id"]
        wait(lambda: len(client.checkpoints(job_id)) >= 2, "two checkpoints")
        client.pause(job_id)  # no newer checkpoint while we damage the newest
        listing = client.checkpoints(job_id)
        newest, older = listing[-1], listing[-2]
        with CheckpointDir(newest["location"]).reading(ps_file(1)) as path:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        os.kill(_pid(stack, "embedding_ps-0"), signal.SIGKILL)
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    recovery = view["job"]["recoveries"][0]
    assert recovery["checkpoint_step"] == older["step"]
    assert len(recovery["refused"]) == 1 and "ps-1.snap: sha256 differs from the manifest" in recovery["refused"][0]
    _assert_exactly_once(view, sync_job)


def test_a_checkpoint_that_cannot_be_written_is_abandoned_and_the_job_goes_on(stack, sync_job, tmp_path) -> None:
    """A checkpoint whose parts fail to write (here its directory cannot be made: a file stands
    where it goes, as a full disk or a refusing store fails a write) is abandoned: the job goes on
    and says why in its view and metrics, and the checkpoints before and after it are whole."""
    job = _durable(sync_job, keep_last=20, dir=str(tmp_path / "checkpoints"))
    blocked = 3 * EVERY_STEPS - 1  # the third scheduled cut
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        # Well before step `blocked`: the job has not trained its first step yet.
        (tmp_path / "checkpoints" / job_id).mkdir(parents=True)
        (tmp_path / "checkpoints" / job_id / str(blocked)).write_text("not a checkpoint directory")
        wait(lambda: client.job(job_id)["job"]["checkpoint_failures"]["count"] == 1, "the checkpoint to fail")
        wait(lambda: f'trillium_job_checkpoint_failures{{job="{job_id}"}} 1.0' in _metrics(stack), "the metric")
        view = client.follow(job_id, timeout_s=300)
        listing = client.checkpoints(job_id)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    failures = view["job"]["checkpoint_failures"]
    assert failures["count"] == 1 and failures["last_step"] == blocked
    assert f"{job_id}/{blocked}" in failures["last_error"]
    steps = range(EVERY_STEPS - 1, EPOCHS * 10, EVERY_STEPS)
    assert [c["step"] for c in listing] == [s for s in steps if s != blocked]
    for checkpoint in listing:
        for part in checkpoint["files"]:
            CheckpointDir(checkpoint["location"]).verify_file(
                part["name"], part["bytes"], part["sha256"], AssertionError
            )
    _assert_exactly_once(view, sync_job)


def test_a_jobs_topics_are_trimmed_behind_its_checkpoints_and_deleted_once_it_finished(stack, sync_job) -> None:
    """No record before the oldest kept checkpoint's cut is read again: the samples and gradients
    topics start there; a finished job's topics are deleted."""
    job = _durable(sync_job, keep_last=2)
    conn = KafkaConnection(bootstrap=read_state(stack)["kafka"]["bootstrap"])
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: len(client.checkpoints(job_id)) >= 3, "three checkpoints")
        client.pause(job_id)  # no newer checkpoint while we look
        topics = client.job(job_id)["job"]["topics"]
        oldest = client.checkpoints(job_id)[-2]  # of the 2 kept; those before are kept as delta bases
        trimmed = {
            (topic, int(p)): offset
            for topic in (topics["samples"], topics["gradients"])
            for p, offset in oldest["positions"][topic].items()
        }
        assert all(offset > 0 for offset in trimmed.values()), oldest["positions"]
        wait(
            lambda: asyncio.run(_offsets(conn, trimmed, first=True)) == trimmed, "the trim behind the oldest checkpoint"
        )
        client.resume(job_id)
        view = client.follow(job_id, timeout_s=300)
        assert view["job"]["state"] == "finished", view["job"]["error"]
        wait(lambda: client.job(job_id)["job"]["topics_deleted"], "the finished job's topics deleted")
    finally:
        client.close()
    _assert_exactly_once(view, sync_job)
    left = asyncio.run(topic_names(conn))
    assert not {topics["samples"], topics["eval"], topics["gradients"]} & left


def test_a_job_without_checkpoints_has_its_applied_gradients_deleted(stack, sync_job) -> None:
    """Nothing reads a checkpoint-less job's applied gradients again (a lost process fails it):
    each PS shard deletes its partition's records behind what it applied, and the job trains on."""
    job = sync_job.model_copy(update={"checkpoint": None})
    conn = KafkaConnection(bootstrap=read_state(stack)["kafka"]["bootstrap"])
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["progress"]["samples"] > 0, "steps trained")
        client.pause(job_id)  # the ranks hold: every shard applies all there is, then trims behind it
        topic = client.job(job_id)["job"]["topics"]["gradients"]
        partitions = [(topic, shard) for shard in range(job.topology.ps_shards)]

        def all_deleted() -> bool:
            firsts = asyncio.run(_offsets(conn, partitions, first=True))
            return all(firsts.values()) and firsts == asyncio.run(_offsets(conn, partitions, first=False))

        wait(all_deleted, "the applied gradients deleted")
        client.resume(job_id)
        view = client.follow(job_id, timeout_s=300)
        assert view["job"]["state"] == "finished", view["job"]["error"]
    finally:
        client.close()
    _assert_exactly_once(view, job)


async def _offsets(conn: KafkaConnection, partitions, first: bool) -> dict[tuple[str, int], int]:
    """The partitions' first offsets (`first`), else their ends."""
    consumer = kafka.consumer(conn, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t, p in partitions]
        offsets = await (consumer.beginning_offsets(tps) if first else consumer.end_offsets(tps))
        return {(tp.topic, tp.partition): offset for tp, offset in offsets.items()}
    finally:
        await consumer.stop()


def _metrics(stack: Path) -> str:
    coordinator = next(p for p in read_state(stack)["processes"] if p["name"] == "coordinator-0")
    headers = {"Authorization": f"Bearer {read_token(stack)}"}
    return httpx.get(f"{coordinator['http_url']}/metrics", headers=headers, timeout=10).text


@pytest.mark.parametrize("final_checkpoint", [True, False], ids=["savepoint", "no-checkpoint"])
def test_a_stopped_job_resumes_from_its_last_checkpoint(stack, sync_job, final_checkpoint) -> None:
    """A stop takes a final checkpoint at the step the ranks stop at (nothing trained past it, so
    nothing is trained twice after `resume`); `--no-checkpoint` stops at once and the job resumes
    from its last scheduled checkpoint."""
    cli = CliRunner()
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(sync_job)["id"]
        wait(lambda: client.job(job_id)["last_checkpoint"] is not None, "a first checkpoint")
        stop = ["stop", job_id, "--run-dir", str(stack), *([] if final_checkpoint else ["--no-checkpoint"])]
        stopped = cli.invoke(app, stop)
        assert stopped.exit_code == 0, stopped.output
        wait(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop")
        view = client.job(job_id)
        assert view["job"]["error"] is None
        listing = cli.invoke(app, ["checkpoints", job_id, "--run-dir", str(stack), "--json"])
        assert listing.exit_code == 0, listing.output
        last = json.loads(listing.output)[-1]
        assert last == view["last_checkpoint"]
        if final_checkpoint:
            assert (last["reason"], last["step"]) == ("request", view["progress"]["steps"] - 1)
        else:
            assert last["step"] % EVERY_STEPS == EVERY_STEPS - 1 and last["reason"] == "schedule"
        resumed = cli.invoke(app, ["resume", job_id, "--run-dir", str(stack)])
        assert resumed.exit_code == 0 and f"job {job_id}: recovering" in resumed.output, resumed.output
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert [(r["kind"], r["checkpoint_step"]) for r in view["job"]["recoveries"]] == [("resume", last["step"])]
    _assert_exactly_once(view, sync_job)


def test_a_job_without_a_checkpoint_fails_naming_the_process(stack, sync_job) -> None:
    job = sync_job.model_copy(update={"checkpoint": None})
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["progress"]["samples"] > 2000, "training to get going")
        os.kill(_pid(stack, "embedding_ps-0"), signal.SIGKILL)
        view = client.follow(job_id, timeout_s=120)
    finally:
        client.close()
    assert view["job"]["state"] == "failed"
    error = view["job"]["error"]
    assert "embedding_ps-0" in error and "takes no checkpoints" in error
    assert "\n" not in error and "debug_error_string" not in error


def test_a_job_resharded_live_from_2_to_3_to_1_shards_trains_every_sample_once(stack, sync_job, baseline) -> None:
    """`trillium reshard` moves a running job onto 3 PS shards, then onto 1: each time the ranks stop
    at a cut, a checkpoint is taken there and a new attempt restores it resharded. Every sample is
    trained exactly once per epoch, and the model is the uninterrupted run's."""
    cli = CliRunner()
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(sync_job)["id"]
        rows, steps = None, 20
        for shards in (3, 1):
            wait(lambda steps=steps: client.job(job_id)["progress"]["steps"] >= steps, f"step {steps}")
            view = client.job(job_id)
            assert view["job"]["state"] == "running", view["job"]["error"]
            assert view["progress"]["samples"] < 0.7 * EPOCHS * 1000, "the job ran too far before the reshard"
            tables = client.tables(job_id)
            rows = rows or {name: t["rows"] for name, t in tables["tables"].items()}
            attempt = view["job"]["attempt"]
            if shards == 3:  # through the command line, then through the API
                out = cli.invoke(app, ["reshard", job_id, "--ps-shards", str(shards), "--run-dir", str(stack)])
                assert out.exit_code == 0 and f"job {job_id}: running" in out.output, out.output
            else:
                asked = client.reshard(job_id, shards)["reshards"][-1]
                assert (asked["from_shards"], asked["to_shards"], asked["state"]) == (3, 1, "pending"), asked
            wait(
                lambda attempt=attempt: (
                    (v := client.job(job_id)["job"])["state"] == "running" and v["attempt"] > attempt
                ),
                f"the job to run on {shards} shards",
            )
            view = client.job(job_id)
            assert view["ps_shards"] == shards and not view["reshard_in_progress"]
            resharded = view["job"]["reshards"][-1]
            assert (resharded["to_shards"], resharded["state"]) == (shards, "done"), resharded
            # Every row is on the new shards, each on the one shard_of names (the shards hold all IDs
            # the job has seen: the tiny data's every ID, seen in its first epoch).
            tables = client.tables(job_id)
            assert len(tables["shards"]) == shards and all(
                sum(t["rows"] for t in s["tables"].values()) > 0 for s in tables["shards"]
            )
            assert {name: t["rows"] for name, t in tables["tables"].items()} == rows
            # It restored the checkpoint taken at the step the ranks stopped at.
            (restored,) = [c for c in client.checkpoints(job_id) if c["step"] == resharded["checkpoint_step"]]
            assert restored["reason"] == "request" and restored["attempt"] == attempt
            steps = resharded["checkpoint_step"] + 21  # 20 steps on these shards before the next
        # The shards the job no longer uses have left its attempt, and freed its tables.
        left = {"embedding_ps-1", "embedding_ps-2"}
        wait(
            lambda: (
                {
                    w["name"]
                    for w in client.workers()
                    if w["name"] in left
                    and (w["health"].get("job") or {}).get("phase") == "stopped"
                    and w["health"]["tables"] == {}
                }
                == left
            ),
            "the shards resharded away to leave the job",
        )
        view = client.follow(job_id, timeout_s=300)
        shown = cli.invoke(app, ["job", job_id, "--run-dir", str(stack)])
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    reshards = view["job"]["reshards"]
    assert [(r["from_shards"], r["to_shards"], r["state"]) for r in reshards] == [(2, 3, "done"), (3, 1, "done")]
    cuts = [r["checkpoint_step"] for r in reshards]
    assert [(r["kind"], r["checkpoint_step"]) for r in view["job"]["recoveries"]] == [("reshard", s) for s in cuts]
    assert view["ps_shards"] == 1 and view["job"]["config"]["topology"]["ps_shards"] == 1
    assert shown.exit_code == 0 and "2 → 3, done" in shown.output and "3 → 1, done" in shown.output, shown.output
    _assert_exactly_once(view, sync_job)
    print(f"resharded at steps {cuts}: AUC {view['job']['metrics']['auc']:.6f}, uninterrupted {baseline['auc']:.6f}")
    assert abs(view["job"]["metrics"]["auc"] - baseline["auc"]) <= 0.002, (view["job"]["metrics"], baseline["auc"])


def test_a_reshard_whose_checkpoint_fails_leaves_the_job_on_its_shards(stack, sync_job, baseline, tmp_path) -> None:
    """A reshard's checkpoint that cannot be written (a file stands where each checkpoint still to
    come would go) fails the reshard, not the job: the ranks are released at the cut and go on
    with the shards they had, every sample trained once."""
    job = _durable(sync_job, dir=str(tmp_path / "checkpoints"))
    client = CoordinatorClient.for_stack(stack)
    try:
        job_id = client.submit(job)["id"]
        wait(lambda: client.job(job_id)["progress"]["steps"] >= 20, "step 20")
        base = tmp_path / "checkpoints" / job_id
        base.mkdir(parents=True, exist_ok=True)
        blocked = [base / str(step) for step in range(client.job(job_id)["progress"]["steps"], EPOCHS * 10)]
        for path in blocked:
            path.write_text("not a checkpoint directory")
        client.reshard(job_id, 3)
        wait(lambda: client.job(job_id)["job"]["reshards"][-1]["state"] != "pending", "the reshard to fail")
        for path in blocked:
            path.unlink()
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    (reshard,) = view["job"]["reshards"]
    assert (reshard["from_shards"], reshard["to_shards"], reshard["state"]) == (2, 3, "failed"), reshard
    assert f"{job_id}/" in reshard["error"] and view["job"]["checkpoint_failures"]["count"] >= 1
    assert view["job"]["recoveries"] == [] and view["ps_shards"] == 2 and view["job"]["stop_after"] is None
    _assert_exactly_once(view, sync_job)
    assert abs(view["job"]["metrics"]["auc"] - baseline["auc"]) <= 0.002
