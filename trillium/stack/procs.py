"""The local stack's processes and files: a process's spec and state (`Proc`), free ports, live
pids, and the run directory's state file (`stack.json`) and token that clients read."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trillium.config import ENV_OBSERVE_DIGEST, ENV_OPERATE_DIGEST, ENV_PREDICT_DIGEST, ENV_TOKEN
from trillium.scopes import Scope, token_digest

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "stack.json"
# Every process the stack starts runs in its run directory, where jobs write: with Python's safe
# path, neither it nor any other working directory is on sys.path, so no file a job leaves there
# can shadow a module the allowlist names (TRILLIUM_MODEL_MODULES) or any other.
SAFE_IMPORTS = {"PYTHONSAFEPATH": "1"}


# A crashed process restarts at once up to RESTARTS_ALLOWED times within the window; each crash
# beyond waits twice as long as the one before (BACKOFF_FIRST_S, up to BACKOFF_MAX_S), as
# Kubernetes' CrashLoopBackOff does. A process is never given up on: one whose cause of death
# goes away (a broker restarted again and again, a disk full) comes back, and the stack with it.
RESTARTS_ALLOWED = 3
RESTART_WINDOW_S = 120.0
BACKOFF_FIRST_S = 10.0
BACKOFF_MAX_S = 120.0


class LauncherError(RuntimeError):
    """The stack could not be started or stopped; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def die_with_parent() -> None:
    """In a child: get SIGTERM if the supervisor dies, so nothing is left behind."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner reads (a key, a password, a configuration holding one), made
    anew so that no wider mode of an older copy is kept."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def pid_of(run_dir: Path, name: str) -> int | None:
    """Process `name`'s pid now (None between a kill and its restart, or with no such process)."""
    processes = (read_state(run_dir) or {}).get("processes", [])
    return next((p.get("pid") for p in processes if p["name"] == name), None)


def usage(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each process of the stack now: role, restarts, pid, RSS and open descriptors (the last two
    None between a kill and its restart), for the benchmarks that watch them (bench/soak.py,
    bench/nemesis.py)."""
    out = {}
    for proc in (read_state(run_dir) or {}).get("processes", []):
        pid = proc.get("pid")
        now = out[proc["name"]] = {"role": proc["role"], "restarts": proc["restarts"], "pid": pid}
        now |= {"rss_bytes": None, "open_fds": None}
        with contextlib.suppress(OSError, StopIteration):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            now["rss_bytes"] = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
            now["open_fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


# Each scope's token (trillium.scopes), mode 600 in the run directory: `token` is the operator's,
# the one the CLI and a user of the API need.
TOKEN_FILES: dict[Scope, str] = {
    "operate": "token",
    "services": "services.token",
    "predict": "predict.token",
    "observe": "observe.token",
}


def read_token(run_dir: Path, scope: Scope = "operate") -> str:
    return (run_dir / TOKEN_FILES[scope]).read_text().strip()


def make_tokens(run_dir: Path) -> None:
    """A fresh random token for each scope that has none yet (a stack restarted keeps its own)."""
    for name in TOKEN_FILES.values():
        with contextlib.suppress(FileExistsError):
            fd = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))


def scope_env(run_dir: Path) -> dict[str, str]:
    """What a service of this stack is given to call and be called: the services' token itself,
    and of the others only their digests."""
    return {
        ENV_TOKEN: read_token(run_dir, "services"),
        ENV_OPERATE_DIGEST: token_digest(read_token(run_dir, "operate")),
        ENV_PREDICT_DIGEST: token_digest(read_token(run_dir, "predict")),
        ENV_OBSERVE_DIGEST: token_digest(read_token(run_dir, "observe")),
    }


@dataclass
class Proc:
    name: str
    role: str  # "kafka", "redis" or a service role
    argv: list[str]
    log: str
    index: int = 0
    http_port: int | None = None
    grpc_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    restarts: int = 0
    state: str = "pending"  # pending, starting, running, backoff (its restart waits), stopped, replaced
    crash_times: list[float] = field(default_factory=list)
    restart_at: float | None = None  # in backoff: when it restarts (time.monotonic())
    address: str = "127.0.0.1"  # its host's: bound and advertised
    tls: bool = False  # its HTTP port speaks TLS

    def crashed(self, now: float) -> float:
        """Count a crash at monotonic time `now`; the seconds its restart waits (0: at once), in
        `backoff` till then."""
        self.crash_times = [t for t in self.crash_times if now - t < RESTART_WINDOW_S] + [now]
        beyond = len(self.crash_times) - RESTARTS_ALLOWED
        if beyond <= 0:
            return 0.0
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (beyond - 1))
        self.state, self.restart_at = "backoff", now + delay
        return delay

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}:{self.http_port}"

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        for private in ("argv", "env", "crash_times", "restart_at"):
            d.pop(private)
        if self.http_port:
            d["http_url"] = self.http_url
        d["grpc_address"] = f"{self.address}:{self.grpc_port}" if self.grpc_port else None
        return d
