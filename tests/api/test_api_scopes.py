"""Four tokens, each opening its own routes alone (trillium.scopes), on the running stack: an
operator's, the services', a prediction client's and a scraper's; and a registration that names
another host than the caller's is refused, so the services' token is no way to receive a shard's
lookups at an address of one's choosing."""

from __future__ import annotations

import json

import grpc
import httpx

from trillium.scopes import SCOPES
from trillium.wire.pb import serving_pb2 as pb

PREDICT = f"/{pb.DESCRIPTOR.services_by_name['Serving'].full_name}/Predict"


def test_each_token_opens_its_scope_alone(api_stack, served) -> None:
    tokens = {scope: api_stack.scope_token(scope) for scope in SCOPES}
    assert len(set(tokens.values())) == len(SCOPES)
    workers = {w["name"]: w["http_url"] for w in api_stack.http.get("/workers").json()}
    coordinator, ps, serving, model = api_stack.url, workers["embedding_ps-0"], served.url, served.model
    # (method, URL, body, the scopes let through): anyone else is answered 401.
    routes = [
        ("GET", f"{coordinator}/v1/jobs", None, {"operate"}),
        ("POST", f"{coordinator}/v1/jobs", {}, {"operate"}),
        ("POST", f"{coordinator}/v1/jobs/x/forget", {"table": "a", "values": ["u"]}, {"operate"}),
        ("GET", f"{coordinator}/v1/workers", None, {"operate", "services"}),
        ("POST", f"{coordinator}/v1/workers", {}, {"services"}),
        ("POST", f"{coordinator}/v1/workers/nn_worker-99/heartbeat", {"health": {}}, {"services"}),
        ("GET", f"{coordinator}/metrics", None, {"operate", "observe"}),
        ("GET", f"{ps}/status", None, {"operate", "observe"}),
        ("POST", f"{ps}/job/capture", {}, {"services"}),
        ("POST", f"{ps}/job/forget", {}, {"services"}),
        ("POST", f"{serving}/v1/models/{model}:predict", {"instances": [served.probe]}, {"predict", "operate"}),
        ("GET", f"{serving}/v1/models", None, {"predict", "operate"}),
        ("POST", f"{serving}/v1/models/{model}/unpin", None, {"operate"}),
        ("GET", f"{serving}/metrics", None, {"operate", "observe"}),
    ]
    for method, url, body, allowed in routes:
        for scope, token in tokens.items():
            r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert (r.status_code != 401) == (scope in allowed), (method, url, scope, r.status_code, r.text)
            if r.status_code == 401:
                assert "scope" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"

    request = pb.PredictRequest(model=model, instances=json.dumps([served.probe]).encode(), format="json")
    with grpc.insecure_channel(served.grpc_address) as channel:
        call = channel.unary_unary(PREDICT)
        for scope, token in tokens.items():
            try:
                reply = call(request.SerializeToString(), metadata=(("authorization", f"Bearer {token}"),), timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code, reply = err.code(), None
            if scope in ("predict", "operate"):
                assert code == grpc.StatusCode.OK and len(pb.PredictResponse.FromString(reply).predictions) == 1
            else:
                assert code == grpc.StatusCode.UNAUTHENTICATED, (scope, code)


def test_a_process_registers_only_at_its_own_host(api_stack) -> None:
    """From this machine (loopback), a registration at 192.0.2.7 (TEST-NET: resolving it sends
    nothing) is refused 403 and stored nowhere, for its HTTP URL and for its gRPC address."""
    services = api_stack.services
    elsewhere = [
        {"http_url": "http://192.0.2.7:8080", "grpc_address": None},
        {"http_url": "http://127.0.0.1:8080", "grpc_address": "192.0.2.7:50051"},
    ]
    for where in elsewhere:
        reg = {"name": "embedding_ps-7", "role": "embedding_ps", "index": 7, "pid": 7} | where
        r = services.post("/workers", json=reg)
        assert r.status_code == 403 and "registers at 192.0.2.7 (192.0.2.7) but calls from 127.0.0.1" in r.text
    assert "embedding_ps-7" not in {w["name"] for w in api_stack.http.get("/workers").json()}
    here = {"name": "embedding_ps-7", "role": "embedding_ps", "index": 7, "pid": 7, "http_url": "http://localhost:9"}
    try:
        assert services.post("/workers", json=here).status_code == 200  # loopback names are this host
    finally:
        services.delete("/workers/embedding_ps-7")
