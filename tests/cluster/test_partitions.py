"""The faults only a network has, on the cluster: a host cut off without dying (both ways, and one
way only), a slow link, a lossy one. Each runs the synthetic job with checkpoints, asserts that
every epoch trained each row exactly once and that the model equals an uninterrupted run's, and
reports how long the fault took to detect and the job to recover from it."""

from __future__ import annotations

import time

import pytest
from net import Network
from timeline import Timeline, assert_exactly_once, cluster_job, record_fault

from trillium.stack.client import CoordinatorClient

pytestmark = pytest.mark.cluster

EPOCHS = 30  # 600 steps: the fault begins after the first checkpoint (step 40), long before the end
HOLD_S = 30.0
AUC_TOLERANCE = 1e-3  # synchronous: a recovered run repeats an uninterrupted one's steps


@pytest.fixture(scope="module")
def uninterrupted(cluster) -> dict:
    client = CoordinatorClient.for_stack(cluster)
    try:
        view = client.follow(client.submit(cluster_job(EPOCHS))["id"], timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished" and view["job"]["recoveries"] == [], view["job"]
    return view["job"]["metrics"]


def _after_first_checkpoint(cluster) -> tuple[str, Timeline]:
    client = CoordinatorClient.for_stack(cluster)
    try:
        job_id = client.submit(cluster_job(EPOCHS))["id"]
        timeline = Timeline(cluster, job_id)
        deadline = time.monotonic() + 120
        while (view := client.job(job_id))["last_checkpoint"] is None:
            assert view["job"]["state"] == "running" or view["job"]["state"] in ("submitted", "starting"), view["job"]
            assert time.monotonic() < deadline, "no first checkpoint in 120 s"
            time.sleep(0.05)
        assert view["progress"]["samples"] < EPOCHS * 2000 // 3, "the job ran too far before the fault"
        return job_id, timeline
    finally:
        client.close()


def _check(view: dict, uninterrupted: dict) -> None:
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert_exactly_once(view, cluster_job(EPOCHS))
    assert abs(view["job"]["metrics"]["auc"] - uninterrupted["auc"]) <= AUC_TOLERANCE


@pytest.mark.parametrize(
    "victim",
    ["embedding_ps-1", "nn_worker-1", "embedding_worker-0", "data_loader-0", "kafka", "redis", "coordinator-0"],
)
def test_a_host_cut_off_for_30s_mid_job_then_healed(cluster, network: Network, uninterrupted, victim) -> None:
    _, timeline = _after_first_checkpoint(cluster)
    attempt = timeline.attempt_before(time.monotonic())
    cut = network.partition(victim)
    time.sleep(HOLD_S)  # the fault's length: what is tested is what the stack does through it
    healed = network.heal()
    view = timeline.wait(300)
    _check(view, uninterrupted)
    detected, resumed = timeline.new_attempt_at(cut, attempt), timeline.progress_at(healed)
    record_fault(f"{victim} cut off {HOLD_S:.0f} s", cut, detected, healed, resumed, view)
    assert resumed is not None, "the job never trained again after the heal"


def test_a_one_way_partition_mid_job(cluster, network: Network, uninterrupted) -> None:
    """The embedding worker's packets to a PS shard are dropped; the shard's to it arrive."""
    _, timeline = _after_first_checkpoint(cluster)
    attempt = timeline.attempt_before(time.monotonic())
    cut = network.one_way("embedding_worker-0", "embedding_ps-0")
    time.sleep(HOLD_S)
    healed = network.heal()
    view = timeline.wait(300)
    _check(view, uninterrupted)
    detected, resumed = timeline.new_attempt_at(cut, attempt), timeline.progress_at(healed)
    record_fault("embedding_worker-0 -> embedding_ps-0 dropped 30 s", cut, detected, healed, resumed, view)
    assert resumed is not None


def test_a_slow_link_slows_the_job_and_declares_nobody_dead(cluster, network: Network, uninterrupted) -> None:
    """A PS host capped at 10 Mbit/s for 60 s: late heartbeats are not lost ones."""
    _, timeline = _after_first_checkpoint(cluster)
    capped = time.monotonic()
    network.cap("embedding_ps-0", 10)
    time.sleep(60.0)
    healed = network.heal()
    view = timeline.wait(300)
    _check(view, uninterrupted)
    assert view["job"]["recoveries"] == [], view["job"]["recoveries"]
    record_fault("embedding_ps-0 at 10 Mbit/s 60 s", capped, None, healed, timeline.progress_at(healed), view)


def test_a_lossy_network_the_whole_job(cluster, network: Network, uninterrupted) -> None:
    """2% of the frames between any two hosts dropped from submit to the end."""
    network.loss(20)
    started = time.monotonic()
    client = CoordinatorClient.for_stack(cluster)
    try:
        view = client.follow(client.submit(cluster_job(EPOCHS))["id"], timeout_s=400)
    finally:
        client.close()
    _check(view, uninterrupted)
    record_fault("2% loss on every link, whole job", started, None, time.monotonic(), None, view)
