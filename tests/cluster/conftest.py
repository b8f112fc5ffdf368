"""A cluster of hosts on this machine (`trillium up --cluster`): every process of the stack, Kafka
and Redis included, on a network namespace of its own, and the controls of its links
(`trillium.stack.links.Network`; every host's connections through linkdelay, at no delay until a
test sets one). Runs as root only (`make test-cluster`); elsewhere every test here is skipped,
once, saying why."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from secrets_in_logs import assert_no_secret_in_logs
from timeline import FAULT_EPOCHS, FAULTS, cluster_job

from trillium import stack
from trillium.config import StackTopology
from trillium.job.record import ACTIVE
from trillium.scopes import SCOPES
from trillium.stack import object_store, tls
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

TOPOLOGY = StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=1, serving_replicas=1)


def pytest_collection_modifyitems(config, items) -> None:
    # The replacement test leaves its shard's original fenced out and the replacement gone with the
    # test: the stack has no embedding_ps-1 after it, so it runs after every other cluster test.
    items.sort(key=lambda item: item.fspath.basename == "test_replacement.py")
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    why = (
        "a cluster of hosts needs root (network namespaces, veth, a bridge)"
        if os.geteuid() != 0
        else f"a cluster of hosts needs {', '.join(missing)} (make test-cluster installs them)"
        if missing
        else None
    )
    if why:
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if "tests/cluster/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Path:
    """A cluster stack of the tests' own, with TLS (every listener; Redis and Kafka with passwords),
    as hosts that talk across a network run; its model store an S3 store on a host of its own; or, for
    the edit-test loop, the one already running (started as here) in the run directory
    TRILLIUM_TEST_CLUSTER names, left running."""
    if existing := os.environ.get("TRILLIUM_TEST_CLUSTER"):
        yield Path(existing)
        return
    run_dir = tmp_path_factory.mktemp("cluster")
    stack.up(run_dir, TOPOLOGY, cluster=True, link_delay=True, object_store=True, tls=True)
    yield run_dir
    state = stack.read_state(run_dir)
    keys = object_store.stack_env(state)
    stack.down(run_dir)
    passwords = tls.load(state).secrets()
    assert_no_secret_in_logs(
        run_dir, [*(stack.read_token(run_dir, scope) for scope in SCOPES), keys["AWS_SECRET_ACCESS_KEY"], *passwords]
    )


@pytest.fixture(scope="session")
def uninterrupted(cluster) -> dict:
    """The fault job's metrics on a healthy network: what every fault test's model must equal."""
    client = CoordinatorClient.for_stack(cluster)
    try:
        view = client.follow(client.submit(cluster_job(FAULT_EPOCHS))["id"], timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished" and view["job"]["recoveries"] == [], view["job"]
    return view["job"]["metrics"]


@pytest.fixture(scope="session")
def network(cluster) -> Network:
    net = Network(stack.read_state(cluster)["hosts"])
    yield net
    net.heal()


@pytest.fixture(autouse=True)
def healed_and_idle(request):
    """Each test starts on a healed network and an idle stack, and leaves it so."""
    yield
    if "cluster" not in request.fixturenames:
        return
    request.getfixturevalue("network").heal()
    client = CoordinatorClient.for_stack(request.getfixturevalue("cluster"))
    try:
        left = [j for j in client.jobs() if j["state"] in ACTIVE]
        for job in left:
            if job["state"] != "stopping":
                client.stop(job["id"])
            client.follow(job["id"], timeout_s=180)
    finally:
        client.close()
    assert not left, f"the test left jobs active: {[(j['id'], j['state']) for j in left]}"


def pytest_terminal_summary(terminalreporter) -> None:
    if FAULTS:
        terminalreporter.section("faults: seconds to detect (a new attempt) and to recover (training again)")
        for row in FAULTS:
            terminalreporter.write_line(
                f"{row['fault']:<48} detect {row['detect_s']!s:>6}  recover {row['recover_s']!s:>6}  "
                f"recoveries {row['recoveries']}  auc {row['auc']}"
            )
