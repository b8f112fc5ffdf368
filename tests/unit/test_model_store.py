"""The model store: versions exist once their manifest is written, load as chains back to a full
version, are refused when a file differs from the manifest, and retention keeps what a kept
version needs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trillium.data import load_job
from trillium.runtime.model_store import (
    DENSE,
    CorruptVersion,
    ModelStore,
    VersionFile,
    VersionManifest,
    cuts_after,
    parts_name,
    ps_values,
)

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


def _version(store: ModelStore, version: int, base: int | None, step: int) -> VersionManifest:
    parts = store.parts(parts_name("job-1", 0, step))
    files = []
    for shard in range(2):
        size, sha = parts.write_bytes(ps_values(shard), f"rows {version} {shard}".encode())
        files.append(
            VersionFile(name=ps_values(shard), bytes=size, sha256=sha, shard=shard, full=base is None, base=base)
        )
    size, sha = parts.write_bytes(DENSE, f"dense {version}".encode())
    files.append(VersionFile(name=DENSE, bytes=size, sha256=sha))
    manifest = VersionManifest(
        model=store.model,
        version=version,
        job_id="job-1",
        attempt=0,
        step=step,
        epoch=0,
        cut_at=time.time(),
        created_at=time.time(),
        kind="delta" if base is not None else "full",
        base=base,
        parts=parts_name("job-1", 0, step),
        files=files,
        dtype="fp16",
        config=load_job(TINY_JOB),
        dense_stats={},
    )
    store.commit(manifest)
    return manifest


def test_a_version_exists_once_committed_and_loads_as_a_chain(tmp_path: Path) -> None:
    store = ModelStore(str(tmp_path), "tiny")
    assert store.versions() == []
    _version(store, 1, None, 10)
    _version(store, 2, 1, 20)
    _version(store, 3, 2, 30)
    store.parts(parts_name("job-1", 0, 40)).write_bytes(DENSE, b"a cut whose version was never committed")
    assert store.versions() == [1, 2, 3]
    assert [m.version for m in store.chain(3)] == [1, 2, 3]
    assert store.manifest(2).values[1].name == ps_values(1)
    store.verify(store.manifest(3))


def test_a_file_that_differs_from_the_manifest_is_refused(tmp_path: Path) -> None:
    store = ModelStore(str(tmp_path), "tiny")
    manifest = _version(store, 1, None, 10)
    path = tmp_path / "tiny" / "parts" / manifest.parts / ps_values(0)
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    with pytest.raises(CorruptVersion, match="sha256"):
        store.verify(manifest)
    path.unlink()
    with pytest.raises(CorruptVersion, match="missing"):
        store.verify(manifest)


def test_an_unknown_format_or_a_broken_chain_is_refused(tmp_path: Path) -> None:
    store = ModelStore(str(tmp_path), "tiny")
    manifest = _version(store, 1, None, 10)
    _version(store, 2, 1, 20)
    store.commit(manifest.model_copy(update={"format": 99}))
    with pytest.raises(CorruptVersion, match="format 99"):
        store.manifest(1)
    with pytest.raises(CorruptVersion):
        store.chain(2)  # its base no longer reads


def test_retention_keeps_the_newest_and_what_they_need(tmp_path: Path) -> None:
    store = ModelStore(str(tmp_path), "tiny")
    _version(store, 1, None, 10)
    _version(store, 2, 1, 20)
    _version(store, 3, None, 30)
    _version(store, 4, 3, 40)
    _version(store, 5, 4, 50)
    store.parts(parts_name("job-1", 0, 60)).write_bytes(DENSE, b"being written")
    store.parts(parts_name("job-1", 0, 45)).write_bytes(DENSE, b"abandoned")
    store.parts(parts_name("job-0", 0, 70)).write_bytes(DENSE, b"another job's, abandoned")
    assert store.retain(2, writing=cuts_after("job-1", 0, 50)) == [1, 2]
    assert store.versions() == [3, 4, 5]  # 5 and 4 kept, and 3 under them
    parts = sorted(p.name for p in (tmp_path / "tiny" / "parts").iterdir())
    assert parts == [parts_name("job-1", 0, s) for s in (30, 40, 50, 60)]


def test_a_cut_after_the_committed_one_is_being_written() -> None:
    # Rank 0 writes the dense weights at the cut, before any rank reports it: retention after
    # committing step 50 must not take step 55's directory for an abandoned one.
    after = cuts_after("job-1", 2, 50)
    assert after(parts_name("job-1", 2, 55)) and after(parts_name("job-1", 2, 51))
    assert not after(parts_name("job-1", 2, 50)) and not after(parts_name("job-1", 2, 20))
    assert not after(parts_name("job-1", 1, 90))  # an older attempt's: abandoned
    assert not after(parts_name("job-10", 2, 90)) and not after(parts_name("job-1", 2, 90) + "x")
