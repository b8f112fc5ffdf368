"""Sharded serving as the end-to-end tests see it (test_sharded_serving.py,
test_sharded_multitask.py): the frontend in front of a stack's serving shards, and the version a
shard process serves."""

from __future__ import annotations

from pathlib import Path

import httpx

from trillium import stack


class Frontend:
    """The sharded stack's serving frontend, over REST with the stack's token."""

    def __init__(self, run_dir: Path) -> None:
        st = stack.read_state(run_dir)
        url = next(p["http_url"] for p in st["processes"] if p["role"] == "serving")
        headers = {"Authorization": f"Bearer {stack.read_token(run_dir)}"}
        self.http = httpx.Client(base_url=url, timeout=30.0, headers=headers)

    def version(self, model: str) -> int | None:
        r = self.http.get(f"/v1/models/{model}")
        return r.json()["version"] if r.status_code == 200 else None

    def ready(self) -> bool:
        return self.http.get("/readyz").status_code == 200

    def ask(self, model: str, instances: list[dict]) -> httpx.Response:
        return self.http.post(f"/v1/models/{model}:predict", json={"instances": instances})


def shard_view(run_dir: Path, process: int, model: str) -> dict | None:
    """Serving shard process `process`'s view of `model` (`GET /v1/models/{model}`: its version, its
    slice's rows and bytes per table), or None: none loaded, or it does not answer."""
    st = stack.read_state(run_dir)
    url = next(p["http_url"] for p in st["processes"] if p["name"] == f"serving_shard-{process}")
    try:
        r = httpx.get(f"{url}/v1/models/{model}", headers={"Authorization": f"Bearer {stack.read_token(run_dir)}"})
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def shard_version(run_dir: Path, process: int, model: str) -> int | None:
    """The version serving shard process `process` serves (None: none, or it does not answer)."""
    view = shard_view(run_dir, process, model)
    return view["version"] if view is not None else None
