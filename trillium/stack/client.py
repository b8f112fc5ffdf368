"""A client of the coordinator's REST API (the CLI's, the tests' and the demo's)."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from trillium.config import API_MAX_BODY_BYTES, MAX_FORGET_VALUES
from trillium.job import JobConfig

from .procs import LauncherError, read_state, read_token

TERMINAL = ("finished", "failed", "stopped")
# A forget's body stays this far inside the coordinator's body limit (its table name and keys).
FORGET_BODY_SLACK = 4096


def forget_batches(values: list[str], max_body: int = API_MAX_BODY_BYTES) -> list[list[str]]:
    """`values` in order, cut into the fewest runs whose forget body each fits `max_body` bytes
    and MAX_FORGET_VALUES values."""
    batches: list[list[str]] = [[]]
    size = 0
    for value in values:
        cost = len(json.dumps(value)) + 2  # its JSON and the ", " between values
        if batches[-1] and (size + cost > max_body - FORGET_BODY_SLACK or len(batches[-1]) == MAX_FORGET_VALUES):
            batches.append([])
            size = 0
        batches[-1].append(value)
        size += cost
    return batches


def _describe(detail: Any) -> str:
    """An API error's detail on one line; validation errors as `field.path: problem`."""
    if isinstance(detail, list):
        return "; ".join(
            ".".join(str(p) for p in e.get("loc", ())) + f": {e.get('msg')}" if isinstance(e, dict) else str(e)
            for e in detail
        )
    return str(detail)


class ApiError(RuntimeError):
    """The coordinator answered with an error status."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {_describe(detail)}")
        self.status = status
        self.detail = detail


class CoordinatorUnavailable(RuntimeError):
    """The coordinator did not answer at all."""


class CoordinatorClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0, ca_file: str | None = None) -> None:
        """`ca_file`: the CA an https coordinator's certificate is checked against (default: the system's)."""
        self.url = url.rstrip("/")
        verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.http = httpx.Client(
            base_url=self.url + "/v1",
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}"},
            verify=verify,
        )

    @classmethod
    def for_stack(cls, run_dir: Path) -> "CoordinatorClient":
        st = read_state(run_dir)
        if not st or not st.get("coordinator_url"):
            raise LauncherError(f"no stack with a coordinator in {run_dir}: run `trillium up` first")
        return cls(st["coordinator_url"], read_token(run_dir), ca_file=(st.get("tls") or {}).get("ca_file"))

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise CoordinatorUnavailable(f"the coordinator at {self.url} did not answer: {err}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        return r.json() if r.content else None

    @staticmethod
    def _job(job_id: str, *rest: str) -> str:
        return "/".join(["/jobs", quote(job_id, safe=""), *rest])

    def submit(self, config: JobConfig) -> dict[str, Any]:
        return self._call("POST", "/jobs", json=config.model_dump(mode="json"))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", self._job(job_id))

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/jobs")

    def workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/workers")

    def pause(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", self._job(job_id, "pause"))

    def resume(self, job_id: str, checkpoint: int | None = None) -> dict[str, Any]:
        """Resume a paused job, or a stopped or failed one from a checkpoint (the newest by default)."""
        body = {"checkpoint": checkpoint} if checkpoint is not None else None
        return self._call("POST", self._job(job_id, "resume"), json=body)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", self._job(job_id, "checkpoints"))

    def request_checkpoint(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", self._job(job_id, "checkpoints"))

    def delete_checkpoint(self, job_id: str, step: int) -> None:
        self._call("DELETE", self._job(job_id, "checkpoints", str(step)))

    def stop(self, job_id: str, *, checkpoint: bool = True) -> dict[str, Any]:
        """Stop a job; with `checkpoint` (the default) after a final checkpoint at the step it stops at."""
        return self._call("POST", self._job(job_id, "stop"), json={"checkpoint": checkpoint})

    def reshard(self, job_id: str, ps_shards: int) -> dict[str, Any]:
        """Move a running job onto `ps_shards` PS shards, live (through a checkpoint and a new attempt)."""
        return self._call("POST", self._job(job_id, "reshard"), json={"ps_shards": ps_shards})

    def models(self) -> list[dict[str, Any]]:
        return self._call("GET", "/models")

    def forget(self, job_id: str, table: str, values: list[str]) -> dict[str, Any]:
        """Remove IDs from everything of a stopped, failed or finished job; returns the receipt."""
        return self._call("POST", self._job(job_id, "forget"), json={"table": table, "values": values})

    def forget_all(self, job_id: str, table: str, values: list[str]) -> list[dict[str, Any]]:
        """`forget` of any number of values, in as many requests as their bodies need (one each
        within the body limit): the receipts, one a request, in order."""
        return [self.forget(job_id, table, batch) for batch in forget_batches(values)]

    def delete(self, job_id: str) -> None:
        self._call("DELETE", self._job(job_id))

    def staleness(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", self._job(job_id, "staleness"))

    def set_staleness(self, job_id: str, bound: int | None) -> dict[str, Any]:
        """Change a job's staleness bound live; None: unbounded."""
        return self._call("PUT", self._job(job_id, "staleness"), json={"bound": bound})

    def series(self, job_id: str) -> list[dict[str, Any]]:
        """The job's series: a point a second while it trained (samples, rolling AUC, loss)."""
        return self._call("GET", self._job(job_id, "series"))

    def tables(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", self._job(job_id, "tables"))

    def follow(
        self,
        job_id: str,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
        timeout_s: float = 3600.0,
        unavailable_s: float = 60.0,
    ) -> dict[str, Any]:
        """Poll until the job ends; returns its last view. Rides out a coordinator restart
        (no answer for up to `unavailable_s`)."""
        deadline = time.monotonic() + timeout_s
        silent_since: float | None = None
        while True:
            try:
                view = self.job(job_id)
                silent_since = None
            except CoordinatorUnavailable:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > unavailable_s:
                    raise
                time.sleep(poll_s)
                continue
            if on_update:
                on_update(view)
            if view["job"]["state"] in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {view['job']['state']} after {timeout_s:.0f}s")
            time.sleep(poll_s)
