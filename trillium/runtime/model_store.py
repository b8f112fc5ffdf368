"""Published model versions: where they live and what a version says (the serving side's
counterpart of `trillium.runtime.checkpoint`).

Layout (a local directory, `<run-dir>/models` by default, or any fsspec URL):

    <dir>/<model>/forgotten.json            how many forgets rewrote the files below (services/coordinator/forget.py)
    <dir>/<model>/versions/<version>.json   a version's manifest, written last and atomically: the
                                            version exists iff it does (numbered 1, 2, ... per model)
    <dir>/<model>/parts/<job id>.<attempt>.<step>/   the files of the cut after that step:
        ps-<shard>.values   a training PS shard's rows, values only (trillium_native's values file):
                            every row it owns (full), or those changed since its base's cut (delta)
        dense.pt            the dense model's weights (torch.save of its state_dict)
        eval.npy            the job's own predictions for its test split at the cut (when it evaluated
                            there: the last step, an evaluated checkpoint), in the order of the
                            test batches' ids (file order with one data loader); no version lists it

A version is **full** when every PS file is. A delta's rows are upserts on top of its `base`
version: every row a shard created or changed since the base's cut, so it is complete on top of
the base or any later version of the same attempt (never across a recovery: a new attempt's
first version is full, its shards having no cut of their own to diff from). A version names its
job's config (the feature spec and the model), the dense statistics in use at its cut and the
value dtype: everything a replica needs to answer as training would.

Retention keeps the newest `keep_last` versions and every version a kept one is loaded on top
of (its chain back to a full one), as checkpoints do.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from trillium.job import JobConfig, stored_config

from .storage import StorageDir, filesystem, read_json, write_json_atomically

# 2: a version's job config names each table's `ids` (its slots' ID space); one of format 1 hashed
# every slot within the slot, and reads as `per_slot` (`stored_config`).
FORMAT_VERSION = 2
DENSE = "dense.pt"
EVAL = "eval.npy"
FORGOTTEN = "forgotten.json"

DenseStats = dict[str, dict[str, float]]  # {column: {"mean", "std"} | {"min", "max"}}


def ps_values(shard: int) -> str:
    return f"ps-{shard}.values"


class CorruptVersion(ValueError):
    """A version's manifest or files do not say what they should (missing, altered, unknown format)."""


class VersionFile(BaseModel):
    name: str
    bytes: int
    sha256: str
    shard: int | None = Field(None, description="the training PS shard of a values file")
    full: bool | None = Field(None, description="a values file: every row the shard owns, or a delta")
    base: int | None = Field(None, description="a delta values file: the version whose cut it diffs from")


class VersionManifest(BaseModel):
    format: int = FORMAT_VERSION
    model: str
    version: int = Field(ge=1)
    job_id: str
    attempt: int
    step: int = Field(description="the last step trained into it")
    epoch: int
    cut_at: float = Field(description="when the ranks finished the step (UNIX time)")
    created_at: float = Field(description="when the version was committed")
    event_time: float | None = Field(None, description="the newest event time of a sample trained into it")
    low_watermark: float | None = Field(
        None,
        description="every impression of an earlier event time is trained into it (streams; the least over "
        "the ranks of their newest batch's `complete_through`); None when a rank knows none",
    )
    kind: Literal["full", "delta"]
    base: int | None = Field(None, description="a delta: the version it is applied on top of")
    parts: str = Field(description="the directory of its files, relative to the model's")
    files: list[VersionFile]
    dtype: Literal["fp16", "fp32"]
    config: JobConfig
    dense_stats: DenseStats

    @field_validator("config", mode="before")
    @classmethod
    def _stored(cls, raw: Any) -> Any:
        return stored_config(raw)  # a version of format 1: its tables hashed per slot

    def file(self, name: str) -> VersionFile:
        for f in self.files:
            if f.name == name:
                return f
        raise CorruptVersion(f"version {self.version} of {self.model} has no file {name}")

    @property
    def values(self) -> list[VersionFile]:
        """The PS values files, by shard."""
        return sorted((f for f in self.files if f.shard is not None), key=lambda f: f.shard)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def summary(self) -> dict[str, Any]:
        """What the views and the notices say of a version (its files and config aside)."""
        return self.model_dump(mode="json", exclude={"files", "config", "dense_stats"}) | {"bytes": self.bytes}


def parts_name(job_id: str, attempt: int, step: int) -> str:
    return f"{job_id}.{attempt}.{step}"


def cuts_after(job_id: str, attempt: int, step: int) -> Callable[[str], bool]:
    """Whether a parts directory holds a cut of this attempt after `step`: one that may be being
    written, rank 0's dense weights before any rank has reported the cut."""
    prefix = f"{job_id}.{attempt}."

    def after(name: str) -> bool:
        cut = name.removeprefix(prefix)
        return cut != name and cut.isdigit() and int(cut) > step

    return after


def model_topic(model: str) -> str:
    """The topic a model's versions are announced on (one partition, one notice per version)."""
    return f"trillium.{model}.model"


