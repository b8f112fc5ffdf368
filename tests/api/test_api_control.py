"""Job control through the REST API and the CLI on a real stack: pause really holds the NN
ranks, a live staleness bound is respected from the next lookup on, stop ends a job, and a
coordinator killed mid-job comes back with every job, state and worker."""

from __future__ import annotations

import os
import signal
import time

import httpx
import redis
import yaml
from typer.testing import CliRunner
from waiting import wait_until

from trillium import stack
from trillium.cli import app
from trillium.job import JobConfig


def _job(base: JobConfig, **training) -> JobConfig:
    return base.model_copy(update={"training": base.training.model_copy(update=training)})


def _samples(api_stack, job_id: str) -> int:
    return api_stack.http.get(f"/jobs/{job_id}").json()["progress"]["samples"]


def _held_samples(api_stack, job_id: str, timeout_s: float = 30.0) -> int:
    """The sample count once every NN rank holds (a pause reaches the ranks with a heartbeat) and
    its feed has settled: a rank reports its progress before it holds and steps no more, and a
    settled feed has answered every lookup ahead and starts no other while the rank holds."""

    def settled() -> bool:
        ranks = [w for w in api_stack.http.get("/workers").json() if w["role"] == "nn_worker"]
        held = [(w["health"].get("holding") or {}).get("lookups_settled") for w in ranks]
        return len(ranks) == 2 and all(held)

    wait_until(settled, "every NN rank to hold, its lookups ahead answered", timeout_s)
    return _samples(api_stack, job_id)


def _histogram(api_stack, job_id: str) -> list[int]:
    """Lookups by staleness, all ranks together."""
    ranks = api_stack.http.get(f"/jobs/{job_id}/staleness").json()["ranks"].values()
    return [sum(col) for col in zip(*(r["histogram"] for r in ranks), strict=True)]


