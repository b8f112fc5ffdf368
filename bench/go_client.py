"""The serving benches' Go gRPC client (scripts/grpcload, built on first use): the same requests
as their Python client sends, from a client whose own cost per call is tens of microseconds, so
that a figure beside the Python client's says how much of a call's latency is the client's."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trillium import stack

BINARY = stack.REPO_ROOT / ".cache/bin/grpcload"


def build() -> Path:
    """The tool, built by `make` when missing or older than its sources."""
    subprocess.run(["make", "-s", str(BINARY.relative_to(stack.REPO_ROOT))], cwd=stack.REPO_ROOT, check=True)
    return BINARY


def run(
    address: str,
    token: str,
    model: str,
    bodies: list[bytes],
    *,
    rate: float | None,
    seconds: float,
    clients: int,
) -> dict[str, Any]:
    """Calls for `seconds`: an open loop at `rate` a second, or `clients` closed loops; the
    figures as `bench/serving.py`'s Python client reports them. A failed call fails the run."""
    with tempfile.TemporaryDirectory(prefix="grpcload-") as tmp:
        token_file, bodies_file = Path(tmp) / "token", Path(tmp) / "bodies.json"
        token_file.write_text(token)
        bodies_file.write_text(json.dumps([b.decode() for b in bodies]))
        argv = [str(build()), "-addr", address, "-token-file", str(token_file), "-model", model]
        argv += ["-bodies", str(bodies_file), "-seconds", str(seconds)]
        argv += ["-rate", str(rate)] if rate is not None else ["-clients", str(clients)]
        out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    if out["errors"]:
        raise RuntimeError(f"grpcload: {out['errors']} calls failed, the first: {out['first_error']}")
    return {
        k: round(out[k], 3) if isinstance(out[k], float) else out[k]
        for k in ("requests", "requests_per_sec", "p50_ms", "p99_ms")
    }
