"""Checkpoints: where they live, what a manifest says, and the messages of the cut protocol.

Layout (a local directory by default, or any fsspec URL such as `s3://bucket/prefix`):

    <dir>/<job id>/<step>/manifest.json     written last: the checkpoint exists iff it does
                         ps-<shard>.snap    each PS shard's native snapshot (trillium_native format):
                                            whole, or a delta of the rows changed since the
                                            checkpoint its `delta_of` names (a chain: restore
                                            loads the full one, then each delta; retention and
                                            DELETE keep every checkpoint a kept one needs)
                         ps-<shard>.ledger.json
                                            the gradient ledger of that snapshot's state, always
                                            whole (trillium.runtime.ledger; a checkpoint of before
                                            ledgers has none: its state's content is unknown)
                         dense.pt           the dense model and optimizer (NN rank 0; torch.save of
                                            state_dicts, loadable with weights_only=True)
                         rank-<r>.json      each NN rank's progress (counters, loss curve)
                         loader-<i>.json    each data loader's position in its source

The coordinator takes a checkpoint at a step cut s (services/coordinator/checkpoints.py): every NN
rank has finished step s and holds; every PS shard has applied every rank's gradients up to s. Then
each PS shard and data loader captures its state (`CaptureRequest`), the ranks are released
(`ReleaseRequest`), every part is written while training goes on and reported in the worker's
health (`PartReport`), and the coordinator writes the `Manifest`: job config, step, epoch, the
Kafka positions of every partition the job reads, each file's size and sha256, the format version.
The manifest is written atomically (temp file, fsync, rename; a single put on object stores).
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from trillium.config import Role
from trillium.job import JobConfig, stored_config
from trillium.job.record import JobRecord, Lineage
from trillium.runtime.ledger import GradientLedger
from trillium.runtime.storage import StorageDir, filesystem

# What a checkpoint's files mean. Raise it with any change a reader of the old files would
# misread, keep reading the old ones, and add a fixture of the new one beside the old
# (tests/data/make_checkpoint_fixture.py); the fixtures of earlier formats stay and must restore.
# 2: a stream loader's events keep their field values as one text (1: a dict by path; read by
# services/data_loader/stream.py:upgrade_state).
# 3: a stream loader's events (its joiners' and its rows) as a list per field, not per event.
# 4: multi-task jobs (`labels:`): a rank's file has each task's loss curve (`task_losses`, which
# a reader of 3 refuses as an unknown field), the metrics each task's (`eval.tasks`).
# 5: the job's config names each table's `ids` (its slots' ID space: shared by default); a
# checkpoint of 4 or earlier hashed every slot within the slot, and reads as `per_slot`
# (`trillium.job.stored_config`), so a job resumed or warm-started from it finds its rows.
FORMAT_VERSION = 5
MANIFEST = "manifest.json"
DENSE = "dense.pt"

# topic -> partition -> offset
Offsets = dict[str, dict[int, int]]


def ps_file(shard: int) -> str:
    return f"ps-{shard}.snap"


def ledger_file(shard: int) -> str:
    return f"ps-{shard}.ledger.json"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


def loader_file(index: int) -> str:
    return f"loader-{index}.json"


class CorruptCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest (missing, truncated, or altered)."""


# ---- the manifest ------------------------------------------------------------------------------------


class PartFile(BaseModel):
    name: str  # within the checkpoint directory
    role: Role
    index: int
    bytes: int
    sha256: str
    seconds: float = Field(description="time to write it")
    delta_of: int | None = Field(
        None,
        description="a PS delta: the step of the checkpoint (same job) whose file of this name it is loaded on top of",
    )


class Manifest(BaseModel):
    format: int = FORMAT_VERSION
    job_id: str
    attempt: int
    step: int = Field(description="the last step trained into it")
    epoch: int = Field(description="the epoch of that step")
    reason: Literal["schedule", "request", "final"]
    created_at: float
    pause_seconds: float = Field(description="how long the NN ranks held at the cut")
    seconds_to_write: float = Field(description="from the cut to the manifest")
    config: JobConfig
    positions: Offsets = Field(
        description="where each reader resumes: the samples and eval topics (NN ranks), the gradients topic (PS shards)"
    )
    written: Offsets = Field(description="how far the data loaders had written their topics (see lineage)")
    lineage: Lineage
    files: list[PartFile]
    eval: dict[str, Any] | None = Field(None, description="test metrics at the cut, when asked for")
    parent: int | None = Field(
        None,
        description="the step of the checkpoint before this one on its timeline: its attempt's previous one, "
        "or the one its attempt was restored from; null for a timeline's first (`timeline`)",
    )

    @field_validator("config", mode="before")
    @classmethod
    def _stored(cls, raw: Any) -> Any:
        return stored_config(raw)  # a checkpoint of format 4 or earlier: its tables hashed per slot

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def bases(self) -> set[int]:
        """The steps whose checkpoints this one's delta files are loaded on top of."""
        return {f.delta_of for f in self.files if f.delta_of is not None}

    def file(self, name: str) -> PartFile:
        for f in self.files:
            if f.name == name:
                return f
        raise CorruptCheckpoint(f"checkpoint {self.job_id}@{self.step} has no file {name}")


