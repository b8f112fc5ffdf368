"""A right to be forgotten on a real stack: train, stop, forget 1,000 users with `trillium forget`,
then prove that no live PS shard, checkpoint snapshot, model version or replica holds them, that a
recovery from the oldest checkpoint it may start from does not bring them back, and that a replica answers for
a forgotten user as it does for a user it never saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import DATA
from replica import Replica, delimited_rows
from waiting import wait_until

import trillium_native
from trillium.data import load_job
from trillium.data.sources.datagen import generate_criteo
from trillium.job import CRITEO_COLUMNS, JobConfig
from trillium.job.schema import InitFrom
from trillium.runtime.checkpoint import JobCheckpoints, Manifest
from trillium.runtime.model_store import ModelStore
from trillium.stack import read_state
from trillium.stack.client import ApiError, CoordinatorClient

ROWS, BATCH, EPOCHS = 6000, 100, 2
FORGOTTEN = 1000
UNSEEN = "never-seen-user"
KEEP = 2  # checkpoints whose positions stay readable (retention trims the topics behind them)


def _job(tmp_path: Path, name: str = "forget") -> JobConfig:
    """tests/data/tiny_job.yaml on more rows, its C1 a user column of ~1,900 users (table `user`),
    checkpointed and published every 10 steps, as model `name`: a job of each test's own, so that
    no forget reaches another test's job as publishing its model."""
    generate_criteo(tmp_path / "train.tsv", ROWS, seed=11, vocab_sizes=[2000] + [10] * 25, zipf_exponent=0.3)
    generate_criteo(tmp_path / "test.tsv", 300, seed=11, split="test", vocab_sizes=[2000] + [10] * 25)
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["name"] = name
    raw["data"] = {"source": "criteo", "train": str(tmp_path / "train.tsv"), "test": str(tmp_path / "test.tsv")}
    raw["slots"][0]["table"] = "user"
    raw["tables"]["user"] = {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.2}}
    raw["training"].update(batch_size=BATCH, epochs=EPOCHS)
    raw["checkpoint"] = {"every_steps": 10, "every_seconds": None, "keep_last": KEEP}
    raw["publish"] = {"at_checkpoints": True, "every_seconds": None}
    return JobConfig.model_validate(raw)


def _ids(values: list[str]) -> np.ndarray:
    """The user IDs as the job's slot c1 hashes its values (the data's own hashing, not the forget's):
    in table `user`'s ID space, its name (a table's slots share its IDs by default)."""
    return np.unique(trillium_native.hash_cells("user", values)[1])


def _user_rows(store: trillium_native.EmbeddingStore, ids: np.ndarray) -> tuple[int, int]:
    """(rows of `ids` in the store's user table, its rows)."""
    if "user" not in store:
        return 0, 0
    return sum(store.get_row("user", int(i)) is not None for i in ids), store.num_rows("user")


def _chain(checkpoints: JobCheckpoints, manifests: dict[int, Manifest], step: int, name: str) -> list[Path]:
    """The files a recovery from checkpoint `step` loads for its PS file `name`, oldest first."""
    paths: list[Path] = []
    at: int | None = step
    while at is not None:
        paths.append(Path(checkpoints.dir(at).path) / name)
        at = manifests[at].file(name).delta_of
    return paths[::-1]


def _checkpoint_rows(checkpoints: JobCheckpoints, ids: np.ndarray) -> dict[int, tuple[int, int]]:
    """Per complete checkpoint, as a recovery restores it (each PS file after those its deltas are
    loaded on top of): (rows of `ids`, user rows)."""
    manifests = {m.step: m for m in checkpoints.complete()}
    out = {}
    for step, manifest in manifests.items():
        checkpoints.dir(step).verify(manifest)  # sizes and sha256 as the (rewritten) manifest says
        restored = trillium_native.EmbeddingStore()
        for entry in manifest.files:
            if entry.name.endswith(".snap"):
                for path in _chain(checkpoints, manifests, step, entry.name):
                    restored.load(path)
        out[step] = _user_rows(restored, ids)
    return out


