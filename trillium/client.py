"""A client of the coordinator's REST API (the CLI's, the tests' and the demo's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from trillium import launcher
from trillium.job import JobConfig

TERMINAL = ("finished", "failed", "stopped")


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class CoordinatorClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/") + "/v1", timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})

    @classmethod
    def for_stack(cls, run_dir: Path) -> "CoordinatorClient":
        st = launcher.read_state(run_dir)
        if not st or not st.get("coordinator_url"):
            raise launcher.LauncherError(f"no stack with a coordinator in {run_dir}: run `trillium up` first")
        return cls(st["coordinator_url"], launcher.read_token(run_dir))

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        return r.json() if r.content else None

    def submit(self, config: JobConfig) -> dict[str, Any]:
        return self._call("POST", "/jobs", json=config.model_dump(mode="json"))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}")

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/jobs")

    def workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/workers")

    def follow(self, job_id: str, on_update: Callable[[dict[str, Any]], None] | None = None,
               poll_s: float = 0.5, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Poll until the job ends; returns its last view."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.job(job_id)
            if on_update:
                on_update(view)
            if view["job"]["state"] in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {view['job']['state']} after {timeout_s:.0f}s")
            time.sleep(poll_s)
