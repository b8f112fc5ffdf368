"""`staleness_bound: auto` across a network: the bound a job chooses grows with the round trip
its lookups and gradients cross (linkdelay on every host), and `trillium job` says why."""

from __future__ import annotations

import pytest
from timeline import cluster_job
from typer.testing import CliRunner

from trillium.cli import app
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

pytestmark = pytest.mark.cluster


def _auto_job(cluster, network: Network, rtt_ms: float) -> tuple[dict, str]:
    """Train the cluster job with an automatic bound across links of `rtt_ms` added; return its
    view and what `trillium job` printed of it."""
    network.round_trip(rtt_ms)
    client = CoordinatorClient.for_stack(cluster)
    try:
        job_id = client.submit(cluster_job(epochs=3, staleness_bound="auto", name="auto"))["id"]
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
        network.heal()
    shown = CliRunner().invoke(app, ["job", job_id, "--run-dir", str(cluster)])
    assert shown.exit_code == 0, shown.output
    return view, shown.output


def test_the_automatic_bound_grows_with_the_round_trip(cluster, network: Network) -> None:
    near, near_shown = _auto_job(cluster, network, 0.0)
    far, far_shown = _auto_job(cluster, network, 20.0)
    for view in (near, far):
        assert view["job"]["state"] == "finished", view["job"]["error"]
        assert view["auto_bound"] is not None, "no bound chosen in 60 steps"
    a, b = near["auto_bound"], far["auto_bound"]
    print(f"\nauto bound at ~0 ms: {a['reason']}\nauto bound at 20 ms: {b['reason']}")
    # At k = 0 a step waits for a gradient push, its application and the next lookup: several
    # round trips, each 20 ms longer.
    assert b["wait_ms"] >= a["wait_ms"] + 2 * 20.0, (a, b)
    assert b["bound"] > a["bound"] >= 1
    # The ranks stepped at that bound once it was chosen: the staleness they saw reached it.
    assert max(s["max"] for s in far["staleness"].values()) > a["bound"]
    for choice, shown in ((a, near_shown), (b, far_shown)):
        assert "bound (auto)" in shown and f"= {choice['bound']}" in " ".join(shown.split())
