"""`staleness_bound: auto` across a network: the bound a job chooses follows the round trip its
lookups and gradients cross (linkdelay on every host but the NN ranks', whose dense all-reduce
stays on a fast link, as PERSIA's GPU hosts in one rack), hides the wait it measured, and
`trillium job` says why."""

from __future__ import annotations

import pytest
from timeline import cluster_job
from typer.testing import CliRunner

from trillium.cli import app
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

pytestmark = pytest.mark.cluster

NN_HOSTS = ("nn_worker-0", "nn_worker-1")


def _auto_job(cluster, network: Network, rtt_ms: float) -> tuple[dict, str]:
    """Train the cluster job with an automatic bound, `rtt_ms` added to every link into the
    loader, the embedding worker, the PS shards, Kafka, Redis and the coordinator; return its
    view and what `trillium job` printed of it."""
    network.round_trip(rtt_ms)
    for name in NN_HOSTS:
        network.delay(name, 0)
    client = CoordinatorClient.for_stack(cluster)
    try:
        job_id = client.submit(cluster_job(epochs=4, staleness_bound="auto", name="auto"))["id"]
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
        network.heal()
    shown = CliRunner().invoke(app, ["job", job_id, "--run-dir", str(cluster)])
    assert shown.exit_code == 0, shown.output
    return view, shown.output


def _wait_after_choice_ms(view: dict) -> float:
    """The slowest rank's mean wait for its embeddings a step once the bound was chosen: its
    whole wait less the calibration's (the chosen steps at the measured wait)."""
    choice = view["auto_bound"]
    calibration_s = choice["steps"] * choice["wait_ms"] / 1e3
    return max(
        (r["seconds"]["lookup_wait"] - calibration_s) / (r["steps"] - choice["steps"]) * 1e3
        for r in view["results"].values()
    )


def test_the_automatic_bound_follows_the_round_trip_and_hides_the_wait(cluster, network: Network) -> None:
    near, near_shown = _auto_job(cluster, network, 0.0)
    far, far_shown = _auto_job(cluster, network, 20.0)
    for view in (near, far):
        assert view["job"]["state"] == "finished", view["job"]["error"]
        assert view["auto_bound"] is not None, "no bound chosen"
        assert view["auto_bound"]["steps"] < view["job"]["config"]["training"]["epochs"] * 20 - 10
    a, b = near["auto_bound"], far["auto_bound"]
    after = {"near": _wait_after_choice_ms(near), "far": _wait_after_choice_ms(far)}
    print(f"\nauto bound at ~0 ms: {a['reason']}\nauto bound at 20 ms: {b['reason']}\nwait a step after: {after}")
    # At k = 0 a step waits for a gradient push, its application and the next lookup: several
    # round trips, each 20 ms longer; the rank's own step does not cross the slow links.
    assert b["wait_ms"] >= a["wait_ms"] + 2 * 20.0, (a, b)
    assert b["bound"] > a["bound"] >= 1, (a, b)
    # Once chosen, the lookups come in time: what is left of the wait is a small part of it.
    assert after["far"] < 0.25 * b["wait_ms"], (after, b)
    for choice, shown in ((a, near_shown), (b, far_shown)):
        assert "bound (auto)" in shown and f"= {choice['bound']}" in " ".join(shown.split())