# ---- the cut protocol --------------------------------------------------------------------------------


class CutReport(BaseModel):
    """An NN rank holding at a cut (in its health, until released)."""

    attempt: int
    step: int
    epoch: int
    at: float = Field(description="when the rank began to hold (UNIX time)")
    seq: int = Field(description="the highest checkpoint request the ranks agreed on")
    reason: Literal["schedule", "request", "final"]
    positions: Offsets = Field(description="the next record to read, per topic partition the rank reads")


class CaptureRequest(BaseModel):
    """Coordinator -> PS shard or data loader: capture your state at the cut, then write it."""

    job_id: str
    attempt: int
    step: int
    location: str
    base: tuple[int, int] | None = Field(
        None,
        description="(attempt, step) of the newest complete checkpoint: "
        "a PS shard that captured it writes a delta on it",
    )


class CaptureResult(BaseModel):
    positions: Offsets = Field(default_factory=dict, description="a PS shard's gradients position")
    written: Offsets = Field(default_factory=dict, description="a data loader's written ends")


class ReleaseRequest(BaseModel):
    """Coordinator -> NN rank: the cut is captured; write your part, evaluate if asked, go on."""

    job_id: str
    attempt: int
    step: int
    location: str | None = Field(description="null: the checkpoint was abandoned, write nothing")
    evaluate: bool = False
    stop: bool = Field(False, description="the job stops at this cut: write your part, then hold until it ends")


class PartReport(BaseModel):
    """A worker's part of a checkpoint, once written (in its health)."""

    step: int
    files: list[PartFile] = Field(default_factory=list)
    eval: dict[str, Any] | None = None
    error: str | None = None


# ---- storage -----------------------------------------------------------------------------------------


class CheckpointDir(StorageDir):
    """One checkpoint's directory, local or remote (fsspec)."""

    def read_verified(self, manifest: Manifest, name: str) -> bytes:
        """A small file of the checkpoint, checked against its manifest entry."""
        entry = manifest.file(name)
        return self.read_checked(name, entry.bytes, entry.sha256, CorruptCheckpoint)

    def read_ledger(self, manifest: Manifest, shard: int) -> GradientLedger | None:
        """PS shard `shard`'s gradient ledger, checked against the manifest; None when the
        checkpoint has none (written before ledgers were)."""
        name = ledger_file(shard)
        if not any(f.name == name for f in manifest.files):
            return None
        raw = self.read_verified(manifest, name)
        try:
            return GradientLedger.loads(raw)
        except (ValueError, TypeError) as err:  # its sha256 matched: written so, by a bug
            raise CorruptCheckpoint(f"{self.location}/{name}: {err}") from None

    def write_manifest(self, manifest: Manifest) -> None:
        self.write_bytes(MANIFEST, manifest.model_dump_json(indent=1).encode())

    def manifest(self) -> Manifest | None:
        """The checkpoint's manifest (None while there is none: the checkpoint is incomplete).
        CorruptCheckpoint if it is unreadable, or of a format newer than this build reads: its
        format is read first, so that a newer manifest is named as such, not as invalid."""
        try:
            raw = self.fs.cat_file(self._join(MANIFEST))
        except FileNotFoundError:
            return None
        try:
            found = json.loads(raw).get("format")
        except (ValueError, AttributeError):
            found = None
        if isinstance(found, int) and found > FORMAT_VERSION:
            raise CorruptCheckpoint(
                f"{self.location}: written by a newer Trillium (checkpoint format {found}; this build reads "
                f"formats up to {FORMAT_VERSION}): restore it with that version or later"
            )
        try:
            return Manifest.model_validate_json(raw)
        except ValueError as err:
            raise CorruptCheckpoint(f"{self.location}/{MANIFEST} is not a valid manifest: {err}") from None

    def verify(self, manifest: Manifest) -> None:
        """Every file present with the size and sha256 the manifest recorded, and every file a delta
        is loaded on top of likewise (CorruptCheckpoint if not)."""
        for entry in manifest.files:
            for link, link_manifest in self.chain(manifest, entry.name):
                file = link_manifest.file(entry.name)
                link.verify_file(file.name, file.bytes, file.sha256, CorruptCheckpoint)

    def sibling(self, step: int) -> CheckpointDir:
        """The checkpoint of the same job at `step`."""
        return CheckpointDir(f"{self.location.rstrip('/').rsplit('/', 1)[0]}/{step}")

    def chain(self, manifest: Manifest, name: str) -> list[tuple[CheckpointDir, Manifest]]:
        """The checkpoints whose file `name` makes up this one's, oldest (the full one) first: a
        PS delta is loaded on top of its base's file, which may be a delta too."""
        out = [(self, manifest)]
        while (base := manifest.file(name).delta_of) is not None:
            ckdir = out[-1][0].sibling(base)
            found = ckdir.manifest()
            if found is None:
                raise CorruptCheckpoint(f"{self.location}/{name} is a delta of step {base}, which is gone")
            manifest = found
            out.append((ckdir, manifest))
        return out[::-1]


