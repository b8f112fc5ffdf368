"""A partition that does not heal, and the operator's move when a Kubernetes node is lost: the
job says whom it waits for; the same role and index started on another host takes the shard over
from the checkpoint; the old process, when its host comes back, is refused and writes nothing.

Last in the run (files run by name): its stack ends with embedding_ps-1 replaced.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
from timeline import after_first_checkpoint, check, record_fault
from waiting import wait_until

from trillium import stack
from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_THREADS,
    EXIT_RESTART,
)
from trillium.stack import object_store, tls
from trillium.stack.client import CoordinatorClient
from trillium.stack.hosts import GRPC_PORT, HOST_IFNAME, HTTP_PORT
from trillium.stack.links import Network
from trillium.stack.procs import scope_env

pytestmark = pytest.mark.cluster


def _start(cluster, host, role: str, index: int) -> subprocess.Popen[bytes]:
    """`role`-`index` on `host`, configured as the stack's own processes are, and restarted when it
    asks to be (EXIT_RESTART: a PS shard joins each new attempt afresh) as a container would be."""
    st = stack.read_state(cluster)
    env = {
        ENV_KAFKA_BOOTSTRAP: st["kafka"]["bootstrap"],
        ENV_REDIS_URL: st["redis"]["url"],
        ENV_COORDINATOR_URL: st["coordinator_url"],
        **scope_env(cluster),
        ENV_RUN_DIR: str(cluster),
        ENV_THREADS: "1",
        "GLOO_SOCKET_IFNAME": HOST_IFNAME,
        "PYTHONUNBUFFERED": "1",
        "PATH": "/usr/bin:/bin",
    } | object_store.stack_env(st)
    env |= tls.process_env(st, host.name, host.address)
    service = [sys.executable, "-m", f"trillium.services.{role}", "--index", str(index), "--host", host.address]
    service += ["--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)]
    restarting = f"while {shlex.join(service)}; [ $? -eq {EXIT_RESTART} ]; do :; done"
    argv = ["ip", "netns", "exec", host.netns, "bash", "-c", restarting]
    with open(cluster / "logs" / f"{role}-{index}-replacement.log", "ab") as log:
        return subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cluster, start_new_session=True
        )


def _proc(cluster, name: str) -> dict:
    return next(p for p in stack.read_state(cluster)["processes"] if p["name"] == name)


def test_a_shard_cut_off_for_good_is_replaced_on_another_host_and_fenced_out(
    cluster, network: Network, uninterrupted
) -> None:
    job_id, timeline = after_first_checkpoint(cluster)
    attempt = timeline.attempt_before(time.monotonic())
    cut = network.partition("embedding_ps-1")
    client = CoordinatorClient.for_stack(cluster)
    replacement = None
    try:
        # The job says whom it waits for, and since when, instead of hanging silently.
        # (The processes restarting for the new attempt show as not registered for a moment.)
        def waits_for_the_shard() -> bool:
            waiting = client.job(job_id)["waiting_for"]
            return len(waiting) == 1 and waiting[0].startswith("embedding_ps-1 unreachable since ")

        wait_until(waits_for_the_shard, "the job to say it waits for embedding_ps-1", 60)

        # The operator's move: the same role and index on a new host.
        host = network.add_host("embedding_ps-1-b")
        replacement = _start(cluster, host, "embedding_ps", 1)
        started = time.monotonic()
        wait_until(lambda: timeline.progress_at(started) is not None, "the job to train on the replacement", 180)
        scheme = urlsplit(stack.read_state(cluster)["coordinator_url"]).scheme
        assert next(w for w in client.workers() if w["name"] == "embedding_ps-1")["http_url"].startswith(
            f"{scheme}://{host.address}:"
        )

        # The old host comes back: its process is refused, exits, and stays stopped.
        network.heal()
        wait_until(
            lambda: _proc(cluster, "embedding_ps-1")["state"] == "replaced", "the old shard to be fenced out", 60
        )
        view = timeline.wait(300)
        check(view, uninterrupted)
        holder = next(w for w in client.workers() if w["name"] == "embedding_ps-1")
        assert holder["http_url"] == f"{scheme}://{host.address}:{HTTP_PORT}", holder
        detected = timeline.new_attempt_at(cut, attempt)
        record_fault(
            "embedding_ps-1 cut off for good, replaced", cut, detected, started, timeline.progress_at(started), view
        )
        assert (cluster / "logs" / "embedding_ps-1.log").read_text().count("replaced by another process") == 1
    finally:
        client.close()
        if replacement is not None:
            os.killpg(replacement.pid, signal.SIGTERM)
            replacement.wait(30)
