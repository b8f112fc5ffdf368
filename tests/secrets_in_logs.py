"""No log of a stack holds one of its secrets: checked over every log a stack wrote, after a whole
test session of jobs, recoveries and refusals ran on it."""

from __future__ import annotations

from pathlib import Path


def assert_no_secret_in_logs(run_dir: Path, secrets: list[str]) -> None:
    secrets = [s for s in secrets if s]
    assert secrets, "no secret to look for"
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert logs, f"no logs in {run_dir / 'logs'}"
    found = [f"{log.name}: {secret[:4]}…" for log in logs for secret in secrets if secret.encode() in log.read_bytes()]
    assert not found, f"secrets in the stack's logs: {found}"
