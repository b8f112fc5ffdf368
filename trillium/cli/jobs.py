"""Job control: clients of the coordinator's REST API (`jobs`, `job`, `pause`, `resume`,
`checkpoints`, `stop`, `reshard`, `staleness`, `forget`)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from trillium.stack.client import CoordinatorClient

from .app import JobId, JsonOut, RunDir, app, console, coordinator, fail, print_table


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else ""


def _bound(bound: int | None) -> str:
    return "unbounded" if bound is None else str(bound)


@app.command("jobs")
def list_jobs(run_dir: RunDir = None, as_json: JsonOut = False) -> None:
    """List the stack's jobs, oldest first."""
    with coordinator(run_dir) as client:
        jobs = client.jobs()
    if as_json:
        print(json.dumps(jobs, indent=2))
        return
    table = Table()
    table.add_column("id", no_wrap=True)  # whole, to be copied
    for column in ("state", "created", "finished", "error"):
        table.add_column(column)
    for job in jobs:
        table.add_row(
            job["id"], job["state"], _when(job["created_at"]), _when(job["finished_at"]), job.get("error") or ""
        )
    console.print(table if jobs else "no jobs")


@app.command("job")
def show_job(job_id: JobId, run_dir: RunDir = None, as_json: JsonOut = False) -> None:
    """Show a job: state, progress, staleness per rank, lost workers, evaluation."""
    with coordinator(run_dir) as client:
        view = client.job(job_id)
    if as_json:
        print(json.dumps(view, indent=2))
        return
    job, prog = view["job"], view["progress"]
    recent = prog["recent_samples_per_sec"]
    rows: list[tuple[str, Any]] = [
        ("id", job["id"]),
        ("state", job["state"]),
        ("samples", f"{prog['samples']:,} (epoch {prog['epoch']}, {prog['steps']} steps)"),
        ("samples/s", f"{prog['samples_per_sec']:,.0f} mean" + (f", {recent:,.0f} now" if recent is not None else "")),
        ("loss", "" if prog["last_loss"] is None else f"{prog['last_loss']:.4f} last, {prog['mean_loss']:.4f} mean"),
    ]
    for rank, s in view["staleness"].items():
        rows.append(
            (
                f"staleness rank {rank}",
                f"max {s['max']}, mean {s['mean']:.2f} over {s['count']} lookups (bound {_bound(s['bound'])})",
            )
        )
    if job["config"]["training"]["staleness_bound"] == "auto":
        auto = view.get("auto_bound")
        rows.append(("bound (auto)", f"{auto['bound']}: {auto['reason']}" if auto else "calibrating at k=0"))
    if view["lost_workers"]:
        rows.append(("waiting for", "; ".join(view.get("waiting_for") or view["lost_workers"])))
    rows += _stream_rows(view)
    if job.get("metrics"):
        rows.append(
            (
                "eval",
                ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in job["metrics"].items()),
            )
        )
    if job.get("error"):
        rows.append(("error", job["error"]))
    if job.get("attempt"):
        rows.append(("attempt", str(job["attempt"])))
    rows.append(("ps shards", str(view["ps_shards"]) + (" (resharding)" if view["reshard_in_progress"] else "")))
    for r in job.get("reshards", []):
        at = f" at step {r['checkpoint_step']}" if r["checkpoint_step"] is not None else ""
        why = f": {r['error']}" if r.get("error") else ""
        rows.append(
            ("reshard", f"{_when(r['requested_at'])} {r['from_shards']} → {r['to_shards']}, {r['state']}{at}{why}")
        )
    for r in job.get("recoveries", []):
        step = r["checkpoint_step"]
        origin = f"from step {step}" if step is not None else "from the beginning"
        rows.append((r["kind"], f"{_when(r['at'])} {origin}: {r['cause']}"))
    if view.get("last_checkpoint"):
        c = view["last_checkpoint"]
        rows.append(
            (
                "last checkpoint",
                f"step {c['step']} (epoch {c['epoch']}), {_when(c['created_at'])}, {c['bytes'] / 1e6:,.1f} MB",
            )
        )
    table = Table("", "", show_header=False, box=None)
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def _stream_rows(view: dict[str, Any]) -> list[tuple[str, str]]:
    """Progressive validation, the input's lag and the joiner's counts (a stream's job)."""
    rows = []
    p = view.get("progressive")
    if p and p["samples"]:
        rows.append(
            (
                "progressive",
                f"AUC {p['auc']:.4f}, log loss {p['logloss']:.4f} over the last "
                f"{p['samples']:,} of {p['scored']:,} samples scored before training",
            )
        )
        if p.get("delay_seconds"):
            rows.append(
                ("click to trained", f"p50 {p['delay_seconds']['p50']:.1f} s, p99 {p['delay_seconds']['p99']:.1f} s")
            )
    stream = view.get("stream")
    if stream:
        for i in stream["inputs"]:
            behind = "" if i["lag_seconds"] is None else f", {i['lag_seconds']:.1f} s behind"
            rows.append((f"lag {i['topic']}/{i['partition']}", f"{i['lag_messages']:,} messages{behind}"))
        for field in ("joined", "dead_letters", "skipped"):
            if stream.get(field):
                rows.append((field.replace("_", " "), ", ".join(f"{k} {v:,}" for k, v in stream[field].items())))
        for task, counts in stream.get("joined_tasks", {}).items():  # a join of a label topic per task
            rows.append((f"joined {task}", ", ".join(f"{k} {v:,}" for k, v in counts.items())))
    return rows


