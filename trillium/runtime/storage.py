"""Where checkpoints and published models are written: a directory, local or remote (any fsspec
URL such as `s3://bucket/prefix`), whose files are written atomically (temp file, fsync,
rename; a single put on object stores) and read back checked against the size and sha256 a
manifest recorded for them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from trillium import timeouts

# What a digest reads at once, from a local file or an object store's ranged GETs.
DIGEST_CHUNK_BYTES = 4 << 20


def sha256_stream(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(DIGEST_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def filesystem(location: str) -> tuple[Any, str]:
    """The filesystem of `location` and its path there. An object store's calls get the deadlines
    of `trillium.timeouts`, and its listings are read anew each time: a replica polls for versions
    other processes commit, which a cached listing would hide."""
    protocol = fsspec.core.split_protocol(location)[0]
    if protocol not in ("s3", "s3a"):
        return fsspec.core.url_to_fs(location)
    config = {
        "connect_timeout": timeouts.STORE_CONNECT_S,
        "read_timeout": timeouts.STORE_READ_S,
        "retries": {"total_max_attempts": 1},  # s3fs tries each call again itself: the two would multiply
    }
    fs, path = fsspec.core.url_to_fs(location, use_listings_cache=False, config_kwargs=config)
    fs.retries = timeouts.STORE_TRIES  # s3fs's own tries (a class default of 5, no argument)
    return fs, path


def unreachable(err: BaseException) -> bool:
    """Whether `err` says the store did not answer (try again later), rather than that what it
    holds is wrong or missing."""
    if isinstance(err, (ConnectionError, TimeoutError, fsspec.exceptions.FSTimeoutError)):
        return True
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # no s3fs: no object store either
        return False
    return isinstance(err, (BotoConnectionError, HTTPClientError))


def _local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def write_json_atomically(fs: Any, path: str, value: Any) -> None:
    """A JSON document at `path` of the filesystem `fs`, all or nothing."""
    data = json.dumps(value, indent=1).encode()
    if _local(fs):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(path), data)
    else:
        fs.pipe_file(path, data)  # one PUT: an object store shows all of it or nothing


def read_json(fs: Any, path: str) -> Any | None:
    """The JSON document at `path`, or None when there is none (ValueError if it is no JSON)."""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    return json.loads(raw)


class StorageDir:
    """A directory of files, local or remote (fsspec)."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.fs, self.path = filesystem(location)
        self.local = _local(self.fs)

    def _join(self, name: str) -> str:
        return posixpath.join(self.path, name)

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[Path]:
        """A local path to write `name` to (atomically, by the caller); uploaded on exit when remote."""
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            yield Path(self.path) / name
            return
        with tempfile.TemporaryDirectory(prefix="trillium-") as tmp:
            yield Path(tmp) / name
            self.fs.put(str(Path(tmp) / name), self._join(name))

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[Path]:
        """A local path holding `name` (downloaded first when remote)."""
        if self.local:
            yield Path(self.path) / name
            return
        with tempfile.TemporaryDirectory(prefix="trillium-") as tmp:
            self.fs.get(self._join(name), str(Path(tmp) / name))
            yield Path(tmp) / name

    def write_bytes(self, name: str, data: bytes) -> tuple[int, str]:
        """Write a small file atomically; returns its size and sha256."""
        with self.writing(name) as path:
            write_atomically(path, data)
        return len(data), hashlib.sha256(data).hexdigest()

    def read_checked(self, name: str, size: int, sha256: str, error: type[Exception]) -> bytes:
        """A small file, checked against the size and sha256 recorded for it (`error` if it differs)."""
        with self.reading(name) as path:
            data = path.read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise error(f"{self.location}/{name}: size or sha256 differs from the manifest")
        return data

    def verify_file(self, name: str, size: int, sha256: str, error: type[Exception]) -> None:
        """The file present with the recorded size and sha256 (`error` naming what differs if not)."""
        where = f"{self.location}/{name}"
        try:
            found = self.fs.size(self._join(name))
        except FileNotFoundError:
            raise error(f"{where} is missing") from None
        if found != size:
            raise error(f"{where} has {found} bytes, the manifest says {size}")
        # Read where it lies, a chunk at a time: an object store's file is not downloaded first
        # (a PS snapshot of many GB would need as much room in /tmp).
        with self.fs.open(self._join(name), "rb", block_size=DIGEST_CHUNK_BYTES, cache_type="none") as f:
            if sha256_stream(f) != sha256:
                raise error(f"{where}: sha256 differs from the manifest (corrupt)")

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path, recursive=True)
