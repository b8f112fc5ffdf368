"""The faults only a network has, on the cluster: a host cut off without dying (both ways, and one
way only), a slow link, a lossy one. Each runs the synthetic job with checkpoints, asserts that
every epoch trained each row exactly once and that the model equals an uninterrupted run's, and
reports how long the fault took to detect and the job to recover from it."""

from __future__ import annotations

import time

import pytest
from timeline import FAULT_EPOCHS, HOLD_S, after_first_checkpoint, check, cluster_job, record_fault

from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(
    "victim",
    ["embedding_ps-1", "nn_worker-1", "embedding_worker-0", "data_loader-0", "kafka", "redis", "coordinator-0"],
)
def test_a_host_cut_off_for_30s_mid_job_then_healed(cluster, network: Network, uninterrupted, victim) -> None:
    _, timeline = after_first_checkpoint(cluster)
    attempt = timeline.attempt_before(time.monotonic())
    cut = network.partition(victim)
    time.sleep(HOLD_S)  # the fault's length: what is tested is what the stack does through it
    healed = network.heal()
    view = timeline.wait(300)
    check(view, uninterrupted)
    detected, resumed = timeline.new_attempt_at(cut, attempt), timeline.progress_at(healed)
    record_fault(f"{victim} cut off {HOLD_S:.0f} s", cut, detected, healed, resumed, view)
    assert resumed is not None, "the job never trained again after the heal"


def test_a_one_way_partition_mid_job(cluster, network: Network, uninterrupted) -> None:
    """The embedding worker's packets to a PS shard are dropped; the shard's to it arrive."""
    _, timeline = after_first_checkpoint(cluster)
    attempt = timeline.attempt_before(time.monotonic())
    cut = network.one_way("embedding_worker-0", "embedding_ps-0")
    time.sleep(HOLD_S)
    healed = network.heal()
    view = timeline.wait(300)
    check(view, uninterrupted)
    detected, resumed = timeline.new_attempt_at(cut, attempt), timeline.progress_at(healed)
    record_fault("embedding_worker-0 -> embedding_ps-0 dropped 30 s", cut, detected, healed, resumed, view)
    assert resumed is not None


def test_a_slow_link_slows_the_job_and_declares_nobody_dead(cluster, network: Network, uninterrupted) -> None:
    """A PS host capped at 10 Mbit/s for 60 s: late heartbeats are not lost ones."""
    _, timeline = after_first_checkpoint(cluster)
    capped = time.monotonic()
    network.cap("embedding_ps-0", 10)
    time.sleep(60.0)
    healed = network.heal()
    view = timeline.wait(300)
    check(view, uninterrupted)
    assert view["job"]["recoveries"] == [], view["job"]["recoveries"]
    record_fault("embedding_ps-0 at 10 Mbit/s 60 s", capped, None, healed, timeline.progress_at(healed), view)


def test_a_lossy_network_the_whole_job(cluster, network: Network, uninterrupted) -> None:
    """2% of the frames between any two hosts dropped from submit to the end."""
    network.loss(20)
    started = time.monotonic()
    client = CoordinatorClient.for_stack(cluster)
    try:
        view = client.follow(client.submit(cluster_job(FAULT_EPOCHS))["id"], timeout_s=400)
    finally:
        client.close()
    check(view, uninterrupted)
    record_fault("2% loss on every link, whole job", started, None, time.monotonic(), None, view)