def _control(run_dir: Path | None, act: Callable[[CoordinatorClient], dict]) -> None:
    with coordinator(run_dir) as client:
        job = act(client)
    console.print(f"job {job['id']}: {job['state']}")


@app.command()
def pause(job_id: JobId, run_dir: RunDir = None) -> None:
    """Pause a running job: its NN ranks hold before their next step."""
    _control(run_dir, lambda client: client.pause(job_id))


@app.command()
def resume(
    job_id: JobId,
    checkpoint: Annotated[
        Optional[int], typer.Option(min=0, help="the checkpoint's step (default: the newest)")
    ] = None,
    run_dir: RunDir = None,
) -> None:
    """Resume a paused job; or a stopped or failed one from a checkpoint (the job recovers from it
    in a new attempt and goes on)."""
    _control(run_dir, lambda client: client.resume(job_id, checkpoint))


@app.command()
def checkpoints(
    job_id: JobId,
    take: Annotated[bool, typer.Option("--take", help="ask for a checkpoint of the running job now")] = False,
    delete: Annotated[Optional[int], typer.Option(min=0, help="delete the checkpoint at this step")] = None,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """List a job's complete checkpoints; --take asks for one now, --delete STEP removes one."""
    with coordinator(run_dir) as client:
        if take:
            asked = client.request_checkpoint(job_id)
            console.print(f"job {job_id}: checkpoint {asked['seq']} requested")
            return
        if delete is not None:
            client.delete_checkpoint(job_id, delete)
            console.print(f"job {job_id}: checkpoint at step {delete} deleted")
            return
        listing = client.checkpoints(job_id)
    if as_json:
        print(json.dumps(listing, indent=2))
        return
    if not listing:
        console.print(f"job {job_id} has no complete checkpoint")
        return
    rows = []
    for c in listing:
        auc = (c.get("eval") or {}).get("auc")
        bases = sorted({f["delta_of"] for f in c["files"] if f.get("delta_of") is not None})
        rows.append(
            (
                str(c["step"]),
                str(c["epoch"]),
                str(c["attempt"]),
                c["reason"],
                f"delta of {', '.join(map(str, bases))}" if bases else "full",
                _when(c["created_at"]),
                f"{c['bytes'] / 1e6:,.1f}",
                f"{c['seconds_to_write']:.2f}",
                f"{c['pause_seconds']:.3f}",
                "" if auc is None else f"{auc:.4f}",
            )
        )
    columns = ("step", "epoch", "attempt", "reason", "tables", "written", "MB", "s to write", "pause s", "eval auc")
    print_table(columns, rows)


@app.command()
def stop(
    job_id: JobId,
    no_checkpoint: Annotated[
        bool, typer.Option("--no-checkpoint", help="stop at once, without a final checkpoint")
    ] = False,
    run_dir: RunDir = None,
) -> None:
    """Stop a job: after a final checkpoint at the step it stops at (a running or paused job that
    takes checkpoints), so that `resume` goes on from there; then `stopping` until its workers have
    ended their part."""
    _control(run_dir, lambda client: client.stop(job_id, checkpoint=not no_checkpoint))


@app.command()
def reshard(
    job_id: JobId,
    ps_shards: Annotated[int, typer.Option("--ps-shards", min=1, max=64, help="the number of PS shards to go on with")],
    run_dir: RunDir = None,
) -> None:
    """Move a running job onto another number of PS shards, live: it stops at a step, takes a
    checkpoint there, and goes on from it on shards 0..N-1 (which the stack must run), each
    restoring the embedding rows it owns; no sample is lost or trained twice. `trillium job`
    shows it (`recovering`, then `running` on the new shards)."""
    _control(run_dir, lambda client: client.reshard(job_id, ps_shards))


@app.command()
def staleness(
    job_id: JobId,
    set_bound: Annotated[Optional[int], typer.Option("--set", min=0, help="the new bound K")] = None,
    unbounded: Annotated[bool, typer.Option("--unbounded", help="remove the bound, live")] = False,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """Show a job's staleness bound and the staleness observed per NN rank; change the bound
    of a running job with --set K or --unbounded."""
    if set_bound is not None and unbounded:
        fail("give --set K or --unbounded, not both")
    with coordinator(run_dir) as client:
        report = (
            client.set_staleness(job_id, set_bound) if set_bound is not None or unbounded else client.staleness(job_id)
        )
    if as_json:
        print(json.dumps(report, indent=2))
        return
    console.print(f"job {report['job_id']}: staleness bound {_bound(report['bound'])}")
    table = Table("rank", "lookups", "max", "mean", "histogram (0, 1, ..., 16+)")
    for rank, s in report["ranks"].items():
        table.add_row(rank, str(s["count"]), str(s["max"]), f"{s['mean']:.2f}", " ".join(map(str, s["histogram"])))
    console.print(table)


@app.command()
def forget(
    table: Annotated[str, typer.Option(help="the embedding table, e.g. user")],
    ids: Annotated[Path, typer.Option(help="a file of the IDs as the data has them, one a line")],
    model: Annotated[Optional[str], typer.Option(help="the model whose job to forget from")] = None,
    job: Annotated[Optional[str], typer.Option(help="the job to forget from (instead of --model)")] = None,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """Remove IDs (a user's, under the GDPR's Art. 17) from a stopped, failed or finished job: its PS
    shards, checkpoints, model versions and serving replicas; its later attempts mask them in the
    batches it had written. Prints the receipt, also kept as an audit record: one for each request
    the IDs take (a request carries what fits the API's 1 MiB body, at most 100,000 values)."""
    if (model is None) == (job is None):
        fail("name the job to forget from: --model M or --job ID")
    try:
        values = [line.strip() for line in ids.read_text().splitlines() if line.strip()]
    except OSError as err:
        fail(f"--ids {ids}: {err.strerror or err}")
    if not values:
        fail(f"--ids {ids} holds no ID")
    with coordinator(run_dir) as client:
        if job is None:
            entry = next((m for m in client.models() if m["model"] == model), None)
            if entry is None:
                fail(f"no model {model!r} is published on this stack")
            job = entry["job_id"]
        receipts = client.forget_all(job, table, values)
    if as_json:
        print(json.dumps(receipts, indent=2))
        return
    for receipt in receipts:
        listing = Table("place", "name", "rows removed", "note")
        for place in receipt["places"]:
            listing.add_row(place["kind"], place["name"], str(place["rows_removed"]), place.get("note") or "")
        console.print(listing)
        complete = "complete" if receipt["complete"] else "INCOMPLETE (see the notes)"
        console.print(
            f"receipt {receipt['id']}: job {receipt['job_id']}, table {receipt['table']}: {receipt['values']} values, "
            f"{receipt['ids']} IDs, {receipt['rows_removed']} rows removed from the PS shards; {complete}"
        )
