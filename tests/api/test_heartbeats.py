"""How the coordinator hands a job to its workers: a heartbeat's answer carries the job record
only when it changed since the worker's last (named by its digest), and every change of a
record is announced on Redis so that workers ask at once, against the real coordinator."""

from __future__ import annotations

import time

import redis

from trillium.wire import state

WORKER = {"name": "data_loader-9", "role": "data_loader", "index": 9, "http_url": "http://127.0.0.1:9", "pid": 9}


def test_a_heartbeat_carries_the_job_only_when_it_changed(api_stack, tiny_job) -> None:
    http = api_stack.http
    job = tiny_job.model_copy(update={"training": tiny_job.training.model_copy(update={"epochs": 1})})
    job_id = http.post("/jobs", json=job.model_dump(mode="json")).raise_for_status().json()["id"]
    api_stack.wait_for(job_id, {"finished"})
    deadline = time.monotonic() + 30
    # Its last change: the topics are deleted once its workers have left.
    while not http.get(f"/jobs/{job_id}").json()["job"]["topics_deleted"]:
        assert time.monotonic() < deadline, "the finished job's topics were not deleted"
        time.sleep(0.1)
    worker = api_stack.services  # registration and heartbeats take the services' token alone
    worker.post("/workers", json=WORKER).raise_for_status()
    beat = f"/workers/{WORKER['name']}/heartbeat"
    announcements = redis.Redis.from_url(api_stack.redis_url, decode_responses=True).pubsub()
    try:
        first = worker.post(beat, json={"health": {}}).raise_for_status().json()
        assert first["job"]["id"] == job_id and first["job"]["state"] == "finished"
        digest = first["job_digest"]
        again = worker.post(beat, json={"health": {}, "job_digest": digest}).json()
        assert again["job"] is None and again["job_digest"] == digest
        stale = worker.post(beat, json={"health": {}, "job_digest": "0" * 32}).json()
        assert stale["job"] == first["job"] and stale["job_digest"] == digest

        announcements.subscribe(state.JOB_CHANGED)
        assert announcements.get_message(timeout=5)["type"] == "subscribe"
        assert http.delete(f"/jobs/{job_id}").status_code == 204
        heard = []  # channels are server-wide: another stack on this Redis may announce too
        deadline = time.monotonic() + 5
        while job_id not in heard and time.monotonic() < deadline:
            message = announcements.get_message(timeout=1)
            heard += [message["data"]] if message else []
        assert job_id in heard
        # No current job any more: the worker holding the old record is told so.
        gone = worker.post(beat, json={"health": {}, "job_digest": digest}).json()
        assert gone["job"] is None and gone["job_digest"] is None
    finally:
        announcements.close()
        worker.delete(f"/workers/{WORKER['name']}")
