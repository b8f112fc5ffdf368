"""An S3 object store in the stack (`trillium up --cluster --object-store`): versitygw, an S3
gateway over a directory (`<run-dir>/store/data`), on a host of its own, so that checkpoints and
published models can live where a real deployment keeps them, across the network from every
process that writes or reads them. A job uses it by naming `s3://trillium/...` as its
`publish.dir` or `checkpoint.dir`; every service is given the endpoint and the credentials in
the variables boto reads (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).

versitygw is built from the Go module proxy (`make .cache/bin/versitygw`), as kustomize and
linkdelay are: an S3 implementation of its own project, not a stand-in written here.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from .procs import LauncherError, Proc

ENV_VERSITYGW = "TRILLIUM_VERSITYGW"
DEFAULT_VERSITYGW = Path(__file__).resolve().parents[2] / ".cache" / "bin" / "versitygw"
HOST = "store"  # its host's name in a cluster, and its process's
BUCKET = "trillium"
REGION = "us-east-1"


def binary() -> Path:
    path = Path(os.environ.get(ENV_VERSITYGW, DEFAULT_VERSITYGW))
    if not os.access(path, os.X_OK):
        raise LauncherError(
            f"the object store needs versitygw built at {path} (`make .cache/bin/versitygw`, or set {ENV_VERSITYGW})"
        )
    return path


def _credentials(run_dir: Path) -> dict[str, str]:
    """The root user's keys, made on the first start and kept with the data (mode 0600)."""
    path = run_dir / "store" / "credentials.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = {"access_key": secrets.token_hex(10), "secret_key": secrets.token_urlsafe(30)}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(keys, f)
    return json.loads(path.read_text())


def proc(run_dir: Path, address: str, port: int, log: str) -> Proc:
    """The gateway's process, its bucket made (a bucket is a directory of its data)."""
    data = run_dir / "store" / "data"
    (data / BUCKET).mkdir(parents=True, exist_ok=True)
    keys = _credentials(run_dir)
    argv = [str(binary()), "--port", f"{address}:{port}", "--region", REGION, "posix", str(data)]
    # The keys by environment, not argv: /proc/<pid>/cmdline is readable by every user.
    env = {"ROOT_ACCESS_KEY_ID": keys["access_key"], "ROOT_SECRET_ACCESS_KEY": keys["secret_key"]}
    return Proc(HOST, HOST, argv, log=log, env=env, address=address)


def client_env(run_dir: Path, endpoint: str) -> dict[str, str]:
    """What a process needs to read and write `s3://trillium/...` (boto's own variables)."""
    keys = _credentials(run_dir)
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": keys["access_key"],
        "AWS_SECRET_ACCESS_KEY": keys["secret_key"],
        "AWS_DEFAULT_REGION": REGION,
    }


def public(address: str, port: int) -> dict[str, Any]:
    """The stack state's `object_store` (the keys stay in `<run-dir>/store/credentials.json`)."""
    return {"url": f"s3://{BUCKET}", "endpoint": f"http://{address}:{port}"}


def stack_env(state: dict[str, Any]) -> dict[str, str]:
    """The client variables for the object store of a running stack (from its state), {} if none."""
    store = state.get("object_store")
    return client_env(Path(state["run_dir"]), store["endpoint"]) if store else {}
