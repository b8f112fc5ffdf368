"""What the API refuses, and how: no token, unknown jobs, invalid configs (naming the field),
oversized bodies and unsupported media types, against the real coordinator."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml

from trillium.job import JobConfig

LIMIT = 1 << 20


def _v1_operations(api_stack) -> list[tuple[str, str]]:
    schema = api_stack.http.get(api_stack.url + "/openapi.json").raise_for_status().json()
    return sorted(
        (method.upper(), path) for path, ops in schema["paths"].items() if path.startswith("/v1/") for method in ops
    )


def _job_json(job: JobConfig) -> dict:
    return job.model_dump(mode="json")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-wrong-token-wrong"}, {"Authorization": "Basic dXNlcjpwYXNz"}],
    ids=["none", "wrong", "not-bearer"],
)
def test_every_v1_route_needs_the_token(api_stack, headers) -> None:
    operations = _v1_operations(api_stack)
    assert {
        ("POST", "/v1/jobs"),
        ("POST", "/v1/jobs/{job_id}/pause"),
        ("PUT", "/v1/jobs/{job_id}/staleness"),
        ("GET", "/v1/jobs/{job_id}/tables"),
        ("GET", "/v1/workers"),
    } <= set(operations)
    with httpx.Client(base_url=api_stack.url, headers=headers) as anonymous:
        for method, path in operations:
            url = re.sub(r"\{[^}]+\}", "x", path)
            r = anonymous.request(method, url, json={} if method in ("POST", "PUT", "PATCH") else None)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"


def test_only_health_answers_without_the_token_and_says_only_up_or_ready(api_stack) -> None:
    assert httpx.get(api_stack.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(api_stack.url + "/readyz").json() == {"ready": True}
    assert api_stack.http.get(api_stack.url + "/status").json()["role"] == "coordinator"  # the rest, with the token
    for path in ("/status", "/metrics", "/openapi.json", "/docs"):
        anonymous = httpx.get(api_stack.url + path)
        assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer", path
        assert api_stack.http.get(api_stack.url + path).status_code == 200, path
    assert api_stack.http.get(api_stack.url + "/openapi.json").json()["info"]["title"] == "Trillium coordinator"
    assert "SwaggerUIBundle" in api_stack.http.get(api_stack.url + "/docs").text


def test_unknown_job_is_404_on_every_job_route(api_stack) -> None:
    http = api_stack.http
    for method, path in _v1_operations(api_stack):
        if "{job_id}" not in path:
            continue
        body = {"bound": 1} if path.endswith("/staleness") and method in ("PUT", "PATCH") else None
        body = {"ps_shards": 1} if path.endswith("/reshard") else body
        body = {"table": "a", "values": ["u1"]} if path.endswith("/forget") else body
        path = path.removeprefix("/v1").replace("{job_id}", "no-such-job").replace("{step}", "0")
        r = http.request(method, path, json=body)
        assert r.status_code == 404 and r.json() == {"detail": "no job 'no-such-job'"}, (method, path, r.text)
    assert api_stack.services.post("/workers/nn_worker-99/heartbeat", json={"health": {}}).status_code == 404


def test_invalid_configs_are_422_naming_the_field(api_stack, tiny_job) -> None:
    http = api_stack.http
    good = _job_json(tiny_job)

    bad_batch = json.loads(json.dumps(good))
    bad_batch["training"]["batch_size"] = 0
    r = http.post("/jobs", json=bad_batch)
    assert r.status_code == 422
    assert ["body", "training", "batch_size"] in [e["loc"] for e in r.json()["detail"]]

    misspelt = json.loads(json.dumps(good))
    misspelt["trainig"] = misspelt.pop("training")
    r = http.post("/jobs", content=yaml.safe_dump(misspelt), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422
    locs = [e["loc"] for e in r.json()["detail"]]
    assert ["body", "trainig"] in locs and ["body", "training"] in locs

    undefined_table = json.loads(json.dumps(good))
    undefined_table["slots"][0]["table"] = "nope"
    r = http.post("/jobs", json=undefined_table)
    assert r.status_code == 422 and "slots[0] 'c1': table 'nope' is not defined" in r.text

    relative = json.loads(json.dumps(good))
    relative["data"]["train"] = "tiny/train.tsv"
    r = http.post("/jobs", json=relative)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "data", "train"]

    for body in ("training: [unclosed", "- a list, not a mapping", "a: &x [*x, *x]"):
        r = http.post("/jobs", content=body, headers={"Content-Type": "text/yaml"})
        assert r.status_code == 422, (body, r.text)
    # Aliases cannot blow a small body up into a huge document.
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(6)
    )
    r = http.post("/jobs", content=bomb, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422 and "expands to more than" in r.text

    # Nothing is stored that could not be read back: bodies nest 32 levels at most.
    deep = json.loads(json.dumps(good))
    deep["model"]["kwargs"]["hidden"] = json.loads("[" * 200 + "]" * 200)
    r = http.post("/jobs", json=deep)
    assert r.status_code == 422 and "nests deeper than 32 levels" in r.text
    r = api_stack.services.post(
        "/workers/coordinator-0/heartbeat", json={"health": {"x": json.loads("[" * 200 + "]" * 200)}}
    )
    assert r.status_code == 422 and "nests deeper than 32 levels" in r.text

    r = http.post("/jobs", content=json.dumps(good), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415

    for bound in (-1, "two", 1 << 40):
        r = http.put("/jobs/x/staleness", json={"bound": bound})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "bound"], r.text
    assert http.put("/jobs/x/staleness", json={}).status_code == 422  # the bound is required (null: unbounded)
    for shards in (0, -1, 65, "two", None):
        r = http.post("/jobs/x/reshard", json={"ps_shards": shards})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ps_shards"], r.text
    assert http.post("/jobs/x/reshard", json={}).status_code == 422  # ps_shards is required
    assert (
        api_stack.services.post(
            "/workers",
            json={"name": "nn_worker-0", "role": "embedding_ps", "index": 0, "http_url": "http://x", "pid": 1},
        ).status_code
        == 422
    )


def test_a_job_may_read_data_keep_state_and_import_code_only_where_the_operator_allows(api_stack, tiny_job) -> None:
    """TRILLIUM_ALLOWED_PATHS (here: pytest's temporary directories, tests/data and the examples)
    and TRILLIUM_MODEL_MODULES (the default: trillium.models, examples); a name that becomes a
    path is one component. A data file outside the roots is refused before any process reads it:
    no job error can then quote its first line."""
    good = _job_json(tiny_job)
    stored = len(api_stack.http.get("/jobs").json())
    outside = {
        ("checkpoint", "dir"): "/etc/trillium",
        ("publish", "dir"): "s3://someone-elses-bucket/models",
        ("init_from", "dir"): "/root",
        ("data", "train"): "/proc/self/environ",
        ("data", "test"): good["data"]["train"] + "/../../../../../../etc/*",
    }
    for (section, field), location in outside.items():
        job = json.loads(json.dumps(good))
        job[section] = (job.get(section) or {}) | {field: location}
        if section == "init_from":
            job[section]["job"] = "earlier-1a2b3c4d"
        r = api_stack.http.post("/jobs", json=job)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", section, field] and "TRILLIUM_ALLOWED_PATHS" in r.text
    listed = json.loads(json.dumps(good))
    listed["data"]["train"] = [good["data"]["train"], "/etc/passwd"]
    r = api_stack.http.post("/jobs", json=listed)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "data", "train", 1], r.text
    spill = json.loads(json.dumps(good))
    table = next(iter(spill["tables"]))
    spill["tables"][table] |= {"memory_budget_gb": 0.5, "disk": "/var/lib/../../etc"}
    r = api_stack.http.post("/jobs", json=spill)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "tables", table, "disk"], r.text

    code = json.loads(json.dumps(good))
    code["model"]["cls"] = "subprocess:Popen"
    r = api_stack.http.post("/jobs", json=code)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model", "cls"], r.text
    assert "TRILLIUM_MODEL_MODULES" in r.text

    escape = json.loads(json.dumps(good)) | {"init_from": {"job": "../../etc"}}
    r = api_stack.http.post("/jobs", json=escape)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "init_from", "job"], r.text
    assert len(api_stack.http.get("/jobs").json()) == stored, "a refused job was stored"


def test_bodies_over_1_mib_are_413(api_stack) -> None:
    http = api_stack.http
    just_fits = b" " * (LIMIT - 2) + b"{}"  # whitespace-padded JSON: read, parsed, found invalid
    assert http.post("/jobs", content=just_fits, headers={"Content-Type": "application/json"}).status_code == 422
    too_big = b" " * LIMIT + b"{}"
    r = http.post("/jobs", content=too_big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over 1048576 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the size is only known as it streams
        for _ in range(17):
            yield b" " * (1 << 16)

    r = http.post("/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers and r.status_code == 413
    # Refused before any route runs: also without a token.
    assert httpx.post(api_stack.url + "/v1/jobs", content=too_big).status_code == 413
