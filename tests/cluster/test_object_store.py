"""A checkpoint's or a version's file in the cluster's S3 store (versitygw, on a host of its own)
is verified where it lies: read a chunk at a time by ranged GETs, never downloaded to /tmp first
(a PS snapshot of many GB would need as much room there)."""

from __future__ import annotations

import os
import posixpath
import tempfile
import uuid

import pytest

from trillium import stack
from trillium.runtime.storage import DIGEST_CHUNK_BYTES, StorageDir
from trillium.stack import object_store

pytestmark = pytest.mark.cluster


class Corrupt(Exception):
    pass


def test_a_file_in_the_object_store_is_verified_where_it_lies(cluster, tmp_path, monkeypatch) -> None:
    state = stack.read_state(cluster)
    for name, value in object_store.stack_env(state).items():
        monkeypatch.setenv(name, value)
    where = StorageDir(f"{state['object_store']['url']}/verify-{uuid.uuid4().hex[:8]}")
    data = os.urandom(3 * DIGEST_CHUNK_BYTES + 5)  # several chunks and a short one
    size, sha256 = where.write_bytes("part.bin", data)
    try:
        # No room anywhere for a download: the temporary directory does not exist.
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "absent"))
        where.verify_file("part.bin", size, sha256, Corrupt)
        flipped = bytearray(data)
        flipped[2 * DIGEST_CHUNK_BYTES + 7] ^= 1  # in the third chunk, the size unchanged
        where.fs.pipe_file(posixpath.join(where.path, "part.bin"), bytes(flipped))
        with pytest.raises(Corrupt, match="sha256 differs from the manifest"):
            where.verify_file("part.bin", size, sha256, Corrupt)
        with pytest.raises(Corrupt, match="is missing"):
            where.verify_file("other.bin", size, sha256, Corrupt)
    finally:
        where.remove()