class ModelStore:
    """Every version of one model: `<base>/<model>/`."""

    @classmethod
    def of(cls, config: JobConfig, shared_root: str | Path) -> ModelStore | None:
        """The store a job publishes to (None when it publishes nothing)."""
        key = cls.key(config, shared_root)
        return None if key is None else cls(*key)

    @staticmethod
    def key(config: JobConfig, shared_root: str | Path) -> tuple[str, str] | None:
        """(base, model) of the store a job publishes to, with no filesystem opened: `publish.dir`,
        else `<shared_root>/models` (the stack's `shared_root`); the model named `publish.model`,
        else the job's name."""
        if config.publish is None:
            return None
        base = config.publish.dir or posixpath.join(str(shared_root), "models")
        return base.rstrip("/"), config.publish.model or config.name

    def __init__(self, base: str, model: str) -> None:
        self.base = base.rstrip("/")
        self.model = model
        self.fs, root = filesystem(self.base)
        self.root = posixpath.join(root, model)

    @property
    def location(self) -> str:
        return f"{self.base}/{self.model}"

    def parts(self, name: str) -> StorageDir:
        return StorageDir(f"{self.location}/parts/{name}")

    def _manifest_path(self, version: int) -> str:
        return posixpath.join(self.root, "versions", f"{version}.json")

    def versions(self) -> list[int]:
        """The committed versions, ascending."""
        try:
            entries = self.fs.ls(posixpath.join(self.root, "versions"), detail=False)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(e) for e in entries)
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def manifest(self, version: int) -> VersionManifest:
        try:
            raw = read_json(self.fs, self._manifest_path(version))
        except ValueError as err:  # not JSON: a torn write
            raise CorruptVersion(f"{self.location}: version {version} has no valid manifest: {err}") from None
        if raw is None:
            raise CorruptVersion(f"{self.location}: no version {version}")
        try:
            manifest = VersionManifest.model_validate(raw)
        except ValueError as err:
            raise CorruptVersion(f"{self.location}: version {version} has no valid manifest: {err}") from None
        if not 1 <= manifest.format <= FORMAT_VERSION:
            raise CorruptVersion(
                f"{self.location}: version {version} is of format {manifest.format}, this build reads 1 to "
                f"{FORMAT_VERSION}"
            )
        if manifest.version != version or manifest.model != self.model:
            raise CorruptVersion(f"{self.location}/versions/{version}.json names {manifest.model} {manifest.version}")
        return manifest

    def forget_seq(self) -> int:
        """How many forgets rewrote this model's files (`<dir>/<model>/forgotten.json`): a replica
        that loaded its version before the last one loads it again."""
        raw = read_json(self.fs, posixpath.join(self.root, FORGOTTEN))
        return int(raw["seq"]) if isinstance(raw, dict) else 0

    def raise_forget_seq(self) -> int:
        """Count a forget whose rewrites are done; returns the new count."""
        seq = self.forget_seq() + 1
        write_json_atomically(self.fs, posixpath.join(self.root, FORGOTTEN), {"seq": seq})
        return seq

    def commit(self, manifest: VersionManifest) -> None:
        """Write a version's manifest (its files written and verified before): it exists from now."""
        write_json_atomically(self.fs, self._manifest_path(manifest.version), manifest.model_dump(mode="json"))

    def chain(self, version: int) -> list[VersionManifest]:
        """The versions to load for `version`, oldest (a full one) first."""
        out = [self.manifest(version)]
        while out[-1].kind == "delta":
            base = out[-1].base
            if base is None:
                raise CorruptVersion(f"{self.location}: version {out[-1].version} is a delta of nothing")
            out.append(self.manifest(base))
        return out[::-1]

    def retain(self, keep_last: int, writing: Callable[[str], bool] = lambda name: False) -> list[int]:
        """Delete all but the newest `keep_last` versions and those they are loaded on top of, and
        every parts directory no kept version names but those `writing` says are (cuts whose
        versions are not committed yet); returns the deleted versions."""
        versions = self.versions()
        manifests: dict[int, VersionManifest] = {}
        for v in versions:
            try:
                manifests[v] = self.manifest(v)
            except CorruptVersion:
                continue
        keep: set[int] = set()
        for v in versions[-keep_last:]:
            while v is not None and v not in keep and v in manifests:
                keep.add(v)
                v = manifests[v].base
        deleted = [v for v in versions if v not in keep]
        for v in deleted:
            self.fs.rm(self._manifest_path(v))
        self.remove_unreferenced({manifests[v].parts for v in keep}, writing)
        return deleted

    def remove_unreferenced(self, referenced: set[str], protect: Callable[[str], bool]) -> list[str]:
        """Remove parts directories no version names (abandoned cuts), but those `protect` says
        are being written now."""
        try:
            entries = self.fs.ls(posixpath.join(self.root, "parts"), detail=False)
        except FileNotFoundError:
            return []
        gone = [posixpath.basename(e) for e in entries]
        gone = [name for name in gone if name not in referenced and not protect(name)]
        for name in gone:
            self.parts(name).remove()
        return gone

    def verify(self, manifest: VersionManifest, files: list[VersionFile] | None = None) -> None:
        """Every file of the version (or those of `files`) present with the size and sha256 it was
        committed with."""
        parts = self.parts(manifest.parts)
        for entry in manifest.files if files is None else files:
            parts.verify_file(entry.name, entry.bytes, entry.sha256, error=CorruptVersion)


# ---- the publish protocol (services/coordinator/publish.py) ------------------------------------------


class PublishCut(BaseModel):
    """An NN rank past a publish cut (in its health, the latest few)."""

    attempt: int
    step: int
    epoch: int
    at: float = Field(description="when the rank finished the step (UNIX time)")
    reason: Literal["schedule", "checkpoint", "final"]
    event_time: float | None = Field(None, description="the newest event time this rank has trained")
    complete_through: float | None = Field(
        None, description="the low watermark of the newest batch this rank has trained (Batch.complete_through)"
    )


class ModelPart(BaseModel):
    """A worker's files of a version's cut (in its health, the latest few), or why it has none."""

    step: int
    files: list[VersionFile] = Field(default_factory=list)
    error: str | None = None


class ExportRequest(BaseModel):
    """Coordinator -> PS shard, at the last step (the shard then takes no more gradients): export
    the rows of the cut at `step` as a publish cut in the gradients would have."""

    job_id: str
    attempt: int
    step: int
