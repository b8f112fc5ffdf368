"""Clock jumps on a cluster's hosts (`trillium up --cluster --clock-jumps`): test and benchmark
support (bench/nemesis.py), never used by a service.

Linux's time namespaces offset only the monotonic clocks, so a host's wall clock is moved in its
processes instead: scripts/clockjump, preloaded into each Trillium service of the cluster, adds
the seconds written in the host's clock file (`<run dir>/clocks/<process>`) to what the process
reads of the wall clock, reading the file again at most once a second. The monotonic clocks are
left alone, as when NTP steps a machine's clock or a VM is restored. Kafka and Redis keep the
machine's clock: what a service does when its own clock is wrong is what is tried here.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import object_store
from .procs import REPO_ROOT, LauncherError

ENV_CLOCKJUMP = "TRILLIUM_CLOCKJUMP"
DEFAULT_CLOCKJUMP = REPO_ROOT / ".cache" / "lib" / "clockjump.so"
ENV_CLOCK_FILE = "TRILLIUM_CLOCK_FILE"  # read by scripts/clockjump
UNJUMPED = frozenset({"kafka", "redis", object_store.HOST})


def library() -> Path:
    """scripts/clockjump, built (LauncherError naming how, when it is not)."""
    path = Path(os.environ.get(ENV_CLOCKJUMP, DEFAULT_CLOCKJUMP))
    if not path.is_file():
        raise LauncherError(
            f"clock jumps need scripts/clockjump built at {path} (`make .cache/lib/clockjump.so`, or set {ENV_CLOCKJUMP})"
        )
    return path


def clock_file(run_dir: Path, name: str) -> Path:
    return run_dir / "clocks" / name


def env(run_dir: Path, name: str) -> dict[str, str]:
    """What process `name` starts with: its clock file, preloaded (nothing for Kafka and Redis)."""
    if name in UNJUMPED:
        return {}
    path = clock_file(run_dir, name)
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        path.write_text("0\n")
    return {"LD_PRELOAD": str(library()), ENV_CLOCK_FILE: str(path)}


def jump(run_dir: Path, name: str, seconds: float) -> None:
    """Set process `name`'s wall clock `seconds` off the machine's (0: back to it), within a
    second. Written whole, then renamed: a reader never sees half a number."""
    path = clock_file(run_dir, name)
    if not path.exists():
        raise LauncherError(f"{name} has no clock file: the stack was not started with clock jumps")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{seconds}\n")
    tmp.replace(path)