def default_dir(shared_root: str | Path) -> str:
    """The checkpoint directory of a job whose file names none: `<shared_root>/checkpoints`."""
    return posixpath.join(str(shared_root), "checkpoints")


class JobCheckpoints:
    """Every checkpoint of one job: `<base>/<job id>/<step>/`."""

    def __init__(self, base: str, job_id: str) -> None:
        self.base = base.rstrip("/")
        self.job_id = job_id
        self.fs, root = filesystem(self.base)
        self.root = posixpath.join(root, job_id)

    @classmethod
    def of(cls, config: JobConfig, job_id: str, shared_root: str | Path) -> JobCheckpoints | None:
        """A job's checkpoints where its config puts them, else `<shared_root>/checkpoints` (the
        stack's `shared_root`; None when the job takes none)."""
        if config.checkpoint is None:
            return None
        return cls(config.checkpoint.dir or default_dir(shared_root), job_id)

    def location(self, step: int) -> str:
        return f"{self.base}/{self.job_id}/{step}"

    def dir(self, step: int) -> CheckpointDir:
        return CheckpointDir(self.location(step))

    def steps(self) -> list[int]:
        """Steps with a directory, complete or not, ascending (a stray file is no step)."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory")
        return sorted(int(name) for name in names if name.isdigit())

    def scan(self) -> tuple[list[Manifest], dict[int, str]]:
        """The complete checkpoints (those with a readable manifest), oldest first, and the steps
        whose manifest is refused (corrupt, or of a newer format), with why."""
        complete, refused = [], {}
        for step in self.steps():
            try:
                manifest = self.dir(step).manifest()
            except CorruptCheckpoint as err:
                refused[step] = str(err)  # listed as nothing: a recovery must not pick it
                continue
            if manifest is not None:
                complete.append(manifest)
        return complete, refused

    def complete(self) -> list[Manifest]:
        """The complete checkpoints (those with a readable manifest), oldest first."""
        return self.scan()[0]

    def cleanup_incomplete(self, keep: set[int] = frozenset()) -> list[int]:
        """Remove checkpoint directories without a manifest (a write that never finished),
        except the steps in `keep` (being written now)."""
        removed = []
        for step in self.steps():
            if step not in keep and self.dir(step).manifest() is None:
                self.dir(step).remove()
                removed.append(step)
        return removed

    def live(self, job: JobRecord) -> list[Manifest]:
        """The complete checkpoints of the job's live timeline, oldest first (`timeline`)."""
        manifests = self.complete()
        return timeline(manifests, live_head(manifests, job))

    def retain(self, keep_last: int, job: JobRecord) -> list[int]:
        """Delete all but the newest `keep_last` checkpoints of the job's live timeline and the
        ones their deltas are loaded on top of; returns the deleted steps. What a resume from an
        older checkpoint left behind is off that timeline: no recovery restores it, so it goes."""
        manifests = self.complete()
        live = timeline(manifests, live_head(manifests, job))
        if not live:
            return []  # nothing written on it yet: nothing to measure the rest against
        keep = self.needed(live[-keep_last:], {m.step: m for m in manifests})
        old = [m.step for m in manifests if m.step not in keep]
        for step in old:
            self.dir(step).remove()
        return old

    @staticmethod
    def needed(kept: list[Manifest], by_step: dict[int, Manifest]) -> set[int]:
        """The steps of `kept` and of every checkpoint their deltas are loaded on top of."""
        steps: set[int] = set()
        todo = [m.step for m in kept]
        while todo:
            step = todo.pop()
            if step in steps or step not in by_step:
                continue
            steps.add(step)
            todo.extend(by_step[step].bases)
        return steps

    def dependents(self, step: int) -> list[int]:
        """The complete checkpoints that need the one at `step` (a delta on it, directly or not)."""
        manifests = self.complete()
        by_step = {m.step: m for m in manifests}
        return [m.step for m in manifests if m.step != step and step in self.needed([m], by_step)]


def live_head(manifests: list[Manifest], job: JobRecord) -> int | None:
    """The step of the newest checkpoint on the job's live timeline: its current attempt's newest,
    or, before that attempt has written one, the checkpoint it was restored from."""
    own = [m.step for m in manifests if m.attempt == job.attempt]
    if own:
        return max(own)
    return job.restore.step if job.restore is not None else None


def timeline(manifests: list[Manifest], head: int | None) -> list[Manifest]:
    """The checkpoints of the timeline that ends at step `head`, oldest first: `head` and its
    parents, as far back as each is complete. A resume from an older checkpoint starts a timeline
    of its own there: the newer ones it rolled back from are on none that leads to its head. A
    manifest written before manifests named their parent has every older checkpoint before it."""
    by_step = {m.step: m for m in manifests}
    chain: list[Manifest] = []
    step = head
    while step is not None and step in by_step:
        manifest = by_step[step]
        chain.append(manifest)
        if "parent" not in manifest.model_fields_set:
            chain += [m for m in reversed(manifests) if m.step < manifest.step]
            break
        step = manifest.parent if manifest.parent is not None and manifest.parent < step else None
    return chain[::-1]