def _own_rows(checkpoints: JobCheckpoints, ids: np.ndarray) -> dict[int, int]:
    """Per complete checkpoint: the rows of `ids` its own PS files hold (a delta's: those it changed)."""
    out = {}
    for manifest in checkpoints.complete():
        out[manifest.step] = 0
        for entry in manifest.files:
            if entry.name.endswith(".snap"):
                store = trillium_native.EmbeddingStore()
                store.load(Path(checkpoints.dir(manifest.step).path) / entry.name)
                out[manifest.step] += _user_rows(store, ids)[0]
    return out


def _served_rows(job: JobConfig, store: ModelStore, ids: np.ndarray) -> dict[int, tuple[int, int]]:
    """Per model version, loaded as a replica loads it: (IDs of `ids` served, user rows served)."""
    out = {}
    dims = {name: table.dim for name, table in job.tables.items()}
    for version in store.versions():
        chain = store.chain(version)
        tables = trillium_native.ServingTables(dims, job.topology.ps_shards, chain[0].dtype)
        for n, manifest in enumerate(chain, start=1):
            store.verify(manifest)
            parts = Path(store.parts(manifest.parts).path)
            tables.apply([(f.shard, parts / f.name) for f in manifest.values], n)
        _, _, misses = tables.lookup([("user", ids)])
        out[version] = (len(ids) - misses[0], tables.stats()["user"]["rows"])
    return out


