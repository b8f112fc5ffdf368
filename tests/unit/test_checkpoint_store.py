"""Checkpoint storage: a checkpoint exists iff its manifest does; files are checked against it;
retention and clean-up; the same code over a local directory and a non-local fsspec filesystem."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trillium.data import load_job
from trillium.job.record import CheckpointRef, JobRecord
from trillium.runtime.checkpoint import (
    DENSE,
    FORMAT_VERSION,
    MANIFEST,
    CorruptCheckpoint,
    JobCheckpoints,
    Manifest,
    PartFile,
    live_head,
    ps_file,
    rank_file,
    timeline,
)

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"
# What the timeline follows of a job's record: its attempt, and the checkpoint it was restored from.
FIRST_ATTEMPT = JobRecord.model_construct(attempt=0, restore=None)


UNSAID = -1  # a manifest with no `parent`, as builds before timelines wrote them


def _write(
    store: JobCheckpoints,
    step: int,
    *,
    manifest: bool = True,
    delta_of: int | None = None,
    parent: int | None = UNSAID,
    attempt: int = 0,
) -> Manifest:
    """A checkpoint at `step`; its PS file a delta of the one at `delta_of`, if given; after
    `parent` on its timeline, unless UNSAID."""
    ckdir = store.dir(step)
    files = []
    for name, data in [(DENSE, b"dense-" * 1000), (rank_file(0), b'{"step": %d}' % step)]:
        size, sha = ckdir.write_bytes(name, data)
        files.append(PartFile(name=name, role="nn_worker", index=0, bytes=size, sha256=sha, seconds=0.0))
    size, sha = ckdir.write_bytes(ps_file(0), b"rows of step %d" % step)
    files.append(
        PartFile(name=ps_file(0), role="embedding_ps", index=0, bytes=size, sha256=sha, seconds=0.0, delta_of=delta_of)
    )
    m = Manifest(
        job_id=store.job_id,
        attempt=attempt,
        step=step,
        epoch=0,
        reason="schedule",
        created_at=time.time(),
        pause_seconds=0.01,
        seconds_to_write=0.1,
        config=load_job(TINY_JOB),
        positions={"s": {0: step}},
        written={"s": {0: step}},
        lineage={},
        files=files,
        **({} if parent == UNSAID else {"parent": parent}),
    )
    if manifest and parent == UNSAID:
        ckdir.write_bytes(MANIFEST, m.model_dump_json(exclude={"parent"}).encode())
    elif manifest:
        ckdir.write_manifest(m)
    return m


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> JobCheckpoints:
    base = str(tmp_path / "ckpt") if request.param == "local" else f"memory://trillium-test-{time.monotonic_ns()}"
    return JobCheckpoints(base, "job-1")


def test_only_checkpoints_with_a_manifest_are_complete(store) -> None:
    _write(store, 10)
    _write(store, 20, manifest=False)  # its writer died before the manifest
    assert [m.step for m in store.complete()] == [10]
    assert store.steps() == [10, 20]
    assert store.cleanup_incomplete() == [20]
    assert store.steps() == [10]


def test_files_are_checked_against_the_manifest(store) -> None:
    m = _write(store, 10)
    store.dir(10).verify(m)
    assert store.dir(10).read_verified(m, rank_file(0)) == b'{"step": 10}'
    store.dir(10).write_bytes(DENSE, b"dense-" * 999)  # truncated
    with pytest.raises(CorruptCheckpoint, match="has 5994 bytes, the manifest says 6000"):
        store.dir(10).verify(m)
    store.dir(10).write_bytes(DENSE, b"DENSE-" * 1000)  # same size, other bytes
    with pytest.raises(CorruptCheckpoint, match="sha256 differs"):
        store.dir(10).verify(m)
    store.dir(10).write_bytes(rank_file(0), b'{"step": 11}')
    with pytest.raises(CorruptCheckpoint, match="differs from the manifest"):
        store.dir(10).read_verified(m, rank_file(0))


def test_a_missing_file_and_an_unreadable_manifest_are_refused(store) -> None:
    m = _write(store, 10)
    store.dir(10).fs.rm(store.dir(10).path + "/" + DENSE)
    with pytest.raises(CorruptCheckpoint, match="is missing"):
        store.dir(10).verify(m)
    store.dir(20).write_bytes("manifest.json", b"{not json")
    with pytest.raises(CorruptCheckpoint, match="not a valid manifest"):
        store.dir(20).manifest()
    assert [c.step for c in store.complete()] == [10]  # never offered for a recovery


def test_a_manifest_of_a_newer_format_is_refused_naming_both_formats(store) -> None:
    _write(store, 10)
    newer = store.dir(10).manifest().model_dump(mode="json") | {"format": FORMAT_VERSION + 1, "new": {}}
    store.dir(20).write_bytes(MANIFEST, json.dumps(newer).encode())  # with a field this build does not know
    with pytest.raises(CorruptCheckpoint, match=f"a newer Trillium \\(checkpoint format {FORMAT_VERSION + 1}; "):
        store.dir(20).manifest()
    complete, refused = store.scan()
    assert [m.step for m in complete] == [10] and list(refused) == [20]
    assert f"this build reads formats up to {FORMAT_VERSION}" in refused[20]


def test_retention_keeps_the_newest(store) -> None:
    for step in (5, 10, 15, 20):
        _write(store, step)
    assert store.retain(2, FIRST_ATTEMPT) == [5, 10]
    assert [m.step for m in store.complete()] == [15, 20]


def test_deltas_chain_to_their_full_checkpoint_which_retention_and_delete_keep(store) -> None:
    _write(store, 5)
    _write(store, 10)  # full
    _write(store, 15, delta_of=10)
    last = _write(store, 20, delta_of=15)
    chain = store.dir(20).chain(last, ps_file(0))
    assert [m.step for _, m in chain] == [10, 15, 20]  # loaded oldest first
    assert [d.location for d, _ in chain] == [store.location(s) for s in (10, 15, 20)]
    assert store.dir(10).chain(store.dir(10).manifest(), ps_file(0))[0][1].step == 10
    assert store.dependents(10) == [15, 20] and store.dependents(20) == []
    assert store.retain(1, FIRST_ATTEMPT) == [5]  # 20 needs 15 and 10
    assert [m.step for m in store.complete()] == [10, 15, 20]
    store.dir(10).verify(store.dir(10).manifest())
    store.dir(20).verify(last)
    # A delta's base is verified with it: recovery then falls back to an older checkpoint.
    store.dir(15).write_bytes(ps_file(0), b"rows of step 99")
    with pytest.raises(CorruptCheckpoint, match="15/ps-0.snap: sha256 differs"):
        store.dir(20).verify(last)
    store.dir(15).remove()
    with pytest.raises(CorruptCheckpoint, match="a delta of step 15, which is gone"):
        store.dir(20).verify(last)
    with pytest.raises(CorruptCheckpoint, match="which is gone"):
        store.dir(20).chain(last, ps_file(0))


def test_the_manifest_is_written_atomically(tmp_path) -> None:
    store = JobCheckpoints(str(tmp_path), "job-1")
    _write(store, 7)
    leftovers = [p.name for p in (tmp_path / "job-1" / "7").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no temp file left behind: written, fsynced and renamed


def test_a_timeline_is_its_head_and_its_parents_and_older_manifests_are_one_line(tmp_path) -> None:
    """Manifests that name their parent chain to it; one written before they did (no `parent`)
    has every older checkpoint before it, as retention and recovery read them then."""
    store = JobCheckpoints(str(tmp_path), "job-1")
    for step in (10, 20):
        _write(store, step)  # no parent: an earlier build's
    for step, parent, attempt in ((30, 20, 0), (40, 30, 0), (50, 30, 1), (60, 50, 1)):
        _write(store, step, parent=parent, attempt=attempt)
    manifests = store.complete()
    assert [m.step for m in timeline(manifests, 60)] == [10, 20, 30, 50, 60]
    assert [m.step for m in timeline(manifests, 40)] == [10, 20, 30, 40]
    assert [m.step for m in timeline(manifests, 20)] == [10, 20]
    assert timeline(manifests, None) == [] and timeline(manifests, 45) == []
    resumed = JobRecord.model_construct(attempt=2, restore=CheckpointRef(location=store.location(40), step=40))
    assert live_head(manifests, resumed) == 40  # before attempt 2 has written one
    assert live_head(manifests, JobRecord.model_construct(attempt=1, restore=None)) == 60
    assert store.retain(2, resumed) == [10, 20, 50, 60]  # 50 and 60: the timeline rolled back from
    assert [m.step for m in store.complete()] == [30, 40]
    _write(store, 70, parent=None, attempt=3)  # a timeline's first: nothing before it
    assert [m.step for m in timeline(store.complete(), 70)] == [70]
