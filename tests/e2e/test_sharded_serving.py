"""Sharded serving on a real stack: 3 serving shards of 2 replicas each, each holding a slice of a
model trained on 2 PS shards whose tables are over their memory cap, behind one frontend. Each
shard holds the rows whose ID's splitmix64 hash places them on it, whatever the training shards. Its predictions equal the job's
own evaluation of the version each answer names, for the final version and for every version
answered while new ones were applied under a stream of requests (rows of two versions in one
answer would match neither). A rollback pins shards and frontend alike. One replica of a shard
killed -9 fails no request; both give 503s that name the shard, then answers again. A shard cut
off (its processes stopped) gives 503s within the calls' deadlines and makes the frontend not
ready until it answers again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import DATA
from replica import SKEW, evaluation
from sharded_frontend import Frontend, shard_version, shard_view
from splitmix import mix64
from values_files import read_values
from waiting import wait_until

from trillium import stack
from trillium.config import ENV_SERVING_MEMORY_GB, StackTopology
from trillium.data import load_job
from trillium.job import CRITEO_COLUMNS, JobConfig
from trillium.runtime.model_store import ModelStore
from trillium.services.serving.served import Slice
from trillium.services.serving.sharded import CALL_TIMEOUT_S
from trillium.stack.client import CoordinatorClient

SHARDS = 3
REPLICAS = 2  # serving shard process i holds shard i % SHARDS
PS_SHARDS = 2  # fewer than the serving shards: each serving shard reads both files and keeps its third
CAP_BYTES = 5_000  # each serving shard's cap: under the whole model's files; over each slice's tables


@pytest.fixture(scope="module")
def sharded_stack(infra, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded-stack")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_SERVING_MEMORY_GB, str(CAP_BYTES / 1e9))  # every process the stack starts (and restarts)
        stack.up(
            run_dir,
            StackTopology(
                nn_ranks=1,
                ps_shards=PS_SHARDS,
                embedding_workers=1,
                data_loaders=1,
                serving_replicas=1,
                serving_shards=SHARDS,
                serving_shard_replicas=REPLICAS,
            ),
            kafka_bootstrap=infra.kafka_bootstrap,
            redis_url=infra.redis_database(11),
        )
        try:
            yield run_dir
        finally:
            stack.down(run_dir)


def _job() -> JobConfig:
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["name"] = "sharded"
    raw["topology"] = {"nn_ranks": 1, "ps_shards": PS_SHARDS, "embedding_workers": 1}
    raw["training"]["epochs"] = 6
    raw["checkpoint"] = {"every_steps": 10, "every_seconds": None, "evaluate": True}
    raw["publish"] = {"at_checkpoints": True, "every_seconds": None}
    return JobConfig.model_validate(raw, context={"base_dir": DATA})


def _test_rows() -> list[dict]:
    """The test split as a client sends it: every column by name, a missing value empty."""
    lines = (DATA / "tiny" / "test.tsv").read_text().splitlines()
    return [dict(zip(CRITEO_COLUMNS, line.split("\t"), strict=True)) for line in lines]


def _full_bytes(store: ModelStore, version: int) -> int:
    """The bytes on disk of the values files of the full version under `version`: what a replica
    of the whole model checks against its memory cap before it loads it."""
    full = store.chain(version)[0]
    total = 0
    for values in full.values:
        with store.parts(full.parts).reading(values.name) as path:
            total += os.path.getsize(path)
    return total


def _rows_by_shard(store: ModelStore, version: int) -> list[dict[str, int]]:
    """Per serving shard, per table: how many of the IDs the versions up to `version` hold (its full
    version's and its deltas'; nothing leaves these tables) hash to that shard."""
    ids: dict[str, set[int]] = {}
    for manifest in store.chain(version):
        for values in manifest.values:
            with store.parts(manifest.parts).reading(values.name) as path:
                _, tables = read_values(Path(path))
            for table, (table_ids, _) in tables.items():
                ids.setdefault(table, set()).update(table_ids.tolist())
    return [{t: sum(mix64(i) % SHARDS == s for i in held) for t, held in ids.items()} for s in range(SHARDS)]


def test_a_model_over_a_replicas_cap_is_served_whole_from_three_shards(sharded_stack) -> None:
    job = _job()
    instances = _test_rows()
    frontend = Frontend(sharded_stack)
    answers: list[tuple[int, list[float]]] = []
    failures: list[str] = []
    training = threading.Event()

    def ask_while_training() -> None:
        """Answers while versions come and go: each must be one version's, whole."""
        while training.is_set():
            r = frontend.ask(job.name, instances)
            if r.status_code == 200:
                answers.append((r.json()["version"], r.json()["predictions"]))
            elif answers or r.status_code not in (404, 503):  # before its first version: unknown, or none loaded
                failures.append(f"{r.status_code}: {r.text}")

    client = CoordinatorClient.for_stack(sharded_stack)
    try:
        training.set()
        asker = threading.Thread(target=ask_while_training)
        asker.start()
        try:
            view = client.follow(client.submit(job)["id"], timeout_s=300)
        finally:
            training.clear()
            asker.join()
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    store = ModelStore.of(job, sharded_stack)
    versions = [v for v in store.versions() if store.manifest(v).job_id == view["job"]["id"]]
    newest = store.manifest(versions[-1])
    assert len(versions) >= 3 and store.manifest(versions[0]).kind == "full"

    # The premise: a replica of the whole model would refuse it; each shard's slice is under the cap,
    # holding the rows whose ID hashes to it, and no other.
    whole = _full_bytes(store, newest.version)
    assert whole > CAP_BYTES and all(len(Slice(s, SHARDS).values(newest)) == PS_SHARDS for s in range(SHARDS))
    for s in range(SHARDS):
        wait_until(lambda s=s: shard_version(sharded_stack, s, job.name) == newest.version, f"shard {s} serving", 60)
    views = [shard_view(sharded_stack, s, job.name) for s in range(SHARDS)]
    slices = [view["bytes"] for view in views]
    assert max(slices) <= CAP_BYTES, (slices, whole)
    held = [{table: t["rows"] for table, t in view["tables"].items()} for view in views]
    assert held == _rows_by_shard(store, newest.version)

    # Every answer while versions were applied is one version's, whole.
    assert not failures, failures[:3]
    answered = {v for v, _ in answers}
    assert len(answered) >= 2, f"answers under {answered} only: no version change was seen under load"
    evaluations = {v: evaluation(store, store.manifest(v)) for v in answered}
    for version, predictions in answers:
        np.testing.assert_allclose(predictions, evaluations[version], rtol=0, atol=SKEW, err_msg=f"version {version}")
    print(
        f"\nsharded: {len(answers)} answers under load from versions {sorted(answered)}; whole {whole} B, slices {slices}"
    )

    wait_until(lambda: frontend.version(job.name) == newest.version, f"version {newest.version} served", 60)
    r = frontend.ask(job.name, instances)
    assert r.status_code == 200 and r.json()["version"] == newest.version, r.text
    np.testing.assert_allclose(r.json()["predictions"], evaluation(store, newest), rtol=0, atol=SKEW)

    # A rollback: `trillium models --pin` pins the shards and the frontend, and answers are the old
    # version's, whole; --unpin serves the newest again.
    old = store.manifest(versions[len(versions) // 2])
    _models(sharded_stack, job.name, "--pin", str(old.version))
    r = wait_until(lambda: (r := frontend.ask(job.name, instances)).status_code == 200 and r, "answers pinned", 60)
    assert r.json()["version"] == old.version, r.text
    np.testing.assert_allclose(r.json()["predictions"], evaluation(store, old), rtol=0, atol=SKEW)
    _models(sharded_stack, job.name, "--unpin")
    wait_until(lambda: frontend.version(job.name) == newest.version, f"version {newest.version} again", 60)
    r = wait_until(lambda: (r := frontend.ask(job.name, instances)).status_code == 200 and r, "answers again", 60)
    assert r.json()["version"] == newest.version, r.text

    # One replica of shard 1 killed -9: no request fails, while it is away and as it comes back.
    pids = _pids(sharded_stack)
    failed, answered_meanwhile = [], []
    asking = threading.Event()

    def ask_until_back() -> None:
        while asking.is_set():
            r = frontend.ask(job.name, instances)
            (answered_meanwhile if r.status_code == 200 else failed).append(r)

    asking.set()
    asker = threading.Thread(target=ask_until_back)
    asker.start()
    try:
        os.kill(pids["serving_shard-1"], signal.SIGKILL)
        wait_until(lambda: _pids(sharded_stack)["serving_shard-1"] != pids["serving_shard-1"], "a new replica", 60)
        wait_until(lambda: shard_version(sharded_stack, 1, job.name) == newest.version, "the replica serving", 90)
        wait_until(lambda: len(answered_meanwhile) > 20, "answers after its return")
    finally:
        asking.clear()
        asker.join()
    assert not failed, [f"{r.status_code}: {r.text}" for r in failed[:3]]

    # Both replicas of shard 1: 503s naming it, each at once; then answers again once one is back.
    pids = _pids(sharded_stack)
    for replica in range(REPLICAS):
        os.kill(pids[f"serving_shard-{1 + replica * SHARDS}"], signal.SIGKILL)
    r = wait_until(lambda: (r := frontend.ask(job.name, instances)).status_code != 200 and r, "a request failing", 30)
    assert r.status_code == 503 and "serving shard 1" in r.text, r.text
    assert r.elapsed.total_seconds() < CALL_TIMEOUT_S, "a request hung on the shard killed"
    r = wait_until(lambda: (r := frontend.ask(job.name, instances)).status_code == 200 and r, "answers again", 90)
    assert r.json()["version"] == newest.version
    np.testing.assert_allclose(r.json()["predictions"], evaluation(store, newest), rtol=0, atol=SKEW)

    # Both replicas of shard 2 stopped (alive and silent, as a host cut off, which no supervisor
    # restarts): a 503 naming it within the calls' deadlines, never a hang, and the frontend not
    # ready while it lasts; answers and readiness again once the shard answers.
    pids = _pids(sharded_stack)
    stopped = [pids[f"serving_shard-{2 + replica * SHARDS}"] for replica in range(REPLICAS)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        r = frontend.ask(job.name, instances)
        assert r.status_code == 503 and "serving shard 2" in r.text, r.text
        assert r.elapsed.total_seconds() < REPLICAS * CALL_TIMEOUT_S + 1, "a request hung on the shard cut off"
        wait_until(lambda: not frontend.ready(), "the frontend not ready while a shard is cut off", 60)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    r = wait_until(lambda: (r := frontend.ask(job.name, instances)).status_code == 200 and r, "answers again", 60)
    np.testing.assert_allclose(r.json()["predictions"], evaluation(store, newest), rtol=0, atol=SKEW)
    wait_until(frontend.ready, "the frontend ready again", 30)


def _models(run_dir: Path, *args: str) -> None:
    """`trillium models ARGS` on the stack in `run_dir`."""
    cli = [sys.executable, "-m", "trillium.cli", "models", *args, "--run-dir", str(run_dir)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _pids(run_dir: Path) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in stack.read_state(run_dir)["processes"]}