def _cli(run_dir: Path, *args: str) -> list:
    done = subprocess.run(
        [sys.executable, "-m", "trillium.cli", *args, "--run-dir", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def test_forgotten_users_leave_every_place_and_stay_gone_after_a_recovery(training_stack, tmp_path) -> None:
    job = _job(tmp_path)
    client = CoordinatorClient.for_stack(training_stack)
    job_id = client.submit(job)["id"]
    total_batches = EPOCHS * ROWS // BATCH

    def produced() -> int:
        loaders = [w for w in client.workers() if w["role"] == "data_loader"]
        return sum(w["health"].get("produced", {}).get("train_batches", 0) for w in loaders)

    # Every batch of the job written, and two checkpoints taken: then stopped with a final one.
    wait_until(lambda: produced() >= total_batches, "the loaders to write every batch", 240)
    wait_until(lambda: len(client.checkpoints(job_id)) >= 2, "two checkpoints", 240)
    client.stop(job_id)
    wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 240)
    checkpoints = JobCheckpoints.of(job, job_id, training_stack)
    store = ModelStore.of(job, training_stack)
    assert checkpoints is not None and store is not None

    # The users to forget: 1,000 of those the job trained on.
    users = sorted({row["C1"] for row in delimited_rows(tmp_path / "train.tsv", CRITEO_COLUMNS, "\t") if row["C1"]})
    assert len(users) >= 1500, len(users)
    forgotten = users[:FORGOTTEN]
    ids = _ids(forgotten)
    before, own = _checkpoint_rows(checkpoints, ids), _own_rows(checkpoints, ids)
    newest = max(before)
    assert all(found > 0 for found, _ in before.values()), before
    replica = Replica(training_stack)
    version = store.versions()[-1]
    replica.wait_for(job.name, version)
    test_rows = delimited_rows(tmp_path / "test.tsv", CRITEO_COLUMNS, "\t")
    mine = [dict(row, C1=user) for row, user in zip(test_rows, forgotten, strict=False)]
    unseen = [dict(row, C1=UNSEEN) for row in mine]
    got, _ = replica.predict(job.name, mine)
    assert np.abs(got - replica.predict(job.name, unseen)[0]).max() > 1e-4  # they were learnt

    (tmp_path / "ids.txt").write_text("\n".join(forgotten) + "\n")
    receipts = _cli(
        training_stack, "forget", "--model", job.name, "--table", "user", "--ids", str(tmp_path / "ids.txt")
    )
    assert len(receipts) == 1, receipts  # 1,000 values: one request
    receipt = receipts[0]

    # The receipt: the live shards held what the newest (the stop's) checkpoint holds.
    assert receipt["complete"] and receipt["values"] == FORGOTTEN and receipt["ids"] == len(ids)
    assert receipt["rows_removed"] == before[newest][0]
    assert receipt["through_batch"] == total_batches - 1
    by_kind: dict[str, list[dict]] = {}
    for place in receipt["places"]:
        by_kind.setdefault(place["kind"], []).append(place)
    assert len(by_kind["ps_shard"]) == 2
    assert {int(p["name"]): p["rows_removed"] for p in by_kind["checkpoint"]} == own
    assert {p["name"] for p in by_kind["model_version"]} >= {f"{job.name} v{v}" for v in store.versions()}
    assert [r["id"] for r in client._call("GET", "/forgets", params={"job_id": job_id})] == [receipt["id"]]

    # No snapshot or version holds them; the other users' rows stay.
    after = _checkpoint_rows(checkpoints, ids)
    assert _own_rows(checkpoints, ids) == {step: 0 for step in own}
    assert after == {step: (0, users_rows - found) for step, (found, users_rows) in before.items()}
    for served, users_rows in _served_rows(job, store, ids).values():
        assert served == 0 and users_rows > 0

    # The replica reloads its version: a forgotten user is answered as one never seen.
    wait_until(lambda: replica.view(job.name).get("forgets") == 1, "the replica to reload", 60)
    got, versions = replica.predict(job.name, mine)
    assert versions == {version}
    assert np.abs(got - replica.predict(job.name, unseen)[0]).max() <= 1e-6

    # A recovery from the oldest checkpoint whose records are kept replays the batches that held
    # them: masked. An older one, kept as the base of deltas only, is refused (its records trimmed).
    steps = sorted(after)
    if len(steps) > KEEP:
        with pytest.raises(ApiError, match="kept only as the base of newer ones' deltas"):
            client.resume(job_id, checkpoint=steps[0])
    client.resume(job_id, checkpoint=steps[-KEEP])
    view = client.follow(job_id, timeout_s=300)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    final = _checkpoint_rows(checkpoints, ids)
    assert max(final) > newest and all(found == 0 for found, _ in final.values()), final
    for served, _ in _served_rows(job, store, ids).values():
        assert served == 0
    client.close()


def _pid(run_dir: Path, name: str) -> int:
    return next(p["pid"] for p in read_state(run_dir)["processes"] if p["name"] == name)


def _answers(client: CoordinatorClient) -> bool:
    try:
        client.jobs()
    except Exception:  # noqa: BLE001 (not up yet: refused, or cut off)
        return False
    return True


def test_a_forget_cut_off_by_a_coordinator_killed_is_run_again_at_its_start(training_stack, tmp_path) -> None:
    """The coordinator killed -9 while a forget waits on a PS shard (stopped, as a host cut off):
    the job stays marked, a resume is refused by the coordinator that starts next, which runs the
    forget again to a complete receipt; then no checkpoint holds the IDs and the job resumes."""
    job = _job(tmp_path, "forget-cut")
    client = CoordinatorClient.for_stack(training_stack)
    job_id = client.submit(job)["id"]
    # Stopped at the second of its 12 checkpoints: 100 steps short of its end.
    wait_until(lambda: len(client.checkpoints(job_id)) >= 2, "two checkpoints", 240)
    client.stop(job_id)
    wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 240)
    checkpoints = JobCheckpoints.of(job, job_id, training_stack)
    assert checkpoints is not None
    users = sorted({row["C1"] for row in delimited_rows(tmp_path / "train.tsv", CRITEO_COLUMNS, "\t") if row["C1"]})
    forgotten = users[:300]
    ids = _ids(forgotten)
    own = _own_rows(checkpoints, ids)
    assert sum(own.values()) > 0, own

    shard = _pid(training_stack, "embedding_ps-0")
    coordinator = _pid(training_stack, "coordinator-0")
    answered: list[object] = []

    def ask() -> None:
        try:
            answered.append(client.forget(job_id, "user", forgotten))
        except Exception as err:  # noqa: BLE001 (the coordinator dies under it)
            answered.append(err)

    os.kill(shard, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        marked = wait_until(lambda: client.job(job_id)["job"]["forgetting"], "the job marked forgetting", 60)
        os.kill(coordinator, signal.SIGKILL)
        asking.join(60)
        assert answered and not isinstance(answered[0], dict), answered  # no receipt: it was cut off
        again = CoordinatorClient.for_stack(training_stack)
        wait_until(lambda: _pid(training_stack, "coordinator-0") != coordinator, "the coordinator restarted", 60)
        wait_until(lambda: _answers(again), "the restarted coordinator to answer", 120)
        assert again.job(job_id)["job"]["forgetting"] == marked
        with pytest.raises(ApiError, match=f"forget {marked} is running") as refused:
            again.resume(job_id)
        assert refused.value.status == 409
        with pytest.raises(ApiError, match=f"forget {marked} is running"):
            again.delete(job_id)
    finally:
        os.kill(shard, signal.SIGCONT)

    def receipt() -> dict | None:
        found = again._call("GET", "/forgets", params={"job_id": job_id})
        return found[0] if found else None

    done = wait_until(receipt, "the forget run again to its receipt", 120)
    assert done["id"] == marked and done["complete"] and done["runs"] >= 2, done
    assert done["ids"] == len(ids) and done["values"] == len(forgotten)
    assert {p["name"] for p in done["places"] if p["kind"] == "ps_shard"} == {"embedding_ps-0", "embedding_ps-1"}
    assert _own_rows(checkpoints, ids) == {step: 0 for step in own}
    record = again.job(job_id)["job"]
    assert record["forgetting"] is None
    assert [m["receipt"] for m in record["forgotten"]] == [marked]  # the run again replaced its mask
    again.resume(job_id)
    view = again.follow(job_id, timeout_s=300)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert all(found == 0 for found, _ in _checkpoint_rows(checkpoints, ids).values())
    again.close()
    client.close()


def test_a_forget_reaches_a_job_warm_started_from_its_job(training_stack, tmp_path) -> None:
    """A job warm-started from the one a forget names began with its rows: the forget waits for it
    to stop (409 naming it while it runs), then removes the IDs from its checkpoints too, by a
    forget of its own whose receipt the first one names."""
    origin = _job(tmp_path, "forget-origin")
    client = CoordinatorClient.for_stack(training_stack)
    origin_id = client.submit(origin)["id"]
    assert client.follow(origin_id, timeout_s=300)["job"]["state"] == "finished"
    warm = origin.model_copy(update={"name": "forget-warm", "init_from": InitFrom(job=origin_id)})
    warm_id = client.submit(warm)["id"]
    wait_until(lambda: len(client.checkpoints(warm_id)) >= 1, "a checkpoint of the warm start", 240)
    users = sorted({row["C1"] for row in delimited_rows(tmp_path / "train.tsv", CRITEO_COLUMNS, "\t") if row["C1"]})
    forgotten = users[:300]
    with pytest.raises(ApiError, match=f"also in jobs still running: {warm_id} \\(warm-started from {origin_id}\\)"):
        client.forget(origin_id, "user", forgotten)
    client.stop(warm_id)
    wait_until(lambda: client.job(warm_id)["job"]["state"] == "stopped", "the warm start to stop", 240)
    checkpoints = JobCheckpoints.of(warm, warm_id, training_stack)
    assert checkpoints is not None
    ids = _ids(forgotten)
    held = _checkpoint_rows(checkpoints, ids)
    assert all(found > 0 for found, _ in held.values()), held

    receipt = client.forget(origin_id, "user", forgotten)
    assert receipt["complete"] and receipt["linked"] and receipt["linked_from"] is None, receipt
    (linked,) = client._call("GET", "/forgets", params={"job_id": warm_id})
    assert [linked["id"]] == receipt["linked"]
    assert linked["linked_from"] == receipt["id"] and linked["reason"] == f"warm-started from {origin_id}"
    assert linked["complete"] and linked["ids"] == receipt["ids"] == len(ids), linked
    assert {step: found for step, (found, _) in _checkpoint_rows(checkpoints, ids).items()} == dict.fromkeys(held, 0)
    assert client.job(warm_id)["job"]["forgetting"] is None
    client.resume(warm_id)
    view = client.follow(warm_id, timeout_s=300)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    client.close()
