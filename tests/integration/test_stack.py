"""The full local stack: every service up and healthy, registered with the coordinator,
restarted after a crash, and gone after `down`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from trillium.config import ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL, ROLES, StackTopology
from trillium.stack import LauncherError, down, read_state, read_token, status, up
from trillium.stack.procs import TOKEN_FILES, pid_alive

TOPOLOGY = StackTopology()  # the default: 1 coordinator, 2 PS shards, 1 embedding worker, 2 NN ranks, 1 loader


@pytest.fixture(scope="module")
def stack(infra, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stack")
    # The session's broker and Redis are "external" to this stack: that path is tested too.
    st = up(run_dir, TOPOLOGY, kafka_bootstrap=infra.kafka_bootstrap, redis_url=infra.redis_database(3))
    yield run_dir, st
    down(run_dir)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trillium.cli", *args], capture_output=True, text=True, timeout=120)


def test_status_json_names_endpoints_and_all_services_healthy(stack, infra) -> None:
    run_dir, _ = stack
    out = _cli("status", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    st = json.loads(out.stdout)
    assert st["healthy"] is True
    assert st["kafka"] == {"bootstrap": infra.kafka_bootstrap, "external": True, "ok": True, "brokers": 1}
    assert st["redis"]["url"] == infra.redis_database(3) and st["redis"]["ok"]
    names = sorted(p["name"] for p in st["processes"])
    expected = sorted(f"{role}-{i}" for role in ROLES for i in range(TOPOLOGY.count(role)))
    assert names == expected
    assert all(p["health"]["ok"] and p["health"]["role"] == p["role"] for p in st["processes"])


def test_services_registered_with_coordinator_behind_token(stack) -> None:
    run_dir, st = stack
    url = st["coordinator_url"] + "/v1/workers"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong-token-wrong-token"}).status_code == 401
    token = read_token(run_dir)
    for name in TOKEN_FILES.values():  # every scope's token is the stack user's alone
        assert oct((run_dir / name).stat().st_mode & 0o777) == "0o600", name
    deadline = time.monotonic() + 20
    while True:
        workers = httpx.get(url, headers={"Authorization": f"Bearer {token}"}).json()
        if len(workers) == 7 and all(w["status"] == "healthy" for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # Every process of the stack but the serving replica, which takes part in no job and registers nowhere.
    assert sorted((w["role"], w["index"]) for w in workers) == sorted(
        (role, i) for role in ROLES if role != "serving" for i in range(TOPOLOGY.count(role))
    )
    assert all(w["status"] == "healthy" for w in workers), workers


def test_crashed_service_is_restarted(stack) -> None:
    run_dir, _ = stack
    before = {p["name"]: p for p in read_state(run_dir)["processes"]}
    os.kill(before["embedding_worker-0"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = status(run_dir)
        proc = next(p for p in st["processes"] if p["name"] == "embedding_worker-0")
        if proc["restarts"] == 1 and proc["health"]["ok"]:
            break
        time.sleep(0.5)
    assert proc["restarts"] == 1 and proc["pid"] != before["embedding_worker-0"]["pid"]
    assert proc["health"]["ok"], proc


def test_second_up_in_same_run_dir_is_refused(stack) -> None:
    run_dir, _ = stack
    with pytest.raises(LauncherError, match="already running"):
        up(run_dir)


def test_down_leaves_no_process_behind(infra, tmp_path) -> None:
    env = os.environ | {ENV_KAFKA_BOOTSTRAP: infra.kafka_bootstrap, ENV_REDIS_URL: infra.redis_database(4)}
    up = subprocess.run(
        [sys.executable, "-m", "trillium.cli", "up", "--run-dir", str(tmp_path), "--nn-ranks", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    st = read_state(tmp_path)
    pids = [st["supervisor_pid"], *(p["pid"] for p in st["processes"])]
    assert all(pid_alive(pid) for pid in pids)
    down = _cli("down", "--run-dir", str(tmp_path))
    assert down.returncode == 0 and "stack stopped" in down.stdout
    assert not any(pid_alive(pid) for pid in pids)
    assert _cli("status", "--run-dir", str(tmp_path)).returncode == 1
