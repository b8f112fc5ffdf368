"""deploy/k8s renders (kustomize, the base and the production and persia-100t overlays) and every object it renders
validates, in strict mode, against the Kubernetes OpenAPI schemas kubernetes-validate ships, for the
oldest version the manifests support (1.28: the pod-index label) and the newest bundled. What no
schema says is checked below: probes, resources, the token from a Secret, scrape annotations, and
only trillium/config.py's variable names. No cluster runs them here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from trillium import config

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / ".cache/bin/kustomize"  # built by `make setup` from the Go module proxy
VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
CONFIG_NAMES = {getattr(config, name) for name in dir(config) if name.startswith("ENV_")}


def _render(path: str) -> list[dict]:
    assert KUSTOMIZE.exists(), f"{KUSTOMIZE} missing: `make setup` builds it"
    out = subprocess.run([str(KUSTOMIZE), "build", str(REPO / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


PERSIA_100T = "deploy/k8s/overlays/persia-100t"  # docs/scaling.md derives its counts and sizes


@pytest.fixture(scope="module", params=["deploy/k8s/base", "deploy/k8s/overlays/production", PERSIA_100T])
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


@pytest.fixture(scope="module")
def objects(rendered) -> list[dict]:
    return rendered[1]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_openapi_schemas(objects, version) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the bad field


def test_a_misspelt_field_is_caught() -> None:
    """The validation above can fail: strict mode rejects a field Kubernetes does not know."""
    deployment = next(o for o in _render("deploy/k8s/base") if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def _workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def test_the_topology_and_its_kinds(rendered) -> None:
    path, objects = rendered
    kinds = {name: o["kind"] for name, o in _workloads(objects).items()}
    # More than one embedding worker or data loader needs an index each: a StatefulSet's ordinal.
    many = "StatefulSet" if path == PERSIA_100T else "Deployment"
    assert kinds == {
        "coordinator": "Deployment",
        "embedding-ps": "StatefulSet",
        "embedding-worker": many,
        "nn-worker": "StatefulSet",
        "data-loader": many,
        "serving": "Deployment",
    }
    ps = _workloads(objects)["embedding-ps"]
    assert [c["metadata"]["name"] for c in ps["spec"]["volumeClaimTemplates"]] == ["checkpoints"]
    services = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Service"}
    assert services["coordinator"]["ports"][0]["port"] == 8080
    assert {p["name"]: p["port"] for p in services["serving"]["ports"]} == {"http": 8080, "grpc": 50051}
    assert _workloads(objects)["serving"]["spec"]["replicas"] >= 2
    assert services["kafka"]["type"] == services["redis"]["type"] == "ExternalName"


def test_every_container_is_probed_limited_and_given_the_token_by_a_secret(objects) -> None:
    for name, workload in _workloads(objects).items():
        template = workload["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "trillium", name
        for c in template["spec"]["containers"]:
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
            assert set(c["resources"]["requests"]) >= {"cpu", "memory"}, name
            assert set(c["resources"]["limits"]) >= {"cpu", "memory"}, name
            env = {e["name"]: e for e in c["env"]}
            for var in (config.ENV_TOKEN, config.ENV_REDIS_PASSWORD, config.ENV_KAFKA_PASSWORD):
                assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "trillium-secrets", (name, var)
            # Only names trillium/config.py reads (POD_INDEX feeds --index, not a service).
            assert set(env) - {"POD_INDEX"} <= CONFIG_NAMES, (name, set(env) - CONFIG_NAMES)


def test_the_configmap_names_only_config_variables(objects) -> None:
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert set(configmap["data"]) <= CONFIG_NAMES, set(configmap["data"]) - CONFIG_NAMES


def test_the_persia_100t_overlay_is_sized_as_docs_scaling_says() -> None:
    """The counts and sizes of docs/scaling.md's summary table, and every StatefulSet's index from its
    ordinal (two pods of one role with one index would register as one worker)."""
    workloads = _workloads(_render(PERSIA_100T))
    replicas = {name: w["spec"]["replicas"] for name, w in workloads.items()}
    assert replicas == {
        "coordinator": 1,
        "embedding-ps": 144,
        "embedding-worker": 64,
        "nn-worker": 64,
        "data-loader": 32,
        "serving": 2,
    }

    def container(name: str) -> dict:
        return workloads[name]["spec"]["template"]["spec"]["containers"][0]

    ps = container("embedding-ps")
    assert ps["resources"]["requests"]["memory"] == ps["resources"]["limits"]["memory"] == "2450Gi"
    assert {"name": "TRILLIUM_THREADS", "value": "16"} in ps["env"]
    assert {"name": "spill", "mountPath": "/var/lib/trillium-spill"} in ps["volumeMounts"]
    (spill,) = [v for v in workloads["embedding-ps"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "spill"]
    assert spill["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"] == "2Ti"
    nn = container("nn-worker")
    assert nn["resources"]["requests"]["nvidia.com/gpu"] == nn["resources"]["limits"]["nvidia.com/gpu"] == 1
    for name, w in workloads.items():
        if w["kind"] == "StatefulSet":
            assert "$(POD_INDEX)" in container(name)["args"], name
            assert container(name)["image"].startswith("registry.example.com/"), name
