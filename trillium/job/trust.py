"""What a job file may make the stack do, as the operator allows it.

Who may submit a job may run the model code it names and may have the stack write where it says:
a job is trusted code within the limits set here. The limits come from the environment of the
process that acts on them (the coordinator when it accepts a job, every process that imports a
model), not from the job:

- `TRILLIUM_MODEL_MODULES`: the module prefixes `model.cls` may import from, comma-separated
  (default `trillium.models`). A module is allowed when it is one of them or inside one.
  The check comes before the import: importing a module runs it. What a name resolves to is the
  interpreter's sys.path, so the stack's processes run with `PYTHONSAFEPATH` (the launcher's
  SAFE_IMPORTS, the images' environment): their working directory, where jobs write, is not on it.
- `TRILLIUM_ALLOWED_PATHS`: the roots, comma-separated, under which a job may read its data
  (`data.train`, `data.test`) and keep its state (`checkpoint.dir`, `publish.dir`,
  `init_from.dir` and each table's `disk`); default: the run directory (the local launcher adds
  the shipped examples and what `trillium up --allow-path` names). The stack's shared directory
  (`TRILLIUM_SHARED_DIR`, where jobs keep state by default) is always one of them. A root is a directory or a URL
  prefix (`s3://bucket/prefix`); a path is inside one after `..` and symbolic links are resolved,
  and a data glob's every match is checked again where it is read (`check_files`): a link under a
  root that leads out of it is refused there. A URL's scheme must be an object store's
  (STORAGE_SCHEMES). Each worker checks what the job record and the coordinator's calls name
  again: the coordinator's check is not the only one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trillium.config import ENV_ALLOWED_PATHS, ENV_MODEL_MODULES

from .schema import JobConfig

__all__ = ["ENV_ALLOWED_PATHS", "ENV_MODEL_MODULES", "PathRoots", "check_model_module", "model_modules"]

DEFAULT_MODEL_MODULES = ("trillium.models",)
# The object stores a job may keep state in (fsspec's names); a plain path is the local disk.
# Not ftp, http(s), memory or file: a checkpoint written to another's server, or nowhere durable.
STORAGE_SCHEMES = frozenset({"s3", "gs", "gcs", "abfs", "az"})


def _listed(value: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def model_modules() -> tuple[str, ...]:
    return _listed(os.environ.get(ENV_MODEL_MODULES)) or DEFAULT_MODEL_MODULES


def check_model_module(cls: str) -> None:
    """ValueError unless the module of `cls` ("package.module:Class") is one the operator allows."""
    module = cls.partition(":")[0]
    allowed = model_modules()
    if not any(module == prefix or module.startswith(prefix + ".") for prefix in allowed):
        raise ValueError(
            f"model {cls!r}: module {module!r} is not one this stack may import "
            f"({ENV_MODEL_MODULES}={','.join(allowed)})"
        )


@dataclass(frozen=True)
class PathRoots:
    """Where a job may keep its state (see the module's docstring)."""

    roots: tuple[str, ...]

    @classmethod
    def from_env(cls, run_dir: Path, shared_dir: str | None = None) -> PathRoots:
        roots = _listed(os.environ.get(ENV_ALLOWED_PATHS)) or (str(run_dir),)
        return cls(roots + (shared_dir,) if shared_dir and shared_dir not in roots else roots)

    def allows(self, location: str) -> bool:
        if "://" in location:
            if location.partition("://")[0].lower() not in STORAGE_SCHEMES:
                return False  # whatever the roots say: no upload to a web or FTP server
            return any("://" in root and _inside_url(location, root) for root in self.roots)
        path = os.path.realpath(location)
        return any(
            "://" not in root and os.path.commonpath([path, os.path.realpath(root)]) == os.path.realpath(root)
            for root in self.roots
        )

    def refusals(self, config: JobConfig) -> Iterator[tuple[tuple[str | int, ...], str, str]]:
        """(where in the job, the location, why) for each location outside every root."""
        for where, location in _locations(config):
            if not self.allows(location):
                yield (
                    where,
                    location,
                    f"outside the roots this stack allows ({ENV_ALLOWED_PATHS}={','.join(self.roots)})",
                )

    def refusal(self, location: str) -> str | None:
        """Why `location` may not be used (None: it may)."""
        if self.allows(location):
            return None
        return f"{location!r} is outside the roots this stack allows ({ENV_ALLOWED_PATHS}={','.join(self.roots)})"

    def check(self, config: JobConfig) -> None:
        """ValueError naming the first of the job's locations outside every root: a worker's own
        check of what the job record says, whoever wrote it."""
        for where, location, why in self.refusals(config):
            raise ValueError(f"{'.'.join(str(w) for w in where)}: {location!r} is {why}")

    def check_files(self, files: Iterable[Path], where: str) -> None:
        """ValueError naming the first of `files` (a data glob's matches) outside every root."""
        for path in files:
            if not self.allows(str(path)):
                raise ValueError(
                    f"{where}: {str(path)!r} is outside the roots this stack allows "
                    f"({ENV_ALLOWED_PATHS}={','.join(self.roots)})"
                )


def _inside_url(location: str, root: str) -> bool:
    root = root.rstrip("/")
    return (location == root or location.startswith(root + "/")) and "/../" not in location + "/"


def _locations(config: JobConfig) -> Iterator[tuple[tuple[str | int, ...], str]]:
    for split in ("train", "test"):
        paths = getattr(config.data, split, None)
        for i, path in enumerate(paths if isinstance(paths, list) else [paths] if paths else []):
            yield ("data", split, *((i,) if isinstance(paths, list) else ())), str(path)
    if config.checkpoint is not None and config.checkpoint.dir:
        yield ("checkpoint", "dir"), config.checkpoint.dir
    if config.publish is not None and config.publish.dir:
        yield ("publish", "dir"), config.publish.dir
    if config.init_from is not None and config.init_from.dir:
        yield ("init_from", "dir"), config.init_from.dir
    for name, table in config.tables.items():
        if table.disk:
            yield ("tables", name, "disk"), table.disk