def _restart_coordinator(api_stack) -> None:
    """SIGKILL the coordinator and wait for the supervisor to bring it back."""
    before = next(p for p in stack.read_state(api_stack.run_dir)["processes"] if p["name"] == "coordinator-0")
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        proc = next(p for p in stack.read_state(api_stack.run_dir)["processes"] if p["name"] == "coordinator-0")
        if proc["pid"] != before["pid"]:
            try:
                if httpx.get(api_stack.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        assert time.monotonic() < deadline, "the coordinator was not restarted"
        time.sleep(0.2)


def test_stop_and_live_control_through_the_cli(api_stack, tiny_job) -> None:
    cli = CliRunner()

    def run(*args: str) -> str:
        result = cli.invoke(app, [*args, "--run-dir", str(api_stack.run_dir)])
        assert result.exit_code == 0, result.output
        return result.output

    job = api_stack.http.post("/jobs", json=_job(tiny_job, staleness_bound=2, epochs=20).model_dump(mode="json"))
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    assert job_id in run("jobs")
    api_stack.wait_for(job_id, {"running"})

    assert f"job {job_id}: paused" in run("pause", job_id)
    assert "bound 3" in run("staleness", job_id, "--set", "3")
    assert api_stack.http.get(f"/jobs/{job_id}/staleness").json()["bound"] == 3
    assert "bound unbounded" in run("staleness", job_id, "--unbounded")
    assert api_stack.http.get(f"/jobs/{job_id}/staleness").json()["bound"] is None
    assert "paused" in run("job", job_id)
    assert f"job {job_id}: running" in run("resume", job_id)

    # At once: a stop with its final checkpoint would depend on whether a step was trained yet.
    assert f"job {job_id}: stopping" in run("stop", job_id, "--no-checkpoint")
    view = api_stack.wait_for(job_id, {"stopped", "failed"}, timeout_s=60)
    assert view["job"]["state"] == "stopped", view["job"]["error"]
    assert view["progress"]["samples"] < 20 * 1000  # it did not run to the end

    # API errors end a command with one clear line.
    for args, expected in [
        (("resume", job_id), f"HTTP 409: job {job_id} has no complete checkpoint to recover from"),
        (("pause", "no-such-[bold]-job"), "HTTP 404: no job 'no-such-[bold]-job'"),  # no markup
        (("pause", "no-such-job"), "HTTP 404: no job 'no-such-job'"),
        (("staleness", job_id, "--set", "1"), "HTTP 409"),
    ]:
        result = cli.invoke(app, [*args, "--run-dir", str(api_stack.run_dir)])
        assert result.exit_code == 1 and expected in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_pause_resume_live_staleness_and_coordinator_restart(api_stack, tiny_job) -> None:
    """One job through its life: what it refuses while it runs, a pause that holds, a bound
    changed and a checkpoint asked for while paused, the coordinator killed, a resume to the end
    keeping the new bound, and a delete that leaves nothing behind."""
    # Unbounded, 400 steps: lookups run ahead of the gradients (staleness > 0) until the bound
    # changes. Long enough that the pause lands mid-job: at 80 steps a clean-clone run had trained
    # all of them before it did.
    config = _job(tiny_job, staleness_bound=None, epochs=20, batch_size=25)
    total = 20 * 1000
    submitted = api_stack.http.post(
        "/jobs", content=yaml.safe_dump(config.model_dump(mode="json")), headers={"Content-Type": "application/yaml"}
    )
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    api_stack.wait_for(job_id, {"running"})
    _refused_while_running(api_stack, job_id, config)
    paused_at = _paused_mid_job(api_stack, job_id, total)
    histogram_at_change = _bound_changed_and_checkpoint_asked_while_paused(api_stack, job_id)
    _restart_coordinator(api_stack)
    _everything_survived_the_restart(api_stack, job_id, config, paused_at)
    _resumed_to_the_end_within_the_new_bound(api_stack, job_id, histogram_at_change, total)
    _deleted_without_a_trace(api_stack, job_id)


def _refused_while_running(api_stack, job_id: str, config: JobConfig) -> None:
    """Illegal transitions, a second job, and reshards the stack or the job cannot take (the
    stack runs 2 PS shards; the job is on 2)."""
    http = api_stack.http
    assert http.post(f"/jobs/{job_id}/resume").status_code == 409
    assert http.delete(f"/jobs/{job_id}").status_code == 409
    other = http.post("/jobs", json=config.model_dump(mode="json"))
    assert other.status_code == 409 and "one job runs at a time" in other.json()["detail"]
    more = http.post(f"/jobs/{job_id}/reshard", json={"ps_shards": 3})
    assert (
        more.status_code == 409
        and "ps_shards: 3 needs embedding_ps-0..2, and embedding_ps-2 is not registered" in (more.json()["detail"])
    )
    same = http.post(f"/jobs/{job_id}/reshard", json={"ps_shards": 2})
    assert same.status_code == 409 and "already runs on 2 PS shards" in same.json()["detail"]
    _workers_refuse_while_running(api_stack, job_id)


def _workers_refuse_while_running(api_stack, job_id: str) -> None:
    """A worker does not take the coordinator's word for it: a caller with the services' token (the
    coordinator or not) cannot have a PS shard forget rows of the running job, nor a worker write
    its part to a location outside the stack's roots or of a scheme no object store has."""
    workers = {w["name"]: w["http_url"] for w in api_stack.http.get("/workers").json()}
    auth = {"Authorization": f"Bearer {api_stack.scope_token('services')}"}
    job = api_stack.http.get(f"/jobs/{job_id}").json()["job"]
    table = next(iter(job["config"]["tables"]))
    ps, rank = workers["embedding_ps-0"], workers["nn_worker-0"]
    forget = httpx.post(f"{ps}/job/forget", json={"job_id": job_id, "table": table, "ids": [1, 2, 3]}, headers=auth)
    assert forget.status_code == 409 and f"job {job_id} is running" in forget.json()["detail"], forget.text
    cut = {"job_id": job_id, "attempt": job["attempt"], "step": 1}
    for url, route in ((ps, "/job/capture"), (rank, "/job/release")):
        for location in ("ftp://attacker.example/drop", "https://attacker.example/upload", "/etc/trillium"):
            r = httpx.post(url + route, json=cut | {"location": location}, headers=auth)
            assert r.status_code == 422 and "outside the roots this stack allows" in r.json()["detail"], (route, r.text)


def _paused_mid_job(api_stack, job_id: str, total: int) -> int:
    """Pause once training has begun: every rank holds and its lookups ahead are done; returns the
    sample count where they hold."""
    http = api_stack.http
    wait_until(lambda: _samples(api_stack, job_id) > 0, "training progress", 60, every_s=0.05)
    assert http.post(f"/jobs/{job_id}/pause").json()["state"] == "paused"
    paused_at = _held_samples(api_stack, job_id)
    view = http.get(f"/jobs/{job_id}").json()
    assert view["job"]["state"] == "paused" and view["progress"]["samples"] == paused_at
    assert 0 < paused_at < total
    paused = http.post(f"/jobs/{job_id}/reshard", json={"ps_shards": 1})
    assert paused.status_code == 409 and "only a running job can be resharded (resume it first)" in paused.text
    return paused_at


def _bound_changed_and_checkpoint_asked_while_paused(api_stack, job_id: str) -> list[int]:
    """The unbounded lookups ran ahead; bound it to 0 (synchronous), live, and ask for a
    checkpoint (taken at the step the ranks hold before). Returns the staleness histogram then."""
    http = api_stack.http
    before = http.get(f"/jobs/{job_id}/staleness").json()
    assert before["bound"] is None and max(r["max"] for r in before["ranks"].values()) > 0
    changed = http.put(f"/jobs/{job_id}/staleness", json={"bound": 0})
    assert changed.status_code == 200 and changed.json()["bound"] == 0
    histogram_at_change = _histogram(api_stack, job_id)
    checkpoint = http.post(f"/jobs/{job_id}/checkpoints")
    assert checkpoint.status_code == 202 and checkpoint.json()["state"] == "requested"
    assert checkpoint.json()["seq"] == 1
    return histogram_at_change


def _everything_survived_the_restart(api_stack, job_id: str, config: JobConfig, paused_at: int) -> None:
    """The job, its state, its live bound, the checkpoint asked for, the workers, the tables and
    the gauges, after the coordinator was killed."""
    http = api_stack.http
    view = http.get(f"/jobs/{job_id}").json()
    assert view["job"]["state"] == "paused" and view["progress"]["samples"] == paused_at
    assert view["lost_workers"] == []
    assert http.get(f"/jobs/{job_id}/staleness").json()["bound"] == 0
    listing = wait_until(
        lambda: http.get(f"/jobs/{job_id}/checkpoints").json(), "the checkpoint asked for while paused", 60
    )
    assert [c["reason"] for c in listing] == ["request"]
    steps = paused_at // (2 * config.training.batch_size)  # 2 ranks
    assert listing[0]["step"] == steps - 1 and listing[0]["bytes"] > 0
    assert {f["name"] for f in listing[0]["files"]} == {
        "dense.pt",
        "rank-0.json",
        "rank-1.json",
        "ps-0.snap",
        "ps-1.snap",
        "ps-0.ledger.json",
        "ps-1.ledger.json",
        "loader-0.json",
    }
    assert http.get(f"/jobs/{job_id}").json()["last_checkpoint"]["step"] == steps - 1
    workers = http.get("/workers").json()
    assert len(workers) == 7 and all(w["status"] != "lost" for w in workers), workers
    tables = http.get(f"/jobs/{job_id}/tables").json()
    assert set(tables["tables"]) == {"a", "b"} and len(tables["shards"]) == 2
    for name, stats in tables["tables"].items():
        assert stats["rows"] > 0 and stats["memory_bytes"] > 0 and stats["admitted"] >= stats["rows"]
        assert stats["rows"] == sum(s["tables"][name]["rows"] for s in tables["shards"])
    # The restarted coordinator's gauges.
    table_rows = f'trillium_job_table_rows{{job="{job_id}",table="a"}}'

    def gauges() -> str | None:
        text = http.get(api_stack.url + "/metrics").text
        return text if table_rows in text else None

    metrics = wait_until(gauges, "the table gauges", 30)
    assert f'trillium_job_staleness_bound{{job="{job_id}"}} 0.0' in metrics
    assert f'trillium_job_samples_per_second{{job="{job_id}"}} 0.0' in metrics  # paused
    assert _samples(api_stack, job_id) == paused_at


def _resumed_to_the_end_within_the_new_bound(
    api_stack, job_id: str, histogram_at_change: list[int], total: int
) -> None:
    """Resumed, it runs to the end, and every lookup after the change kept to the new bound."""
    http = api_stack.http
    assert http.post(f"/jobs/{job_id}/resume").json()["state"] == "running"
    view = api_stack.wait_for(job_id, {"finished", "failed", "stopped"})
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert view["progress"]["samples"] == total
    assert view["job"]["metrics"]["auc"] > 0.5
    after_change = [now - then for now, then in zip(_histogram(api_stack, job_id), histogram_at_change, strict=True)]
    assert sum(after_change) >= 10, after_change  # enough lookups happened after the change
    assert after_change[1:] == [0] * (len(after_change) - 1), f"lookups staler than 0 after the change: {after_change}"
    assert http.post(f"/jobs/{job_id}/checkpoints").status_code == 409  # nothing left to checkpoint
    finished = http.post(f"/jobs/{job_id}/reshard", json={"ps_shards": 1})
    assert finished.status_code == 409 and f"job {job_id} is finished" in finished.json()["detail"]
    assert view["ps_shards"] == 2 and view["reshard_in_progress"] is False and view["job"]["reshards"] == []


def _deleted_without_a_trace(api_stack, job_id: str) -> None:
    """Deleting it removes every key it had in Redis."""
    http = api_stack.http
    assert http.delete(f"/jobs/{job_id}").status_code == 204
    assert http.get(f"/jobs/{job_id}").status_code == 404
    assert job_id not in [j["id"] for j in http.get("/jobs").json()]
    r = redis.Redis.from_url(api_stack.redis_url)
    try:
        assert r.keys(f"trillium:job:{job_id}:*") == []
    finally:
        r.close()
