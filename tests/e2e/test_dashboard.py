"""Every metric the Grafana dashboard (deploy/grafana/dashboards/trillium.json) queries is exported by
the services, with the labels its legends name: scraped, with the bearer token, from every /metrics
endpoint of a real stack while it trains."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from pipeline_helpers import with_training
from prometheus_client.parser import text_string_to_metric_families

from trillium import stack
from trillium.stack.client import CoordinatorClient

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/trillium.json"
METRIC = re.compile(r"\btrillium_[a-z0-9_]+")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(t["expr"], t.get("legendFormat", "")) for p in panels for t in p["targets"]]


def _scrape(run_dir: Path, token: str) -> dict[str, set[str]]:
    """Every sample name exported by the stack's services now, with the label names it carries."""
    exported: dict[str, set[str]] = {}
    for proc in stack.read_state(run_dir)["processes"]:
        if not proc.get("http_url"):
            continue
        r = httpx.get(f"{proc['http_url']}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        r.raise_for_status()
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def test_the_dashboard_queries_only_exported_metrics(training_stack, tiny_job) -> None:
    queries = _queries()
    wanted = {m for expr, _ in queries for m in METRIC.findall(expr)}
    assert len(wanted) >= 10, wanted  # the dashboard's panels: throughput, loss, staleness, latency, lag, PS
    token = stack.read_token(training_stack, "observe")
    # /metrics needs a token, like everything but health: the scrapers' (Prometheus's) reads it.
    coordinator = stack.read_state(training_stack)["coordinator_url"]
    assert httpx.get(f"{coordinator}/metrics").status_code == 401
    # Long enough for the coordinator's slower samples (Kafka lag, tables: every 5 s) to run mid-job.
    job = with_training(tiny_job, epochs=40)
    client = CoordinatorClient.for_stack(training_stack)
    job_id = client.submit(job)["id"]
    exported: dict[str, set[str]] = {}
    try:
        deadline = time.monotonic() + 240
        while not wanted <= exported.keys():
            state = client.job(job_id)["job"]["state"]
            for name, labels in _scrape(training_stack, token).items():
                exported.setdefault(name, set()).update(labels)
            if state in ("finished", "failed", "stopped") or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        if client.job(job_id)["job"]["state"] not in ("finished", "failed", "stopped"):
            client.stop(job_id)
            client.follow(job_id, timeout_s=120)
        client.close()
    assert wanted <= exported.keys(), f"queried but never exported: {sorted(wanted - exported.keys())}"
    for expr, legend in queries:
        labels = set().union(*(exported[m] for m in METRIC.findall(expr)))
        named = set(LEGEND_LABEL.findall(legend))
        assert named <= labels, f"{legend!r} names {named - labels}, which {expr!r} does not carry"
